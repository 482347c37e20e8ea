"""`fitter report RESULT`: a tuning result, finished or still running, as tables and figures.

Reads the results folder (`study.db`, and `pareto.json` once the tune has finished) without changing it and writes
into `RESULT/report/` (or `--out DIR`):

- `trials.csv`: one row per trial (state, phase, outcome or reason, speeds, VRAM, predicted device memory, flags);
- `pareto.csv`: the baseline and the Pareto front with ratios over the baseline (the confirm runs of `pareto.json`;
  for a study still running, `study.best_trials` and the baseline trial's measurement);
- PNGs (matplotlib, `optuna.visualization.matplotlib` where it fits): `decode-vs-vram.png` (prefill as colour, the
  front and the baseline marked), `history-<objective>.png`, `importance-<objective>.png`, `memory.png` (predicted
  vs measured device memory per trial);
- `report.html`: the same figures with plotly and both tables, plotly's JS inlined once (works offline).

Library functions here never print; `cmd_report` is the only one that does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
import pandas as pd
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from fitter.errors import FitterError
from fitter.results import KEY_ATTRS, STUDY_NAME, check_study_db, picks, ratios

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MIB = 1024 * 1024
FEW_TRIALS = 20  # importances over fewer distinct complete trials than this are noise
OBJECTIVE_LABELS = {"tg": "decode t/s", "pp": "prefill t/s", "vram": "peak VRAM MiB"}
SHORT_FLAGS = ("-ngl", "-ncmoe", "-ot", "-b", "-ub", "-ctk", "-ctv", "-fa", "-t", "-tb")
STATE_WORDS = {TrialState.PRUNED: "screened", TrialState.RUNNING: "running", TrialState.WAITING: "waiting",
               TrialState.FAIL: "fail", TrialState.COMPLETE: "ok"}
PNG_DPI = 100


class ReportError(FitterError):
    pass


# -- the result on disk -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StudyResult:
    folder: Path
    db: Path
    study: optuna.Study
    objectives: tuple[str, ...]
    pareto: dict[str, Any] | None  # pareto.json; None while the tune runs (or when it ended before writing it)

    @property
    def title(self) -> str:
        """model · machine · build, from the folder layout results/<model>/<machine>/<build>."""
        return " · ".join(self.folder.resolve().parts[-3:])


def result_paths(path: Path) -> tuple[Path, Path]:
    """(folder, study.db) for RESULT given as the folder, its study.db or its pareto.json."""
    folder = path.parent if path.is_file() and path.name in ("study.db", "pareto.json") else path
    if not folder.exists():
        raise ReportError(f"{path}: no such results folder (give the folder that holds study.db)")
    if not folder.is_dir():
        raise ReportError(f"{path}: not a results folder (give the folder that holds study.db, or its pareto.json)")
    db = folder / "study.db"
    if not db.is_file():
        raise ReportError(f"{folder}: no study.db there: not a fitter results folder (fitter tune writes "
                          f"results/<model>/<machine>/<build>/study.db)")
    return folder, db


def load_result(path: Path) -> StudyResult:
    """Open a results folder's study (whether or not the tune still runs) and its pareto.json when there is one."""
    folder, db = result_paths(path)
    check_study_db(db, "not a fitter study", require_tables=True)
    url = f"sqlite:///{db.resolve()}"
    try:
        names = optuna.get_all_study_names(storage=url)
        name = STUDY_NAME if STUDY_NAME in names else (names[0] if len(names) == 1 else None)
        if name is None:
            raise ReportError(f"{db}: no study named {STUDY_NAME!r} (studies there: {', '.join(names) or 'none'}); "
                              f"not a fitter study")
        study = optuna.load_study(study_name=name, storage=url)
    except ReportError:
        raise
    except Exception as e:  # sqlalchemy's errors for a locked, corrupt or foreign database
        raise ReportError(f"{db}: cannot read the Optuna study ({type(e).__name__}: {e})") from None
    attrs = study.user_attrs
    missing = [k for k in (*KEY_ATTRS, "objectives") if k not in attrs]
    if missing:
        raise ReportError(f"{db}: study {name!r} is not a fitter study (no {', '.join(missing)} in its attributes)")
    objectives = tuple(str(o) for o in attrs["objectives"])
    if len(objectives) != len(study.directions):
        raise ReportError(f"{db}: the study records objectives {list(objectives)} but optimizes "
                          f"{len(study.directions)} values")
    return StudyResult(folder, db, study, objectives, _read_pareto(folder / "pareto.json"))


def _read_pareto(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"{path}: not a readable pareto.json ({e}); move it away to report the study alone") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("pareto"), list):
        raise ReportError(f"{path}: no \"pareto\" list in it; not a fitter pareto.json")
    return doc


# -- measurements -----------------------------------------------------------------------------------------------


def speed(m: dict[str, Any] | None, key: str) -> float | None:
    value = ((m or {}).get(key) or {}).get("avg_ts")
    return float(value) if value is not None else None


