"""The fit: the placement that puts the most on the devices within their budgets (free memory less a target)."""
