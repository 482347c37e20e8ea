"""What a tune searches: the search space (`space`), the request and its candidates (`request`), the estimator's
screen (`screen`), the structured plan and the screener (`plan`), the placement on several GPUs and the expert order
on one (`split`), pooling by physics (`pooling`), and `--dry-run`'s report (`dry_run`). No trial runs here."""
