"""The expert order on one GPU as a tune searches it: where the model's layers route differently (a simulated
machine's stated routing spread), the tune finds the order that prefills faster at the same count; its pick's flags
and every export carry the `-ot` rule. On a simulated 8 GB GPU with gpt-oss-20b's real shape (seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fitter.export.launchers import render
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.results.pareto import ParetoDoc
from fitter.sim import MACHINES_DIR
from fitter.tune.session import run_tune
from tests.models import model_file
from tests.tune.options import tune_options

EXPS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"


def routed_tune(tmp_path: Path, last: float) -> ParetoDoc:
    text = (MACHINES_DIR / "gpu-8gb.toml").read_text()
    machine = tmp_path / "routed.toml"
    machine.write_text(f"routing_spread_first = 1.0\nrouting_spread_last = {last}\n{text}")
    model = str(model_file("gpt-oss-20b", sparse=True))
    base = parse_launch_flags(["-c", "8192", "-fa", "on"])
    options = tune_options(model=model, spec=load_model_spec(model), base=base, trials=10, repetitions=2,
                          confirm_rounds=2, results=tmp_path / "r", backend="sim", machine=str(machine),
                          objectives=("tg", "pp"))
    outcome = run_tune(options, None)
    assert outcome.result is not None
    return outcome.result


@pytest.fixture(scope="module")
def narrowing(tmp_path_factory: pytest.TempPathFactory) -> ParetoDoc:
    return routed_tune(tmp_path_factory.mktemp("routed"), 0.002)  # late layers' tokens share their experts


def test_where_late_layers_route_narrowly_the_prefill_pick_keeps_the_last_layers_experts_on_the_cpu(
        narrowing: ParetoDoc) -> None:
    e = narrowing.entry("max-prefill")
    flags = list(e.flags or ())
    assert "-ncmoe" not in flags
    rule = flags[flags.index("-ot") + 1]
    assert rule.startswith(r"blk\.(") and rule.endswith(f"|23){EXPS}")  # the model's last layers, up to its last


def test_the_export_writes_the_rule(narrowing: ParetoDoc) -> None:
    e = narrowing.entry("max-prefill")
    rule = list(e.flags or ())[list(e.flags or ()).index("-ot") + 1]
    assert f"-ot '{rule}'" in render(narrowing, "max-prefill", "server")
