"""Regression of the tuning logic on recorded real landscapes (landscapes/*.json, `fitter grid`): over 5 seeds a
replayed `fitter tune` launches, within 12 trials, a config the recorded noise cannot tell apart from the landscape's
best decode (fitter.grid.landscape.best_within_noise: tune's own tie rule over the recording's paired rounds), never
launches what the recording's estimator screened out (the replay refuses it), and confirms what it picks.

Beside the simulated machines (test_tuning_regression.py) these are measurements, with their real noise: the prior
that fewer CPU bytes per token decode faster meets the demo model on this machine's CPU and emulated GPU."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.demo_models import demo_model_path
from fitter.gguf.model_spec import load_model_spec
from fitter.grid.landscape import best_within_noise, load_landscape, param_key
from fitter.grid.replay_tune import run_replay
from tests.tune.options import tune_options

pytestmark = pytest.mark.slow

LANDSCAPES = Path(__file__).resolve().parents[2] / "landscapes"
SEEDS = range(5)
MAX_LAUNCHED = 12


@pytest.mark.parametrize("name", sorted(p.name for p in LANDSCAPES.glob("*.json")))
def test_a_replayed_tune_reaches_a_config_within_noise_of_the_recorded_best(name: str, tmp_path: Path) -> None:
    land = load_landscape(LANDSCAPES / name)
    within = best_within_noise(land, "tg")
    truth = {k: mean for k, (mean, _) in land.summary("tg").items()}
    model = str(demo_model_path())
    spec = load_model_spec(model)
    for seed in SEEDS:
        o = tune_options(model=model, spec=spec, base=parse_launch_flags(list(land.fixed_flags)), backend="replay",
                        landscape=str(LANDSCAPES / name), trials=MAX_LAUNCHED, seed=seed,
                        results=tmp_path / str(seed))
        outcome = run_replay(o)
        assert outcome.folder is not None
        doc = json.loads((outcome.folder / "pareto.json").read_text())
        assert doc["study"]["launched"] <= MAX_LAUNCHED and doc["pareto"] and doc["picks"]
        rows = list(csv.DictReader((outcome.folder / "trials.csv").open()))
        keys = land.distributions
        launched = {param_key({k: _typed(r[f"params_{k}"]) for k in keys}) for r in rows
                    if r["launched"] == "True" and r["phase"] != "baseline"}
        assert launched <= set(truth), f"seed {seed}: launched configs the landscape never measured"
        best = max(launched, key=lambda k: truth[k])
        assert best in within, (seed, best, truth[best], max(truth.values()))


def _typed(text: str) -> int | str:
    """A trials.csv param as the space holds it (ints stay ints; pandas writes 512 or 512.0)."""
    try:
        return int(float(text))
    except ValueError:
        return text
