from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.runners import ServerRunner, WorkerRunner
from fitter.measure.types import BenchSpec
from fitter.memory.plan.estimator import estimate
from fitter.search.screen import device_totals
from tests.ports import OCCUPANTS, first_pick_taken

pytestmark = pytest.mark.llama


def test_each_trials_peak_on_the_emulated_gpu_is_its_own_after_a_heavier_one() -> None:
    from fitter.gguf.demo_models import demo_model_path

    model = str(demo_model_path())  # its experts dwarf a small context: a stale peak would show
    spec = load_model_spec(model)
    bench = BenchSpec(n_prompt=16, n_gen=4, repetitions=1, threads=1)
    with WorkerRunner(emulated_gpu_mib=256) as runner:
        peaks = []
        for flags in (["-ngl", "all"], ["-ngl", "all", "-ncmoe", "8"], ["-ngl", "all", "-ncmoe", "8", "-ub", "64"]):
            config = parse_launch_flags(["-c", "256", "-np", "1", *flags, "--rpc", ",".join(runner.rpc)])
            result = runner.run(model, config, bench, None)
            assert result.measurement.outcome == "ok"
            (device,) = runner.devices()
            predicted = device_totals(estimate(spec, config, runner.devices()))[device.name]
            peaks.append((result.peak_vram[device.name]["bytes"], predicted, result.measurement.reused_model))
    for peak, predicted, _ in peaks:
        assert peak == predicted  # not the heavier placement before it
    assert [reused for _, _, reused in peaks] == [False, False, True]
    assert peaks[1][0] < peaks[0][0]


# -- the emulated GPU's server dying, its port taken ----------------------------------------------------------------

SHORT = BenchSpec(n_prompt=16, n_gen=16, repetitions=1, threads=1)
LONG = BenchSpec(n_prompt=16, n_gen=512, repetitions=2, threads=1)  # seconds of decoding: room to kill the server


def _runner(kind: str, cap_mib: int) -> Any:
    if kind == "worker":
        return WorkerRunner(emulated_gpu_mib=cap_mib)
    from tests.conftest import BUILT_TOOLS

    return ServerRunner(str(BUILT_TOOLS / "llama-server"), emulated_gpu_mib=cap_mib)


def _config(runner: Any) -> Any:
    return parse_launch_flags(["-c", "1024", "-np", "1", "-ngl", "all", "--rpc", ",".join(runner.rpc)])


RUNNERS = [pytest.param("worker"), pytest.param("server", marks=pytest.mark.tools("llama-server"))]


@pytest.mark.parametrize("kind", RUNNERS)
def test_an_emulated_gpu_killed_mid_trial_is_a_crash_and_the_next_trial_gets_a_fresh_one(
        kind: str, llama_tools: dict[str, Path]) -> None:
    from fitter.gguf.demo_models import demo_model_path

    model = str(demo_model_path())
    with _runner(kind, 256) as runner:
        gpu = runner._gpu.gpus[0]
        old_pid, endpoint = gpu.pid, gpu.endpoint

        def kill_once_loaded() -> None:
            # the trial's context is made once the device holds its model, KV and compute buffers: the trial runs
            # then, however fast this machine loads (no guess of how long that takes)
            deadline = time.monotonic() + 60
            while gpu.stats().live_buffers < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(old_pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_loaded)
        killer.start()
        first = runner.run(model, _config(runner), LONG, 120)
        killer.join()
        second = runner.run(model, _config(runner), SHORT, 120)
        assert gpu.pid != old_pid and gpu.endpoint == endpoint and gpu.running  # a fresh server, the same device
    m = first.measurement
    assert m.outcome == "crash" and m.pp is None and m.tg is None
    assert m.reason.startswith(f"the emulated GPU's server ({endpoint}) killed by signal SIGKILL during the trial; ")
    assert second.measurement.outcome == "ok", second.measurement.reason
    assert second.peak_vram[gpu.device_name]["bytes"] > 90 * 2**20  # the model's weights, on the fresh device


def test_an_emulated_gpu_that_died_between_trials_is_replaced_before_the_next() -> None:
    from fitter.gguf.demo_models import demo_model_path

    model = str(demo_model_path())
    with WorkerRunner(emulated_gpu_mib=256) as runner:
        assert runner.run(model, _config(runner), SHORT, 120).measurement.outcome == "ok"
        old_pid = runner._gpu.gpus[0].pid
        os.kill(old_pid, signal.SIGKILL)  # the worker keeps the model it loaded onto that server
        assert runner._gpu.gpus[0].died(wait_s=5) == "killed by signal SIGKILL"
        after = runner.run(model, _config(runner), SHORT, 120).measurement
        assert (after.outcome, after.reused_model) == ("ok", False)
        assert runner._gpu.gpus[0].pid != old_pid


@pytest.mark.parametrize("how", OCCUPANTS)
def test_an_emulated_gpu_port_taken_before_its_server_binds_it_is_given_up_for_another(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from fitter.gguf.demo_models import demo_model_path

    with first_pick_taken(monkeypatch, how) as picks, WorkerRunner(emulated_gpu_mib=256) as runner:
        assert runner.rpc == (f"127.0.0.1:{picks[1]}",) and len(picks) == 2
        m = runner.run(str(demo_model_path()), _config(runner), SHORT, 120).measurement
    assert (m.outcome, m.reason) == ("ok", "")