def measured_device_bytes(m: dict[str, Any] | None) -> dict[str, int]:
    """Each accelerator's measured memory: its own peak (NVML, the emulator) or else llama.cpp's logged buffers."""
    return {name: b for name, (b, _) in _measured_devices(m).items()}


def _measured_devices(m: dict[str, Any] | None) -> dict[str, tuple[int, str]]:
    """device → (bytes, where the number comes from)."""
    m = m or {}
    peak = m.get("peak_vram") or {}
    if peak:
        return {name: (int(p["bytes"]), f"peak, {p.get('source', '?')}") for name, p in peak.items()}
    return {name: (int(d["total"]), "llama.cpp's buffers") for name, d in (m.get("devices") or {}).items()
            if name != "CPU" and "total" in d}


def predicted_device_bytes(t: FrozenTrial) -> dict[str, int]:
    return {k: int(v) for k, v in (t.user_attrs.get("predicted_bytes") or {}).items() if k != "CPU"}


def vram_bytes(t: FrozenTrial) -> int | None:
    """A COMPLETE trial's VRAM objective in bytes; a trial answered from storage has only the measurement."""
    if "vram_bytes" in t.user_attrs:
        return int(t.user_attrs["vram_bytes"])
    m = t.user_attrs.get("measurement")
    return sum(measured_device_bytes(m).values()) if t.state == TrialState.COMPLETE and m else None


def _mib(b: float | None) -> float | None:
    return round(b / MIB, 2) if b is not None else None


def short_flags(flags: list[str]) -> str:
    """The searched part of a trial's flags (context, slots and --rpc are the same in every trial)."""
    out = []
    for i, f in enumerate(flags):
        if f in SHORT_FLAGS and i + 1 < len(flags):
            value = flags[i + 1]
            out += [f, value if len(value) <= 24 else value[:21] + "..."]
    return " ".join(out)


def outcome(t: FrozenTrial) -> str:
    m = t.user_attrs.get("measurement") or {}
    word = t.user_attrs.get("outcome") or (m.get("outcome") if t.state != TrialState.RUNNING else None)
    return str(word or STATE_WORDS.get(t.state, t.state.name.lower()))


def violation(t: FrozenTrial) -> float | None:
    """The largest constraint value (MiB over a budget when > 0); None when the trial has none."""
    return max(t.constraints.values()) if t.constraints else None


# -- tables -----------------------------------------------------------------------------------------------------

TRIAL_COLUMNS = ("number", "state", "phase", "launched", "outcome", "reason", "pp_ts", "tg_ts", "vram_mib",
                 "predicted_mib", "measured_mib", "violation_mib", "same_as", "params", "flags")


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        ua = t.user_attrs
        m = ua.get("measurement")
        predicted = predicted_device_bytes(t)
        measured = measured_device_bytes(m)
        rows.append({
            "number": t.number, "state": t.state.name, "phase": ua.get("phase"),
            "launched": bool(ua.get("launched")), "outcome": outcome(t), "reason": ua.get("reason") or "",
            "pp_ts": speed(m, "pp"), "tg_ts": speed(m, "tg"), "vram_mib": _mib(vram_bytes(t)),
            "predicted_mib": _mib(sum(predicted.values())) if predicted else None,
            "measured_mib": _mib(sum(measured.values())) if measured else None,
            "violation_mib": violation(t), "same_as": ua.get("same_as"),
            "params": " ".join(f"{k}={v}" for k, v in t.params.items()),
            "flags": " ".join(ua.get("flags") or []),
        })
    return rows


def trials_frame(study: optuna.Study) -> pd.DataFrame:
    """One row per trial, in trial order (columns: TRIAL_COLUMNS)."""
    df = pd.DataFrame(trial_rows(study), columns=list(TRIAL_COLUMNS))
    df["same_as"] = df["same_as"].astype("Int64")  # a trial number, or missing
    return df


@dataclass(frozen=True)
class Front:
    """The Pareto front (with the baseline) as report rows; `source` says where it came from."""
    rows: list[dict[str, Any]]  # the baseline first (trial "base") when it ran, then the front by trial number
    source: str  # "pareto.json" (confirm runs) | "study" (single trial measurements of a running study)
    dropped: list[dict[str, Any]] = field(default_factory=list)


PARETO_COLUMNS = ("trial", "phase", "picks", "pp_ts", "tg_ts", "vram_mib", "pp_ratio", "tg_ratio", "flags")


def front(result: StudyResult) -> Front:
    if result.pareto is not None:
        return _front_from_pareto(result.pareto)
    return _front_from_study(result.study)


def _row(trial: int | str, phase: str | None, pick: list[str], m: dict[str, Any], vram: float | None,
         r: dict[str, float | None], flags: list[str]) -> dict[str, Any]:
    return {"trial": trial, "phase": phase, "picks": ",".join(pick), "pp_ts": speed(m, "pp"), "tg_ts": speed(m, "tg"),
            "vram_mib": _mib(vram), "pp_ratio": r.get("pp"), "tg_ratio": r.get("tg"), "flags": " ".join(flags)}


