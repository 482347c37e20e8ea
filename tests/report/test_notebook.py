"""notebooks/analysis.ipynb runs top to bottom on the example result and draws its figures; the example result in
examples/demo-result/ (written by scripts/make_example_result.py from a real tune) is consistent with itself."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import nbformat
import optuna
import pandas as pd
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "analysis.ipynb"
EXAMPLE = ROOT / "examples" / "demo-result"
N_FIGURES = 3  # decode vs VRAM, optimisation history, predicted vs measured memory


def execute(monkeypatch: pytest.MonkeyPatch, result: Path | None) -> Any:
    """Run the notebook as CI does (kernel python3, from notebooks/), with FITTER_RESULT set to `result`."""
    if result is None:
        monkeypatch.delenv("FITTER_RESULT", raising=False)
    else:
        monkeypatch.setenv("FITTER_RESULT", str(result))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return nb


def outputs(nb: Any) -> list[Any]:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]


def pngs(nb: Any) -> list[bytes]:
    return [base64.b64decode(o.data["image/png"]) for o in outputs(nb)
            if o.output_type == "display_data" and "image/png" in o.data]


def text(nb: Any) -> str:
    parts = []
    for o in outputs(nb):
        if o.output_type == "stream":
            parts.append(o.text)
        elif o.output_type in ("display_data", "execute_result") and "text/plain" in o.data:
            parts.append(o.data["text/plain"])
    return "\n".join(parts)


def test_notebook_is_stored_without_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].source.strip().endswith('RESULT = "../examples/demo-result"')
    assert "parameters" in code[0].metadata.get("tags", [])
    assert [(c.outputs, c.execution_count) for c in code] == [([], None)] * len(code)


def test_notebook_runs_on_the_example_result(monkeypatch: pytest.MonkeyPatch) -> None:
    nb = execute(monkeypatch, None)
    assert not [o for o in outputs(nb) if o.output_type == "error"]
    figures = pngs(nb)
    assert len(figures) == N_FIGURES
    for png in figures:
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000  # a drawn figure, not an empty canvas
    shown = text(nb)
    doc = json.loads((EXAMPLE / "pareto.json").read_text())
    assert f"{doc['study']['trials']} trials: {doc['study']['launched']} launched" in shown
    for pick in doc["picks"]:
        assert pick in shown  # the Pareto table names every pick
    assert "max_abs_error_MiB" in shown  # the per-buffer table, read from study.db


@pytest.mark.slow  # the notebook's second run (-m slow); the default run executes it once, on the example result
def test_notebook_takes_fitter_result_and_runs_without_the_study(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """FITTER_RESULT overrides the parameter cell, a pareto.json path is accepted, and without study.db (a
    --storage URL elsewhere) the figures are still drawn from trials.csv and pareto.json."""
    result = tmp_path / "result"
    shutil.copytree(EXAMPLE, result, ignore=shutil.ignore_patterns("study.db"))
    nb = execute(monkeypatch, result / "pareto.json")
    assert len(pngs(nb)) == N_FIGURES
    shown = text(nb)
    assert f"result   {result}" in shown
    assert "no study.db: per-buffer detail skipped" in shown


def test_example_result_is_consistent() -> None:
    assert sorted(p.name for p in EXAMPLE.iterdir()) == ["README.md", "pareto.json", "study.db", "trials.csv"]
    assert sum(p.stat().st_size for p in EXAMPLE.iterdir()) < 1_000_000
    assert "scripts/make_example_result.py" in (EXAMPLE / "README.md").read_text()
    doc = json.loads((EXAMPLE / "pareto.json").read_text())
    trials = pd.read_csv(EXAMPLE / "trials.csv")
    assert doc["study"]["storage"] == "study.db"  # the script's one rewrite
    assert doc["emulated"] and doc["machine"]["emulated_gpu_mib"]
    assert list(trials["number"]) == list(range(len(trials))) and len(trials) == doc["study"]["trials"]
    assert int(trials["launched"].sum()) == doc["study"]["launched"]

    measured = set(trials.loc[trials["outcome"] == "ok", "number"])
    front = {e["trial"] for e in doc["pareto"]}
    assert front and front <= measured
    assert set(doc["picks"]) == {"max-decode", "max-prefill", "balanced", "min-vram"}
    assert set(doc["picks"].values()) <= front
    assert doc["baseline"]["trial"] in measured
    assert {d["trial"] for d in doc["dropped"]} <= measured - front

    study = optuna.load_study(study_name="fitter",
                              storage=f"sqlite:///file:{(EXAMPLE / 'study.db').resolve()}?mode=ro&uri=true")
    assert len(study.trials) == len(trials)
    assert [d.name.lower() for d in study.directions] == ["maximize", "maximize", "minimize"]
    assert study.user_attrs["model_identity"] == doc["model"]["identity"]
    assert study.user_attrs["machine_fingerprint"] == doc["machine"]["fingerprint"]
    by_number = {t.number: t for t in study.trials}
    for row in trials.itertuples():
        assert by_number[row.number].state.name == row.state
