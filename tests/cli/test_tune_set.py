"""`fitter tune --models-preset`: models loaded together, each tuned within its share of the set's fit, the picks
written as one router preset whose models fit the device together."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fitter.cli.tune_set import share_targets
from fitter.flags import parse_launch_flags
from fitter.flags.models_preset import read_models_preset
from fitter.flags.parse import split_process_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import RPC, Device
from fitter.memory.plan.estimator import estimate
from tests.models import model_file

MIB = 1024 * 1024


def test_a_share_becomes_the_fit_target_that_leaves_it() -> None:
    dev = Device("RPC0[127.0.0.1:50052]", RPC, 160 * MIB, 160 * MIB)
    assert share_targets((dev,), {dev.name: 78 * MIB + 1}) == (82,)  # rounded up: the budget never exceeds it
    assert share_targets((dev,), {dev.name: 78 * MIB}) == (82,)


@pytest.mark.slow
@pytest.mark.tools("llama-server", "llama-fit-params")
@pytest.mark.timeout(900)
def test_a_set_tuned_on_the_emulated_gpu_writes_picks_that_fit_together(llama_tools: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    a, b = model_file("demo"), model_file("gpt-oss-tiny")
    preset = tmp_path / "set.ini"
    preset.write_text(f"[a]\nmodel = {a}\n\n[b]\nmodel = {b}\n")
    run = subprocess.run([sys.executable, "-m", "fitter.cli", "tune", "--models-preset", str(preset),
                          "--emulated-gpu", "160", "--fit-target", "16", "-c", "2048", "--trials", "2", "-r", "1",
                          "--confirm-rounds", "1", "--results", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=850)
    assert run.returncode == 0, run.stderr[-3000:]
    models = read_models_preset(tmp_path / "r" / "set-preset.ini")
    assert [m.name for m in models] == ["a", "b"]
    dev = Device("RPC0[127.0.0.1:50052]", RPC, 160 * MIB, 160 * MIB)
    used = sum(estimate(load_model_spec(m.model),
                        parse_launch_flags([*split_process_flags(m.flags, m.name)[0], "--rpc", "127.0.0.1:50052"]),
                        (dev,)).totals()[dev.name].total for m in models)
    assert used <= (160 - 16) * MIB  # the picks, loaded together, within the budget
