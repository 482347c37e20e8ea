"""`fitter tune`, the run: its options (`options`), the target the trials run on (`targets`), the baseline
(llama.cpp's own `--fit` choice, `baseline`), the constrained Optuna study over measured trials (`study`), the
interleaved confirm rounds (`confirm`) and the session that runs them in steps and writes the result (`session`).

What is searched is fitter.search; where studies live, fitter.storage; what a result is, fitter.results."""
