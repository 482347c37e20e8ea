"""Several emulated GPUs (`--emulated-gpu 96,48`): real llama.cpp places layers across unequal capped devices as the
estimator predicts, and runs out of memory on the device and at the stage the estimator names."""

from __future__ import annotations

import math

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.emulator.emulated_gpu import EmulatedGpus
from fitter.memory.plan.estimator import MemoryPlan, estimate, first_failure
from tests.models import model_file

pytestmark = pytest.mark.llama

MIB = 1024 * 1024
FLAGS = ["-c", "512", "-np", "1", "-fa", "on", "-ngl", "all"]


def _plan(gpus: EmulatedGpus, extra: list[str]) -> MemoryPlan:
    spec = load_model_spec(str(model_file("demo")))
    config = parse_launch_flags([*FLAGS, *extra, "--rpc", ",".join(gpus.endpoints)])
    return estimate(spec, config, gpus.devices())


def _load(gpus: EmulatedGpus, extra: list[str]):  # type: ignore[no-untyped-def]
    from fitter.measure.loader import load_and_capture

    gpus.reset_peak()
    return load_and_capture(str(model_file("demo")),
                            parse_launch_flags([*FLAGS, *extra, "--rpc", ",".join(gpus.endpoints)]))


@pytest.mark.parametrize("caps", [(96, 48), (120, 80, 40)], ids=["two", "three"])
def test_the_default_split_follows_each_caps_free_memory_and_each_device_uses_what_was_predicted(
        caps: tuple[int, ...]) -> None:
    with EmulatedGpus(caps) as gpus:
        plan = _plan(gpus, [])
        totals = plan.totals()
        used = [totals[d.name].total for d in plan.devices]
        assert all(u <= cap * MIB for u, cap in zip(used, caps, strict=True))
        assert len({d for d in plan.layer_devices if d != "CPU"}) == len(caps)  # every device holds layers
        res = _load(gpus, [])
        peaks = gpus.peaks()
    assert res.ok, res.error
    assert [peaks[d.name] for d in plan.devices] == used


def test_the_second_of_two_devices_runs_out_at_the_predicted_stage() -> None:
    # -ts fixes the split, so the caps can change without moving layers
    split = ["-ts", "2,1"]
    with EmulatedGpus((512, 512)) as probe:
        plan = _plan(probe, split)
        name = plan.devices[1].name
        need = plan.totals()[name]
    for expected, cap_mib in (("model", math.ceil(need.model / MIB) - 1),
                              ("kv", math.ceil((need.model + need.kv) / MIB) - 1)):
        with EmulatedGpus((512, cap_mib)) as gpus:
            plan = _plan(gpus, split)
            second, first = plan.devices[1].name, plan.devices[0].name
            assert first_failure(plan, second, cap_mib * MIB) == expected
            assert first_failure(plan, first, 512 * MIB) is None
            res = _load(gpus, split)
        assert not res.ok
        assert f"RPC0[{gpus.endpoints[1]}]" in (res.error or "") or expected == "kv"
        assert [g.stats().refused for g in gpus.gpus] == [0, 1]


def test_pipelined_compute_that_does_not_fit_is_reserved_again_without_pipeline_parallelism() -> None:
    # every layer offloaded, no override: pipeline parallelism keeps 4 copies of the scheduler's inputs; short of
    # them on the second device, llama.cpp (sched_reserve) retries with one copy, and the estimate says so
    split = ["-ts", "2,1"]
    with EmulatedGpus((512, 512)) as probe:
        pipelined = _plan(probe, split)
    cap_mib = math.ceil(pipelined.totals()[pipelined.devices[1].name].total / MIB) - 1
    with EmulatedGpus((512, cap_mib)) as gpus:
        plan = _plan(gpus, split)
        res = _load(gpus, split)
        peaks = gpus.peaks()
    assert res.ok, res.error
    assert any("retries without it" in w for w in plan.warnings)
    first, second = (d.name for d in plan.devices)
    totals = plan.totals()
    assert totals[second].compute < pipelined.totals()[pipelined.devices[1].name].compute
    # the second device never held the pipelined buffers; the first held them until the retry freed them
    assert peaks[second] == totals[second].total
    assert peaks[first] == pipelined.totals()[pipelined.devices[0].name].total
