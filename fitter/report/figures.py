"""The report's figures, each as a PNG (matplotlib, `optuna.visualization.matplotlib` where it fits) and a plotly
figure for report.html: decode vs VRAM (prefill as colour, the front and the baseline marked), the optimisation
history of each objective, parameter importances (PED-ANOVA), predicted vs measured device memory per trial."""

from __future__ import annotations

import io
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from fitter.paths import write_atomic
from fitter.report.load import StudyResult
from fitter.report.tables import baseline_trial, front
from fitter.results.measurement import device_peaks, speed
from fitter.results.table import BASE
from fitter.results.trials import predicted_device_bytes, trial_vram
from fitter.units import MIB

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FEW_TRIALS = 20  # importances over fewer distinct complete trials than this are noise
OBJECTIVE_LABELS = {"tg": "decode t/s", "pp": "prefill t/s", "vram": "peak VRAM MiB", "quality": "KLD from f16 KV"}
PNG_DPI = 100


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
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=PNG_DPI)
    write_atomic(path, png.getvalue())
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
            trials.append(_Point(f"#{t.number}", tg, pp, (trial_vram(t) or 0) / MIB, t.number,
                                 all(v <= 0 for v in t.constraints.values())))
    f = front(result)
    pts, base = [], None
    for r in f.rows:
        label = "llama.cpp --fit" if r.trial == BASE else (
            f"#{r.trial}" + (" = llama.cpp --fit" if r.phase == "baseline" else "")
            + (f": {','.join(r.picks)}" if r.picks else ""))
        p = _Point(label, r.tg_ts or 0.0, r.pp_ts or 0.0, r.vram_mib or 0.0,
                   None if r.trial == BASE else int(r.trial))
        if r.trial == BASE:
            base = p
        else:
            pts.append(p)
    if base is None and result.pareto is None:
        bt = baseline_trial(result.study)
        m = bt.user_attrs.get("measurement") if bt else None
        if bt is not None and speed(m, "tg") is not None:
            base = _Point("llama.cpp --fit", speed(m, "tg") or 0.0, speed(m, "pp") or 0.0,
                          (trial_vram(bt) or 0) / MIB, bt.number)
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
            measured = device_peaks(m)
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
