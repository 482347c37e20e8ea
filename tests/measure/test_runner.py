from __future__ import annotations

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.runner import WorkerRunner
from fitter.measure.types import BenchSpec
from fitter.memory.estimator import estimate
from fitter.tune.screen import device_totals

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