def _picks_by_trial(p: dict[str, int]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, n in p.items():
        out.setdefault(n, []).append(name)
    return out


def _baseline_row(m: dict[str, Any] | None, flags: list[str] | None) -> list[dict[str, Any]]:
    if not m or m.get("outcome") != "ok" or speed(m, "tg") is None:
        return []
    vram = sum(measured_device_bytes(m).values())
    return [_row("base", "baseline", [], m, vram, ratios(m, m), flags or [])]


def _front_from_pareto(doc: dict[str, Any]) -> Front:
    base = doc.get("baseline") or {}
    by_trial = _picks_by_trial(doc.get("picks") or {})
    rows = _baseline_row(base.get("measurement"), base.get("flags"))
    for e in doc["pareto"]:
        rows.append(_row(e["trial"], e.get("phase"), by_trial.get(e["trial"], []), e["measurement"],
                         e.get("vram_bytes"), e.get("ratios") or {}, e.get("flags") or []))
    return Front(rows, "pareto.json", list(doc.get("dropped") or []))


def baseline_trial(study: optuna.Study) -> FrozenTrial | None:
    return next((t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("phase") == "baseline"), None)


def _front_from_study(study: optuna.Study) -> Front:
    """A running study: its own Pareto front (feasible trials only), each trial's single measurement."""
    base = baseline_trial(study)
    base_m = base.user_attrs.get("measurement") if base else None
    entries: list[dict[str, Any]] = []
    seen = set()
    for t in sorted(study.best_trials, key=lambda t: t.number):
        m = t.user_attrs.get("measurement")
        key = t.user_attrs.get("key") or t.number
        if key in seen or speed(m, "tg") is None or speed(m, "pp") is None:
            continue  # a trial answered from storage repeats an earlier one
        seen.add(key)
        entries.append({"trial": t.number, "phase": t.user_attrs.get("phase"), "measurement": m,
                        "vram_bytes": vram_bytes(t) or 0, "flags": t.user_attrs.get("flags") or []})
    by_trial = _picks_by_trial(picks(entries))
    rows = _baseline_row(base_m, base.user_attrs.get("flags") if base else None)
    for e in entries:
        rows.append(_row(e["trial"], e["phase"], by_trial.get(e["trial"], []), e["measurement"], e["vram_bytes"],
                         ratios(e["measurement"], base_m), e["flags"]))
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
                     f"{_num(r['vram_mib'], 7, 1)} {_num(r['predicted_mib'], 7, 1)}  {what}")
    return "\n".join(lines)


def pareto_text(f: Front) -> str:
    source = "confirm runs, pareto.json" if f.source == "pareto.json" else \
        "single trial runs: the study is still running, no pareto.json yet"
    lines = [f"Pareto front ({source}):",
             f"{'trial':>5}  {'pp t/s':>8} {'tg t/s':>7} {'VRAM MiB':>9} {'pp×':>6} {'tg×':>6}  picks / flags"]
    if not f.rows:
        lines.append("  (none: no feasible trial has finished)")
    for r in f.rows:
        label = "llama.cpp --fit" if r["trial"] == "base" else (r["picks"] or "-") + (
            " (the baseline)" if r["phase"] == "baseline" else "")
        lines.append(f"{r['trial']!s:>5}  {_num(r['pp_ts'], 8, 1)} {_num(r['tg_ts'], 7, 1)} "
                     f"{_num(r['vram_mib'], 9, 1)} {_num(r['pp_ratio'], 6, 3)} {_num(r['tg_ratio'], 6, 3)}  "
                     f"{label}: {short_flags(r['flags'].split())}")
    for d in f.dropped:
        lines.append(f"{d.get('trial')!s:>5}  dropped ({d.get('outcome')}): {_clip(str(d.get('reason')), 90)}")
    return "\n".join(lines)


