"""`fitter tune`: the search space, the estimator's screen, the constrained Optuna study over measured trials, the
confirm runs, the result model (pareto.json, trials.csv) and `fitter check`'s re-measurement.

The names below load on first use (PEP 562), so `from fitter.tune.result import …` does not import Optuna."""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "TuneOptions": "fitter.tune.session", "run_tune": "fitter.tune.session", "Tuner": "fitter.tune.study",
    "TuneRequest": "fitter.tune.request", "Candidate": "fitter.tune.request", "ParetoDoc": "fitter.tune.result",
    "Entry": "fitter.tune.result", "load_result": "fitter.tune.result", "vram_bytes": "fitter.tune.result",
    "run_check": "fitter.tune.check", "SearchSpace": "fitter.tune.space", "load_space": "fitter.tune.space",
}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'fitter.tune' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
