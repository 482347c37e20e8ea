"""fitter.measure.served: a workload through any runner: a run per depth, the speeds combined as the workload
weighs them, a failed depth named, a single test passed through unchanged. The inner runner is a fake whose speed
is a known function of the depth."""

from __future__ import annotations

from dataclasses import replace
from types import TracebackType
from typing import Any

import pytest

from fitter.flags import LaunchConfig, parse_launch_flags
from fitter.flags.pin import pin
from fitter.measure.served import WorkloadRunner
from fitter.measure.types import BenchSpec, Latency, Measurement, SpeedStats, TrialResult
from fitter.memory.backends.devices import CpuProfile, Device
from fitter.workload import Workload

CONFIG = parse_launch_flags(["-c", "16384"])
SPEC = BenchSpec(n_prompt=100, n_gen=10, repetitions=2, threads=2)


class ByDepth:
    """Decode 100 t/s at depth 0, 50 at 8192 (one sample each repetition, the second 10 % faster); prefill 1000 /
    500; peak VRAM grows with the depth. Records the specs it was asked for; fails at `fail_at`."""

    backend = "fake"
    emulated = False
    deployed_context = True
    rpc: tuple[str, ...] = ()

    def __init__(self, fail_at: int | None = None) -> None:
        self.asked: list[BenchSpec] = []
        self.fail_at = fail_at

    def devices(self) -> tuple[Device, ...]:
        return ()

    def cpu_profile(self) -> CpuProfile | None:
        return None

    def build(self) -> dict[str, str]:
        return {"commit": "fake", "source": "test"}

    def __enter__(self) -> ByDepth:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        pass

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None,
            plan: Any = None) -> TrialResult:
        self.asked.append(spec)
        d, flags = spec.n_depth, tuple(pin(config, given=True))
        if d == self.fail_at:
            return TrialResult(Measurement("oom", "out of memory allocating the kv buffer", spec, flags))
        slow = 1 if d == 0 else 2

        def stats(n: int, ts: float) -> SpeedStats:
            return SpeedStats.from_ns(n, d, [round(n * 1e9 / (ts * f)) for f in (1.0, 1.1)])

        m = Measurement("ok", "", spec, flags, stats(spec.n_prompt, 1000 / slow), stats(spec.n_gen, 100 / slow),
                        ttft=Latency.from_ms([10.0 * slow, 12.0 * slow]) if spec.streams > 1 else None,
                        load_s=1.0 if d == 0 else 0.0, reused_model=d != 0, wall_s=2.0)
        return TrialResult(m, {"GPU0": {"bytes": 1000 + d, "source": "fake"}})


def test_one_depth_and_one_stream_runs_as_a_single_test() -> None:
    inner = ByDepth()
    result = WorkloadRunner(inner, Workload(depths=(4096,))).run("m", CONFIG, SPEC, None)
    assert inner.asked == [replace(SPEC, n_depth=4096)]
    assert result.measurement.depths == () and result.measurement.workload is None
    assert "depths" not in result.measurement.to_json() and "workload" not in result.measurement.to_json()


def test_each_depth_is_a_run_and_the_speeds_combine_as_the_tokens_time() -> None:
    inner = ByDepth()
    w = Workload(n_prompt=100, n_gen=10, depths=(0, 8192), weights=(1.0, 3.0))
    m = WorkloadRunner(inner, w).run("m", CONFIG, SPEC, None).measurement
    assert [s.n_depth for s in inner.asked] == [0, 8192]
    assert m.outcome == "ok" and [d.depth for d in m.depths] == [0, 8192]
    # a quarter of the tokens at 100 t/s, three quarters at 50: 1 / (0.25/100 + 0.75/50) = 57.14 t/s
    assert m.tg is not None and m.tg.samples_ts == pytest.approx((400 / 7, 440 / 7), rel=1e-6)
    assert m.pp is not None and m.pp.samples_ts == pytest.approx((4000 / 7, 4400 / 7), rel=1e-6)
    assert (m.tg.n, m.pp.n) == (10, 100)
    assert m.depths[1].tg is not None and m.depths[1].tg.avg_ts == pytest.approx(52.5, rel=1e-6)
    assert (m.load_s, m.reused_model, m.wall_s) == (1.0, False, 4.0)
    assert m.workload == w.to_json()


def test_the_highest_peak_over_the_depths_is_the_trials() -> None:
    result = WorkloadRunner(ByDepth(), Workload(depths=(0, 8192))).run("m", CONFIG, SPEC, None)
    assert result.peak_vram == {"GPU0": {"bytes": 9192, "source": "fake"}}


def test_time_to_first_token_weighs_as_time() -> None:
    w = Workload(depths=(0, 8192), weights=(1.0, 3.0), concurrency=2)
    inner = ByDepth()
    m = WorkloadRunner(inner, w).run("m", CONFIG, SPEC, None).measurement
    assert {s.streams for s in inner.asked} == {2}
    assert m.ttft is not None and m.ttft.samples_ms == pytest.approx((0.25 * 10 + 0.75 * 20, 0.25 * 12 + 0.75 * 24))


def test_a_depth_that_fails_fails_the_trial_and_says_which() -> None:
    inner = ByDepth(fail_at=8192)
    result = WorkloadRunner(inner, Workload(depths=(0, 8192, 16384))).run("m", CONFIG, SPEC, None)
    m = result.measurement
    assert (m.outcome, m.reason) == ("oom", "at depth 8192: out of memory allocating the kv buffer")
    assert [d.depth for d in m.depths] == [0] and m.pp is None and m.tg is None
    assert [s.n_depth for s in inner.asked] == [0, 8192]  # nothing deeper is tried
    assert result.peak_vram == {"GPU0": {"bytes": 1000, "source": "fake"}}


def test_the_wrapper_answers_for_its_runner() -> None:
    inner = ByDepth()
    served = WorkloadRunner(inner, Workload())
    with served as entered:
        assert entered is served
    assert (served.backend, served.emulated, served.deployed_context, served.build()) == (
        "fake", False, True, {"commit": "fake", "source": "test"})
    assert served.asked is inner.asked  # anything else: the inner runner's
