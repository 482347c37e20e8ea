"""The report's tables: the trials (fitter.tune.trials, the one schema) printed compactly, and the Pareto front with
picks and ratios over the baseline: the confirm runs of pareto.json, or, while the tune still runs, the study's own
front (`study.best_trials`) over the baseline trial."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import optuna
import pandas as pd
from optuna.trial import FrozenTrial

from fitter.flags.vocabulary import SEARCHED
from fitter.report.load import StudyResult
from fitter.tune.result import Entry, ParetoDoc, picks, ratios, speed, vram_bytes
from fitter.tune.trials import trial_vram
from fitter.units import MIB


def short_flags(flags: list[str]) -> str:
    """The searched part of a trial's flags (context, slots and --rpc are the same in every trial)."""
    out = []
    for i, f in enumerate(flags):
        if f in SEARCHED and i + 1 < len(flags):
            value = flags[i + 1]
            out += [f, value if len(value) <= 24 else value[:21] + "..."]
    return " ".join(out)


@dataclass(frozen=True)
class Front:
    """The Pareto front (with the baseline) as report rows; `source` says where it came from."""
    rows: list[dict[str, Any]]  # the baseline first (trial "base") when it ran, then the front by trial number
    source: str  # "pareto.json" (confirm runs) | "study" (single trial measurements of a running study)
    dropped: list[dict[str, Any]] = field(default_factory=list)


PARETO_COLUMNS = ("trial", "phase", "picks", "pp_ts", "tg_ts", "vram_mib", "pp_ratio", "tg_ratio", "pp_ci_low",
                  "pp_ci_high", "tg_ci_low", "tg_ci_high", "ties", "flags")


def front(result: StudyResult) -> Front:
    if result.pareto is not None:
        return _front_from_pareto(result.pareto)
    return _front_from_study(result.study)


def _row(trial: int | str, phase: str | None, pick: list[str], m: dict[str, Any], vram: float | None,
         r: dict[str, float | None], flags: list[str], entry: Entry | None = None) -> dict[str, Any]:
    """One row of pareto.csv; `entry` (a confirmed pareto.json entry) adds the 95 % intervals and ties."""
    iv = entry.intervals if entry is not None else {}
    return {"trial": trial, "phase": phase, "picks": ",".join(pick), "pp_ts": speed(m, "pp"), "tg_ts": speed(m, "tg"),
            "vram_mib": _mib(vram), "pp_ratio": r.get("pp"), "tg_ratio": r.get("tg"),
            "pp_ci_low": iv["pp"][0] if "pp" in iv else None, "pp_ci_high": iv["pp"][1] if "pp" in iv else None,
            "tg_ci_low": iv["tg"][0] if "tg" in iv else None, "tg_ci_high": iv["tg"][1] if "tg" in iv else None,
            "ties": " ".join(map(str, entry.ties)) if entry is not None else "", "flags": " ".join(flags)}


def _picks_by_trial(p: dict[str, int]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, n in p.items():
        out.setdefault(n, []).append(name)
    return out


def _baseline_row(m: dict[str, Any] | None, flags: list[str] | None) -> list[dict[str, Any]]:
    if not m or m.get("outcome") != "ok" or speed(m, "tg") is None:
        return []
    return [_row("base", "baseline", [], m, vram_bytes(m), ratios(m, m), flags or [])]


def _front_from_pareto(doc: ParetoDoc) -> Front:
    base = doc.baseline
    by_trial = _picks_by_trial(doc.picks)
    rows = _baseline_row(base.measurement, list(base.flags or []))
    for e in doc.pareto:
        rows.append(_row(e.trial if e.trial is not None else "?", e.phase, by_trial.get(e.trial or -1, []),
                         e.measurement or {}, e.vram_bytes, e.ratios, list(e.flags or []), e))
    return Front(rows, "pareto.json", doc.dropped)


def baseline_trial(study: optuna.Study) -> FrozenTrial | None:
    return next((t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("phase") == "baseline"), None)


def _front_from_study(study: optuna.Study) -> Front:
    """A running study: its own Pareto front (feasible trials only), each trial's single measurement."""
    base = baseline_trial(study)
    base_m = base.user_attrs.get("measurement") if base else None
    entries: list[Entry] = []
    seen = set()
    for t in sorted(study.best_trials, key=lambda t: t.number):
        m = t.user_attrs.get("measurement")
        key = t.user_attrs.get("key") or t.number
        if key in seen or speed(m, "tg") is None or speed(m, "pp") is None:
            continue  # a trial answered from storage repeats an earlier one
        seen.add(key)
        entries.append(Entry(t.number, tuple(t.user_attrs.get("flags") or ()), m, t.user_attrs.get("phase"),
                             trial_vram(t) or 0))
    by_trial = _picks_by_trial(picks(entries))
    rows = _baseline_row(base_m, base.user_attrs.get("flags") if base else None)
    for e in entries:
        assert e.trial is not None and e.measurement is not None
        rows.append(_row(e.trial, e.phase, by_trial.get(e.trial, []), e.measurement, e.vram_bytes,
                         ratios(e.measurement, base_m), list(e.flags or [])))
    return Front(rows, "study")


def pareto_frame(f: Front) -> pd.DataFrame:
    return pd.DataFrame(f.rows, columns=list(PARETO_COLUMNS))


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


def pareto_text(f: Front) -> str:
    source = "confirm runs, pareto.json" if f.source == "pareto.json" else \
        "single trial runs: the study is still running, no pareto.json yet"
    lines = [f"Pareto front ({source}):",
             f"{'trial':>5}  {'pp t/s':>8} {'tg t/s':>7} {'VRAM MiB':>9}  {'pp× [95 % CI]':<19} {'tg× [95 % CI]':<19}"
             " picks / flags"]
    if not f.rows:
        lines.append("  (none: no feasible trial has finished)")
    for r in f.rows:
        label = "llama.cpp --fit" if r["trial"] == "base" else (r["picks"] or "-") + (
            " (the baseline)" if r["phase"] == "baseline" else "")
        ties = f" (tie: {r['ties'].replace(' ', ', ')})" if r.get("ties") else ""
        lines.append(f"{r['trial']!s:>5}  {_num(r['pp_ts'], 8, 1)} {_num(r['tg_ts'], 7, 1)} "
                     f"{_num(r['vram_mib'], 9, 1)}  {_interval(r, 'pp'):<19} {_interval(r, 'tg'):<19} "
                     f"{label}{ties}: {short_flags(r['flags'].split())}")
    for d in f.dropped:
        lines.append(f"{d.get('trial')!s:>5}  dropped ({d.get('outcome')}): {_clip(str(d.get('reason')), 90)}")
    return "\n".join(lines)


def _interval(r: dict[str, Any], key: str) -> str:
    """A ratio and its 95 % interval from the confirm rounds, `1.121 [1.04–1.20]` (the ratio alone without one)."""
    x, lo, hi = r.get(f"{key}_ratio"), r.get(f"{key}_ci_low"), r.get(f"{key}_ci_high")
    if x is None or pd.isna(x):
        return "-"
    return f"{float(x):.3f}" + (f" [{float(lo):.2f}–{float(hi):.2f}]" if lo is not None and hi is not None else "")


def _num(x: Any, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if x is None or pd.isna(x) else f"{float(x):{width}.{digits}f}"


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _mib(b: float | None) -> float | None:
    return round(b / MIB, 2) if b is not None else None
