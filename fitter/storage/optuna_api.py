"""Optuna's private API, every use of it in fitter.

optuna gives no public way to a study's storage or a live trial's id, which fitter needs because it runs trials
itself rather than through Study.optimize(): a heartbeat per trial, a trial's params set from a plan (not from
suggest_* calls), a trial another worker left RUNNING failed by this one. Nothing else in fitter reaches past
Optuna's public API (tests/test_layout.py holds that); an Optuna upgrade that moves these is met here alone.
"""

from __future__ import annotations

from typing import Any

import optuna


def study_storage(study: optuna.Study) -> optuna.storages.BaseStorage:
    """The storage a study writes to (Study._storage)."""
    return study._storage


def trial_id(trial: optuna.Trial) -> int:
    """A live trial's id in its storage (Trial._trial_id)."""
    return trial._trial_id


def frozen(study: optuna.Study, trial: optuna.Trial) -> optuna.trial.FrozenTrial:
    """A live trial as its storage holds it now."""
    return study._storage.get_trial(trial._trial_id)


def record_heartbeat(study: optuna.Study, trial: optuna.Trial) -> None:
    """One heartbeat of the trial, where the storage keeps them (RDB storages; a journal has only fitter's claims)."""
    storage = study._storage
    if hasattr(storage, "record_heartbeat"):
        storage.record_heartbeat(trial._trial_id)


def set_params(study: optuna.Study, trial: optuna.Trial, params: dict[str, Any],
               distributions: dict[str, optuna.distributions.BaseDistribution]) -> None:
    """The trial's params, as Trial.suggest_* would store them."""
    for name, value in params.items():
        d = distributions[name]
        study._storage.set_trial_param(trial._trial_id, name, d.to_internal_repr(value), d)


def fail_running(study: optuna.Study, number: int, reason: str) -> None:
    """Fail trial `number` with `reason` unless it is finished already (by its worker, or failed by another)."""
    storage = study._storage
    tid = storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    try:
        storage.set_trial_user_attr(tid, "reason", reason)
        storage.set_trial_state_values(tid, state=optuna.trial.TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        pass