def _num(x: Any, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if x is None or pd.isna(x) else f"{float(x):{width}.{digits}f}"


def _clip(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


# -- figures ----------------------------------------------------------------------------------------------------


@dataclass
class Figures:
    """What the figure builders made: PNG paths, plotly figures for the HTML page, and notes on what was skipped."""
    out: Path
    pngs: list[Path] = field(default_factory=list)
    html: list[tuple[str, Any]] = field(default_factory=list)  # (heading, plotly Figure)
    notes: list[str] = field(default_factory=list)  # warnings and skips, for stderr and the page


@contextmanager
def _quiet() -> Iterator[None]:
    """Optuna's visualisation warns that it is experimental, and the importance evaluator about its target."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _pyplot() -> Any:
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")  # files only; a notebook that imported pyplot keeps its own backend
    import matplotlib.pyplot as plt

    return plt


def _save(figs: Figures, fig: Figure, name: str) -> None:
    path = figs.out / name
    fig.savefig(path, dpi=PNG_DPI)
    _pyplot().close(fig)
    figs.pngs.append(path)


def _measured(study: optuna.Study) -> list[FrozenTrial]:
    """Trials with a measurement of their own (not answered from storage), in order."""
    return [t for t in study.get_trials(deepcopy=False)
            if t.user_attrs.get("measurement") and "same_as" not in t.user_attrs]


@dataclass(frozen=True)
class _Point:
    label: str
    tg: float
    pp: float
    vram_mib: float
    trial: int | None = None
    feasible: bool = True


def scatter_points(result: StudyResult) -> tuple[list[_Point], list[_Point], _Point | None]:
    """(every measured COMPLETE trial, the front, the baseline) as decode / prefill / VRAM points; the front and the
    baseline from their confirm runs when pareto.json exists, else from their trials."""
    trials = []
    for t in _measured(result.study):
        m = t.user_attrs["measurement"]
        tg, pp = speed(m, "tg"), speed(m, "pp")
        if t.state == TrialState.COMPLETE and tg is not None and pp is not None:
            trials.append(_Point(f"#{t.number}", tg, pp, (vram_bytes(t) or 0) / MIB, t.number,
                                 all(v <= 0 for v in t.constraints.values())))
    f = front(result)
    pts, base = [], None
    for r in f.rows:
        label = "llama.cpp --fit" if r["trial"] == "base" else (
            f"#{r['trial']}" + (" = llama.cpp --fit" if r["phase"] == "baseline" else "")
            + (f": {r['picks']}" if r["picks"] else ""))
        p = _Point(label, r["tg_ts"], r["pp_ts"], r["vram_mib"] or 0.0,
                   None if r["trial"] == "base" else int(r["trial"]))
        if r["trial"] == "base":
            base = p
        else:
            pts.append(p)
    if base is None and result.pareto is None:
        bt = baseline_trial(result.study)
        m = bt.user_attrs.get("measurement") if bt else None
        if bt is not None and speed(m, "tg") is not None:
            base = _Point("llama.cpp --fit", speed(m, "tg") or 0.0, speed(m, "pp") or 0.0,
                          (vram_bytes(bt) or 0) / MIB, bt.number)
    return trials, pts, base


@dataclass(frozen=True)
class _Scatter:
    """What the decode figure shows, for both renderers."""
    trials: list[_Point]  # feasible measured trials
    over: list[_Point]  # measured trials over a budget (the baseline can be: it is measured whatever the estimate)
    front: list[_Point]
    base: _Point | None
    confirmed: bool  # the front and the baseline are confirm runs (pareto.json)
    gpu: bool  # False: nothing on a device (CPU only), so prefill is the x axis instead of VRAM
    title: str

    def x(self, p: _Point) -> float:
        return p.vram_mib if self.gpu else p.pp

    @property
    def x_label(self) -> str:
        return "peak VRAM MiB" if self.gpu else "prefill t/s"

    @property
    def front_name(self) -> str:
        return "Pareto front (confirm runs)" if self.confirmed else "Pareto front (trials)"

    def everything(self) -> list[_Point]:
        return self.trials + self.over + self.front + ([self.base] if self.base else [])


def decode_vs_vram(result: StudyResult, figs: Figures) -> None:
    trials, pts, base = scatter_points(result)
    if not trials and not pts:
        figs.notes.append("decode vs VRAM: skipped, no trial has finished with a measurement yet")
        return
    gpu = any(p.vram_mib > 0 for p in trials + pts)
    what = "decode vs VRAM, prefill as colour" if gpu else "decode vs prefill (CPU only: no VRAM used)"
    sc = _Scatter([p for p in trials if p.feasible], [p for p in trials if not p.feasible], pts, base,
                  result.pareto is not None, gpu, f"{what}: {len(trials)} measured trials\n{result.title}")
    _decode_png(sc, figs)
    _decode_html(sc, figs)


def _decode_png(sc: _Scatter, figs: Figures) -> None:
    lo, hi = _span([p.pp for p in sc.everything()])
    x_lo, x_hi = _span([sc.x(p) for p in sc.everything()])
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    colours = ax.scatter([sc.x(p) for p in sc.trials], [p.tg for p in sc.trials], c=[p.pp for p in sc.trials],
                         cmap="viridis", vmin=lo, vmax=hi, s=45, alpha=0.85, edgecolors="none", label="trial",
                         zorder=2)
    if sc.over:
        ax.scatter([sc.x(p) for p in sc.over], [p.tg for p in sc.over], facecolors="none", edgecolors="grey", s=45,
                   label="trial over budget", zorder=2)
    if sc.front:
        ax.scatter([sc.x(p) for p in sc.front], [p.tg for p in sc.front], c=[p.pp for p in sc.front], cmap="viridis",
                   vmin=lo, vmax=hi, s=190, marker="*", edgecolors="red", linewidths=1.3, label=sc.front_name,
                   zorder=4)
    by_number = {p.trial: p for p in sc.trials + sc.over}
    linked = False
    for p in sc.front:
        if sc.confirmed and p.trial in by_number:  # the trial run that put it on the front, to its confirm run
            t = by_number[p.trial]
            ax.plot([sc.x(t), sc.x(p)], [t.tg, p.tg], color="red", lw=0.7, alpha=0.5, zorder=3,
                    label=None if linked else "trial run → confirm run")
            linked = True
        _label(ax, p.label, sc.x(p), p.tg, x_lo, x_hi, "darkred")
    if sc.base is not None:
        ax.scatter([sc.x(sc.base)], [sc.base.tg], marker="D", s=80, facecolors="none", edgecolors="black",
                   linewidths=1.6, label="baseline: llama.cpp --fit", zorder=5)
        if not any(sc.base.label in p.label for p in sc.front):
            _label(ax, sc.base.label, sc.x(sc.base), sc.base.tg, x_lo, x_hi, "black", below=True)
    ax.margins(x=0.08, y=0.08)
    fig.colorbar(colours, ax=ax, label="prefill t/s")
    ax.set_xlabel(sc.x_label)
    ax.set_ylabel("decode t/s")
    ax.set_title(sc.title, fontsize=10)
    ax.grid(alpha=0.3)
    legend = ax.legend(loc="best", fontsize=8)
    handle = legend.legend_handles[0]  # "trial": its colour is prefill, not a category
    from matplotlib.collections import PathCollection

    if isinstance(handle, PathCollection):
        handle.set_array(None)
        handle.set_color("grey")
    fig.tight_layout()
    _save(figs, fig, "decode-vs-vram.png")


def _decode_html(sc: _Scatter, figs: Figures) -> None:
    import plotly.graph_objects as go

    lo, hi = _span([p.pp for p in sc.everything()])
    scale = {"colorscale": "Viridis", "cmin": lo, "cmax": hi}
    hover = (f"%{{text}}<br>{sc.x_label} %{{x:.1f}}<br>decode %{{y:.1f}} t/s<br>prefill %{{marker.color:.1f}} t/s"
             "<extra></extra>")
    pf = go.Figure()
    pf.add_scatter(x=[sc.x(p) for p in sc.trials], y=[p.tg for p in sc.trials], mode="markers", name="trial",
                   text=[p.label for p in sc.trials], hovertemplate=hover,
                   marker={"color": [p.pp for p in sc.trials], **scale, "size": 9,
                           "colorbar": {"title": {"text": "prefill t/s"}}})
    if sc.over:
        pf.add_scatter(x=[sc.x(p) for p in sc.over], y=[p.tg for p in sc.over], mode="markers",
                       name="trial over budget", text=[p.label for p in sc.over],
                       marker={"color": "rgba(0,0,0,0)", "size": 9, "line": {"color": "grey", "width": 1}})
    if sc.front:
        pf.add_scatter(x=[sc.x(p) for p in sc.front], y=[p.tg for p in sc.front], mode="markers+text",
                       name=sc.front_name, text=[p.label for p in sc.front], textposition="top right",
                       hovertemplate=hover, marker={"symbol": "star", "size": 16, "color": [p.pp for p in sc.front],
                                                    **scale, "line": {"color": "red", "width": 1.5}})
    if sc.base is not None:
        pf.add_scatter(x=[sc.x(sc.base)], y=[sc.base.tg], mode="markers+text", name="baseline: llama.cpp --fit",
                       text=["llama.cpp --fit"], textposition="bottom right",
                       marker={"symbol": "diamond-open", "size": 12, "color": "black", "line": {"width": 2}})
    pf.update_layout(title={"text": sc.title.replace("\n", "<br>")}, xaxis_title=sc.x_label,
                     yaxis_title="decode t/s", legend={"orientation": "h", "y": -0.2})
    figs.html.append(("Decode vs VRAM" if sc.gpu else "Decode vs prefill", pf))


def _span(xs: list[float]) -> tuple[float, float]:
    return (min(xs), max(xs)) if xs else (0.0, 1.0)


def _label(ax: Axes, text: str, x: float, y: float, x_lo: float, x_hi: float, color: str,
           below: bool = False) -> None:
    """A point's label, to its left in the right third of the axis so it stays inside the plot."""
    right = x_hi > x_lo and (x - x_lo) / (x_hi - x_lo) > 0.66
    ax.annotate(text, (x, y), xytext=(-9 if right else 9, -13 if below else 7), textcoords="offset points",
                ha="right" if right else "left", fontsize=8, color=color,
                bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.7})


def _target(i: int, sign: float = 1.0) -> Callable[[FrozenTrial], float]:
    return lambda t: sign * t.values[i]


def _best_so_far(study: optuna.Study, i: int) -> tuple[list[int], list[float]]:
    """The best feasible value of objective i after each COMPLETE trial (Optuna draws none for a target)."""
    better = min if study.directions[i] == StudyDirection.MINIMIZE else max
    xs, ys, best = [], [], None
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if all(v <= 0 for v in t.constraints.values()):
            best = t.values[i] if best is None else better(best, t.values[i])
        if best is not None:
            xs.append(t.number)
            ys.append(best)
    return xs, ys


def history(result: StudyResult, figs: Figures) -> None:
    study = result.study
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        figs.notes.append("optimisation history: skipped, no COMPLETE trial yet")
        return
    from optuna.visualization import plot_optimization_history
    from optuna.visualization.matplotlib import plot_optimization_history as mpl_history

    plt = _pyplot()
    multi = len(result.objectives) > 1
    for i, name in enumerate(result.objectives):
        label = OBJECTIVE_LABELS.get(name, name)
        target = _target(i) if multi else None
        with _quiet(), plt.rc_context():  # optuna's ggplot style stays inside this figure
            ax: Axes = mpl_history(study, target=target, target_name=label)
            if multi:
                xs, ys = _best_so_far(study, i)
                ax.step(xs, ys, where="post", color="#d62728", label=f"best {label} (feasible)")
                ax.legend(loc="best", fontsize=8)
            ax.set_title(f"optimisation history: {label}", fontsize=10)
            fig = ax.get_figure(root=True)
            assert fig is not None
            fig.set_size_inches(7, 4.5)
            _save(figs, fig, f"history-{name}.png")
            pf = plot_optimization_history(study, target=target, target_name=label)
        if multi:
            xs, ys = _best_so_far(study, i)
            pf.add_scatter(x=xs, y=ys, mode="lines", line={"shape": "hv", "color": "#d62728"},
                           name=f"best {label} (feasible)")
        pf.update_layout(title={"text": f"Optimisation history: {label}"})
        figs.html.append((f"Optimisation history: {label}", pf))


def _distinct_complete(study: optuna.Study) -> optuna.Study:
    """The COMPLETE trials that measured a config of the space once (no baseline, no answer from storage), in an
    in-memory study: what importances may be computed over."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "A new study created in memory" line
    try:
        copy = optuna.create_study(directions=study.directions)
    finally:
        optuna.logging.set_verbosity(verbosity)
    copy.add_trials([t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                     if t.params and "same_as" not in t.user_attrs])
    return copy


def importances(result: StudyResult, figs: Figures) -> None:
    study = _distinct_complete(result.study)
    trials = study.get_trials(deepcopy=False)
    n = len(trials)
    if n < 2:
        figs.notes.append(f"parameter importances: skipped, {n} distinct COMPLETE trial(s) of the search space "
                          f"(at least 2 needed)")
        return
    varied = sorted({k for k in {k for t in trials for k in t.params}
                     if len({repr(t.params.get(k)) for t in trials}) > 1})
    if not varied:
        figs.notes.append(f"parameter importances: skipped, every parameter took one value in the {n} distinct "
                          f"COMPLETE trials")
        return
    warning = ""
    if n < FEW_TRIALS:
        warning = f"only {n} distinct complete trials: importances over fewer than {FEW_TRIALS} are noise"
        figs.notes.append(f"parameter importances: {warning}")
        warning = f"WARNING: {n} trials, fewer than {FEW_TRIALS}: noise"
    from optuna.visualization import plot_param_importances
    from optuna.visualization.matplotlib import plot_param_importances as mpl_importances

    plt = _pyplot()
    for i, name in enumerate(result.objectives):
        label = OBJECTIVE_LABELS.get(name, name)
        # PED-ANOVA ranks low targets best: negate what is maximized
        target = _target(i, -1.0 if study.directions[i] == StudyDirection.MAXIMIZE else 1.0)
        title = f"parameter importances for {label} (PED-ANOVA over {n} trials)" + (f"\n{warning}" if warning else "")
        try:
            with _quiet(), plt.rc_context():
                ax: Axes = mpl_importances(study, params=varied, target=target, target_name=label)
                ax.set_title("", loc="left")  # optuna's own title, replaced
                ax.set_title(title, fontsize=10, color="darkred" if warning else "black")
                fig = ax.get_figure(root=True)
                assert fig is not None
                fig.set_size_inches(7, 4.5)
                fig.tight_layout()
                _save(figs, fig, f"importance-{name}.png")
                pf = plot_param_importances(study, params=varied, target=target, target_name=label)
        except (ValueError, RuntimeError) as e:  # optuna refuses degenerate studies
            plt.close("all")
            figs.notes.append(f"parameter importances for {label}: skipped ({e})")
            continue
        pf.update_layout(title={"text": title.replace("\n", "<br>")})
        figs.html.append((f"Parameter importances: {label}", pf))


@dataclass(frozen=True)
class MemoryPoint:
    trial: int
    device: str
    predicted_mib: float
    measured_mib: float
    oom: bool  # measured = what the device needed when it ran out (logged buffers + the refused request)
    source: str = "llama.cpp's buffers + the refused request"


def memory_points(study: optuna.Study) -> list[MemoryPoint]:
    out = []
    for t in _measured(study):
        predicted = predicted_device_bytes(t)
        m = t.user_attrs["measurement"]
        if not predicted:
            continue
        if m.get("outcome") == "ok":
            measured = _measured_devices(m)
            if len(predicted) == 1 and len(measured) == 1:  # one device, whatever each side calls it
                measured = {next(iter(predicted)): next(iter(measured.values()))}
            for dev, p in predicted.items():
                if dev in measured:
                    b, source = measured[dev]
                    out.append(MemoryPoint(t.number, dev, p / MIB, b / MIB, False, source))
        elif m.get("outcome") == "oom" and "oom_margin_bytes" in t.user_attrs:
            total = sum(predicted.values())
            dev = next(iter(predicted)) if len(predicted) == 1 else "oom"
            out.append(MemoryPoint(t.number, dev, total / MIB, (total + t.user_attrs["oom_margin_bytes"]) / MIB, True))
    return out


@dataclass(frozen=True)
class _Memory:
    """What the memory figure shows, for both renderers."""
    ok: list[MemoryPoint]
    oom: list[MemoryPoint]
    title: str

    @property
    def devices(self) -> list[str]:
        return sorted({p.device for p in self.ok})

    def diagonal(self) -> list[float]:
        """The y = x segment: the range of every value, padded."""
        values = [v for p in self.ok + self.oom for v in (p.predicted_mib, p.measured_mib)]
        pad = max((max(values) - min(values)) * 0.05, 0.5)
        return [min(values) - pad, max(values) + pad]

    def error_span(self) -> float:
        """±0.5 MiB at least: an exact estimate shows as points on the zero line, not as magnified noise."""
        return 1.15 * max([abs(p.measured_mib - p.predicted_mib) for p in self.ok + self.oom] + [0.5])


def memory(result: StudyResult, figs: Figures) -> None:
    pts = memory_points(result.study)
    if not pts:
        figs.notes.append("predicted vs measured memory: skipped, no launched trial measured device memory")
        return
    ok = [p for p in pts if not p.oom]
    err = [p.measured_mib - p.predicted_mib for p in ok]
    summary = (f"{len(ok)} runs, measured − predicted {min(err):+.2f} … {max(err):+.2f} MiB" if ok else
               "no run that fitted")
    mem = _Memory(ok, [p for p in pts if p.oom],
                  f"predicted vs measured device memory per trial: {summary}\n{result.title}")
    _memory_png(mem, figs)
    _memory_html(mem, figs)


def _memory_png(mem: _Memory, figs: Figures) -> None:
    plt = _pyplot()
    fig, (ax, res) = plt.subplots(1, 2, figsize=(11, 5), gridspec_kw={"width_ratios": [1, 1.2]})
    line = mem.diagonal()
    ax.plot(line, line, "--", color="grey", lw=1, label="y = x (exact)")
    for k, dev in enumerate(mem.devices):
        sel = [p for p in mem.ok if p.device == dev]
        ax.scatter([p.predicted_mib for p in sel], [p.measured_mib for p in sel], s=40, alpha=0.8, label=dev,
                   color=f"C{k}")
        xs = [p.trial + 0.15 * k for p in sel]
        errs = [p.measured_mib - p.predicted_mib for p in sel]
        res.vlines(xs, 0, errs, color=f"C{k}", lw=1.5)
        res.scatter(xs, errs, color=f"C{k}", s=30, label=dev, zorder=3)
    if mem.oom:
        ax.scatter([p.predicted_mib for p in mem.oom], [p.measured_mib for p in mem.oom], marker="x", color="red",
                   s=60, label="out of memory (needed)")
        res.scatter([p.trial for p in mem.oom], [p.measured_mib - p.predicted_mib for p in mem.oom], marker="x",
                    color="red", s=60, label="out of memory (needed)")
    ax.set_xlim(*line)
    ax.set_ylim(*line)
    ax.set_aspect("equal", adjustable="box")
    ax.set_xlabel("predicted device MiB (fitter's estimate)")
    ax.set_ylabel(f"measured device MiB ({'; '.join(sorted({p.source for p in mem.ok})) or 'needed'})")
    res.axhline(0, color="grey", lw=1, ls="--")
    res.set_ylim(-mem.error_span(), mem.error_span())
    res.set_xlabel("trial")
    res.set_ylabel("measured − predicted MiB")
    for a, where in ((ax, "upper left"), (res, "upper right")):
        a.grid(alpha=0.3)
        a.legend(loc=where, fontsize=8)
    fig.suptitle(mem.title, fontsize=10)
    fig.tight_layout()
    _save(figs, fig, "memory.png")


def _memory_html(mem: _Memory, figs: Figures) -> None:
    from plotly.subplots import make_subplots

    pf = make_subplots(rows=1, cols=2, subplot_titles=("predicted vs measured", "measured − predicted per trial"))
    line = mem.diagonal()
    pf.add_scatter(x=line, y=line, mode="lines", name="y = x (exact)", line={"dash": "dash", "color": "grey"},
                   row=1, col=1)
    for dev in mem.devices:
        sel = [p for p in mem.ok if p.device == dev]
        pf.add_scatter(x=[p.predicted_mib for p in sel], y=[p.measured_mib for p in sel], mode="markers", name=dev,
                       text=[f"#{p.trial}" for p in sel], row=1, col=1,
                       hovertemplate="%{text}<br>predicted %{x:.2f} MiB<br>measured %{y:.2f} MiB<extra></extra>")
        pf.add_scatter(x=[p.trial for p in sel], y=[p.measured_mib - p.predicted_mib for p in sel], mode="markers",
                       name=f"{dev}: measured − predicted", row=1, col=2)
    if mem.oom:
        pf.add_scatter(x=[p.predicted_mib for p in mem.oom], y=[p.measured_mib for p in mem.oom], mode="markers",
                       name="out of memory (needed)", text=[f"#{p.trial}" for p in mem.oom], row=1, col=1,
                       marker={"symbol": "x", "color": "red", "size": 10})
    pf.update_xaxes(title_text="predicted device MiB", row=1, col=1)
    pf.update_yaxes(title_text="measured device MiB", scaleanchor="x", row=1, col=1)
    pf.update_xaxes(title_text="trial", row=1, col=2)
    pf.update_yaxes(title_text="measured − predicted MiB", range=[-mem.error_span(), mem.error_span()], row=1, col=2)
    pf.update_layout(title={"text": mem.title.replace("\n", "<br>")})
    figs.html.append(("Predicted vs measured device memory", pf))


# -- the report -------------------------------------------------------------------------------------------------


@dataclass
class Report:
    result: StudyResult
    out: Path
    trials: pd.DataFrame
    front: Front
    files: list[Path]
    notes: list[str]

    def json(self) -> dict[str, Any]:
        return {"result": str(self.result.folder), "study": str(self.result.db), "out": str(self.out),
                "objectives": list(self.result.objectives), "front_source": self.front.source,
                "files": [str(p) for p in self.files], "warnings": self.notes,
                "pareto": self.front.rows, "dropped": self.front.dropped,
                "trials": json.loads(self.trials.to_json(orient="records"))}


def write_report(result: StudyResult, out: Path) -> Report:
    """Write the tables, PNGs and report.html of a study into `out` (created when missing)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"--out {out}: cannot create it: {e.strerror}") from None
    trials = trials_frame(result.study)
    f = front(result)
    figs = Figures(out)
    notes = _staleness(result)
    trials_csv, pareto_csv = out / "trials.csv", out / "pareto.csv"
    trials.to_csv(trials_csv, index=False)
    pareto_frame(f).to_csv(pareto_csv, index=False)
    for build in (decode_vs_vram, history, importances, memory):
        build(result, figs)
    notes += figs.notes
    page = out / "report.html"
    page.write_text(_html(result, trials, f, figs.html, notes))
    return Report(result, out, trials, f, [trials_csv, pareto_csv, *figs.pngs, page], notes)


