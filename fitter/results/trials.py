"""`trials.csv`: one row per trial of a study, the one schema `fitter tune` writes and `fitter report` reads, writes
and prints (and the analysis notebook reads).

Columns, in order: fitter's own (`TRIAL_COLUMNS`: what the trial was, how it ended and why, its speeds, its VRAM as
measured (fitter.results.measurement.vram_bytes), predicted and measured device MiB, the largest constraint violation,
`same_as` for an answer from storage), then Optuna's `values_<i>` (the objectives in study order), `params_<key>`
(the searched parameters), `datetime_start` and `duration`, then `flags`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pandas as pd
from optuna.trial import FrozenTrial, TrialState

from fitter.paths import write_atomic
from fitter.results.measurement import device_peaks, speed, vram_bytes
from fitter.units import MIB

TRIAL_COLUMNS = ("number", "state", "phase", "launched", "outcome", "reason", "pp_ts", "tg_ts", "vram_mib",
                 "predicted_vram_mib", "measured_vram_mib", "violation_mib", "same_as")
OPTUNA_ATTRS = ("number", "values", "params", "datetime_start", "duration")
STATE_WORDS = {TrialState.PRUNED: "screened", TrialState.RUNNING: "running", TrialState.WAITING: "waiting",
               TrialState.FAIL: "fail", TrialState.COMPLETE: "ok"}


def predicted_device_bytes(t: FrozenTrial) -> dict[str, int]:
    return {k: int(v) for k, v in (t.user_attrs.get("predicted_bytes") or {}).items() if k != "CPU"}


def trial_vram(t: FrozenTrial) -> int | None:
    """A trial's VRAM in bytes: the objective it was told (its measurement's, fitter.results.measurement.vram_bytes), or
    for a COMPLETE trial answered from storage, its copied measurement's."""
    if "vram_bytes" in t.user_attrs:
        return int(t.user_attrs["vram_bytes"])
    m = t.user_attrs.get("measurement")
    return vram_bytes(m) if t.state == TrialState.COMPLETE and m else None


def outcome(t: FrozenTrial) -> str:
    m = t.user_attrs.get("measurement") or {}
    word = t.user_attrs.get("outcome") or (m.get("outcome") if t.state != TrialState.RUNNING else None)
    return str(word or STATE_WORDS.get(t.state, t.state.name.lower()))


def violation(t: FrozenTrial) -> float | None:
    """The largest constraint value (MiB over a budget when > 0); None when the trial has none."""
    return max(t.constraints.values()) if t.constraints else None


def _mib(b: float | None) -> float | None:
    return round(b / MIB, 2) if b is not None else None


def _row(t: FrozenTrial) -> dict[str, Any]:
    ua = t.user_attrs
    m = ua.get("measurement")
    predicted = predicted_device_bytes(t)
    measured = {name: b for name, (b, _) in device_peaks(m).items()}
    return {
        "number": t.number, "state": t.state.name, "phase": ua.get("phase"), "launched": bool(ua.get("launched")),
        "outcome": outcome(t), "reason": ua.get("reason") or "", "pp_ts": speed(m, "pp"), "tg_ts": speed(m, "tg"),
        "vram_mib": _mib(trial_vram(t)),
        "predicted_vram_mib": _mib(sum(predicted.values())) if predicted else None,
        "measured_vram_mib": _mib(sum(measured.values())) if measured else None,
        "violation_mib": violation(t), "same_as": ua.get("same_as"), "flags": " ".join(ua.get("flags") or []),
    }


def trials_frame(study: optuna.Study) -> pd.DataFrame:
    """One row per trial, in trial order (see the module docstring for the columns)."""
    ours = pd.DataFrame([_row(t) for t in study.get_trials(deepcopy=False)], columns=[*TRIAL_COLUMNS, "flags"])
    ours["same_as"] = ours["same_as"].astype("Int64")  # a trial number, or missing
    theirs = study.trials_dataframe(attrs=OPTUNA_ATTRS, multi_index=False)
    if theirs.empty:
        return ours
    theirs = theirs.rename(columns={"value": "values_0"})  # a single-objective study names its one value "value"
    extra = [c for c in theirs.columns if c != "number"]
    merged = ours.merge(theirs, on="number", how="left")
    return merged[[*TRIAL_COLUMNS, *extra, "flags"]]


def write_trials_csv(folder: Path, study: optuna.Study) -> Path:
    return write_atomic(folder / "trials.csv", trials_frame(study).to_csv(index=False))
