"""Over-budget configurations fail on the emulated GPU at the stage the estimator predicts, naming the buffer."""

from __future__ import annotations

import math

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import RPC, Device
from fitter.memory.plan.estimator import estimate, first_failure
from tests.models import model_file

MIB = 1024 * 1024
FLAGS = ["-c", "512", "-ngl", "all", "-np", "1", "-fa", "on"]
STAGE_MESSAGES = {
    "model": "unable to allocate RPC0[",
    "kv": "failed to allocate buffer for kv cache",
    "compute": "failed to allocate compute pp buffers",
}


def _plan(endpoint: str):  # type: ignore[no-untyped-def]
    spec = load_model_spec(str(model_file("demo")))
    device = Device(f"RPC0[{endpoint}]", RPC)
    return estimate(spec, parse_launch_flags([*FLAGS, "--rpc", endpoint]), (device,)), device.name


def test_first_failure_follows_llama_cpp_allocation_order() -> None:
    plan, name = _plan("127.0.0.1:50052")
    totals = plan.totals()[name]
    assert first_failure(plan, name, totals.model - 1) == "model"
    assert first_failure(plan, name, totals.model) == "kv"
    assert first_failure(plan, name, totals.model + totals.kv) == "compute"
    assert first_failure(plan, name, totals.total) is None


@pytest.mark.llama
def test_caps_fail_at_the_predicted_stage_and_the_predicted_total_loads() -> None:
    from fitter.measure.emulator.emulated_gpu import EmulatedGpu
    from fitter.measure.loader import load_and_capture

    plan, _ = _plan("127.0.0.1:50052")
    t = plan.totals()["RPC0[127.0.0.1:50052]"]
    caps = {  # whole MiB just below each stage's cumulative need, and the first that holds everything
        "model": math.ceil(t.model / MIB) - 1,
        "kv": math.ceil((t.model + t.kv) / MIB) - 1,
        "compute": math.ceil(t.total / MIB) - 1,
        None: math.ceil(t.total / MIB),
    }
    for expected, cap_mib in caps.items():
        with EmulatedGpu(cap_mib) as gpu:
            plan, name = _plan(gpu.endpoint)
            assert first_failure(plan, name, cap_mib * MIB) == expected
            res = load_and_capture(str(model_file("demo")), parse_launch_flags([*FLAGS, "--rpc", gpu.endpoint]))
            stats = gpu.stats()
        if expected is None:
            assert res.ok and stats.peak_bytes == plan.totals()[name].total
        else:
            assert not res.ok and res.error is not None
            assert STAGE_MESSAGES[expected] in res.error and stats.refused >= 1