def _staleness(result: StudyResult) -> list[str]:
    trials = result.study.get_trials(deepcopy=False)
    running = sum(1 for t in trials if t.state == TrialState.RUNNING)
    notes = [f"{running} trial(s) still RUNNING (a tune in progress, or one killed before it ended)"] if running else []
    if result.pareto is None:
        notes.append("no pareto.json yet: the front is the study's own, from single trial runs (no confirm runs)")
    else:
        recorded = (result.pareto.get("study") or {}).get("trials")
        if recorded is not None and recorded != len(trials):
            notes.append(f"pareto.json covers {recorded} trials, the study has {len(trials)} now: a tune is running "
                         f"on it; its front is the earlier run's")
    return notes


def _html(result: StudyResult, trials: pd.DataFrame, f: Front, figures: list[tuple[str, Any]],
          notes: list[str]) -> str:
    import html

    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>fitter report: {html.escape(result.title)}"
             "</title><style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #ccc;padding:2px 6px}.warn{color:#a00}</style></head><body>",
             f"<h1>fitter report</h1><p>{html.escape(str(result.folder))} (objectives: "
             f"{', '.join(result.objectives)})</p>"]
    parts += [f"<p class='warn'>{html.escape(n)}</p>" for n in notes]
    source = "confirm runs (pareto.json)" if f.source == "pareto.json" else "single trial runs (the study's own front)"
    parts.append(f"<h2>Pareto front: {source}</h2>" + pareto_frame(f).to_html(index=False, na_rep="-"))
    for i, (heading, fig) in enumerate(figures):
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))  # plotly.js inlined once
    parts.append("<h2>Trials</h2>" + trials.to_html(index=False, na_rep="-"))
    parts.append("</body></html>")
    return "\n".join(parts)


def dashboard_command(result: StudyResult) -> str | None:
    if importlib.util.find_spec("optuna_dashboard") is None:
        return None
    return f"optuna-dashboard sqlite:///{result.db.resolve()}"


def cmd_report(ns: argparse.Namespace, flags: list[str]) -> int:
    """`fitter report RESULT [--out DIR] [--json]`."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # fitter says what it skipped itself
    result = load_result(Path(ns.result))
    out = Path(ns.out) if ns.out else result.folder / "report"
    report = write_report(result, out)
    dashboard = dashboard_command(result)
    for note in report.notes:
        print(f"fitter: warning: {note}", file=sys.stderr)
    if ns.json:
        print(json.dumps({**report.json(), "dashboard": dashboard}, indent=1))
        return 0
    print(trials_text(report.trials))
    print()
    print(pareto_text(report.front))
    print(f"\nreport: {out}")
    for p in report.files:
        print(f"  {p.name}")
    if dashboard:
        print(f"browse the study live: {dashboard}")
    return 0
