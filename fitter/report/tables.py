"""The report's tables: the trials (fitter.results.trials, the one schema) printed compactly, and the Pareto front
(fitter.results.table, the one table `fitter tune` prints too): the confirm runs of pareto.json, or, while the tune
still runs, the study's own front (`study.best_trials`) over the baseline trial."""

from __future__ import annotations

from typing import Any

import optuna
import pandas as pd
from optuna.trial import FrozenTrial

from fitter.report.load import StudyResult
from fitter.results.measurement import MeasurementRecord, speed
from fitter.results.pareto import Entry, picks, ratios
from fitter.results.table import PARETO_COLUMNS, Front, front_lines, front_of, front_of_entries, searched_part
from fitter.results.trials import trial_vram


def front(result: StudyResult) -> Front:
    if result.pareto is not None:
        return front_of(result.pareto)
    return _front_from_study(result.study)


def baseline_trial(study: optuna.Study) -> FrozenTrial | None:
    return next((t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("phase") == "baseline"), None)


def _front_from_study(study: optuna.Study) -> Front:
    """A running study: its own Pareto front (feasible trials only), each trial's single measurement, its ratios
    over the baseline trial's."""
    base = baseline_trial(study)
    base_m = base.user_attrs.get("measurement") if base else None
    entries: list[Entry] = []
    seen = set()
    for t in sorted(study.best_trials, key=lambda t: t.number):
        m = t.user_attrs.get("measurement")
        key = t.user_attrs.get("key") or t.number
        if key in seen or not isinstance(m, dict) or speed(m, "tg") is None or speed(m, "pp") is None:
            continue  # a trial answered from storage repeats an earlier one
        seen.add(key)
        entries.append(Entry(t.number, tuple(t.user_attrs.get("flags") or ()), MeasurementRecord.of(m),
                             t.user_attrs.get("phase"), trial_vram(t) or 0, ratios(m, base_m)))
    baseline = None
    if base is not None and isinstance(base_m, dict):
        baseline = Entry(base.number, tuple(base.user_attrs.get("flags") or ()), MeasurementRecord.of(base_m),
                         "baseline")
    return front_of_entries(baseline, entries, picks(entries), "study")


def pareto_frame(f: Front) -> pd.DataFrame:
    return pd.DataFrame(f.records, columns=list(PARETO_COLUMNS))


def pareto_text(f: Front) -> str:
    """The front as `fitter tune` prints it, headed by where it came from."""
    source = "confirm runs, pareto.json" if f.source == "pareto.json" else \
        "single trial runs: the study is still running, no pareto.json yet"
    lines = [f"Pareto front ({source}):", *front_lines(f)]
    if not f.rows:
        lines.append("  (none: no feasible trial has finished)")
    return "\n".join(lines)


def short_flags(flags: list[str]) -> str:
    """The searched part of a trial's flags (fitter.results.table.searched_part), long values clipped."""
    return " ".join(f if len(f) <= 24 else f[:21] + "..." for f in searched_part(flags))


def trials_text(df: pd.DataFrame) -> str:
    """The trials table, compact, for a terminal."""
    lines = [f"{'#':>4} {'state':<8} {'phase':<13} {'outcome':<9} {'pp t/s':>8} {'tg t/s':>7} {'VRAM':>7} "
             f"{'pred':>7}  flags / reason"]
    for r in df.to_dict("records"):
        what = short_flags(str(r["flags"]).split())
        if r["outcome"] not in ("ok",) and r["reason"]:
            what = f"{what}  ({_clip(str(r['reason']), 60)})" if what else _clip(str(r["reason"]), 80)
        if not pd.isna(r["same_as"]):
            what = f"= #{int(r['same_as'])}  {what}"
        lines.append(f"{r['number']:>4} {r['state'][:8]:<8} {str(r['phase'] or '-')[:13]:<13} "
                     f"{str(r['outcome'])[:9]:<9} {_num(r['pp_ts'], 8, 1)} {_num(r['tg_ts'], 7, 1)} "
                     f"{_num(r['vram_mib'], 7, 1)} {_num(r['predicted_vram_mib'], 7, 1)}  {what}")
    return "\n".join(lines)


def _num(x: Any, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if x is None or pd.isna(x) else f"{float(x):{width}.{digits}f}"


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."
