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

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from optuna.trial import TrialState

from fitter.paths import write_atomic
from fitter.report.figures import Figures, decode_vs_vram, history, importances, memory
from fitter.report.load import ReportError, StudyResult
from fitter.report.quality_figure import decode_vs_quality
from fitter.report.tables import front, pareto_frame
from fitter.results.table import Front
from fitter.results.trials import trials_frame


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
                "pareto": self.front.records, "dropped": self.front.dropped,
                "trials": json.loads(self.trials.to_json(orient="records", date_format="iso"))}


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
    write_atomic(trials_csv, trials.to_csv(index=False))
    write_atomic(pareto_csv, pareto_frame(f).to_csv(index=False))
    for build in (decode_vs_vram, decode_vs_quality, history, importances, memory):
        build(result, figs)
    notes += figs.notes
    page = out / "report.html"
    write_atomic(page, _html(result, trials, f, figs.html, notes))
    return Report(result, out, trials, f, [trials_csv, pareto_csv, *figs.pngs, page], notes)


def _staleness(result: StudyResult) -> list[str]:
    trials = result.study.get_trials(deepcopy=False)
    running = sum(1 for t in trials if t.state == TrialState.RUNNING)
    notes = [f"{running} trial(s) still RUNNING (a tune in progress, or one killed before it ended)"] if running else []
    if result.pareto is None:
        notes.append("no pareto.json yet: the front is the study's own, from single trial runs (no confirm runs)")
    else:
        recorded = result.pareto.study.get("trials")
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
