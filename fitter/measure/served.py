"""A workload through any runner: each depth one run of the same config (fitter's worker keeps the model loaded
between them, a llama-server or llama-bench is started for each), the streams as the runner serves them, the
speeds combined as the workload weighs them (fitter.workload: its tokens over their time).

What a trial of several depths records: `depths`, each depth's own pp/tg (and per-stream decode and time to first
token with several streams); `pp`/`tg` are the combination, one sample per repetition (repetition r of every
depth combined), so the noise statistics, pooling, confirm rounds and check read them as they read one test; and
`workload`, the workload itself, which `fitter check` repeats. A workload of one depth and one stream runs exactly as
a single test did before workloads (nothing added). A depth that fails fails the trial, saying which depth.
"""

from __future__ import annotations

from dataclasses import replace
from types import TracebackType
from typing import Any

from fitter.flags import LaunchConfig
from fitter.measure.runners import TrialRunner
from fitter.measure.types import AtDepth, BenchSpec, Latency, Measurement, SpeedStats, TrialResult
from fitter.memory.backends.devices import CpuProfile, Device
from fitter.memory.plan.estimator import MemoryPlan
from fitter.workload import Workload, combined_rate


class WorkloadRunner:
    """`inner`, measuring `workload` for every trial (the bench spec's -p, -n, -r and threads are the caller's)."""

    def __init__(self, inner: TrialRunner, workload: Workload) -> None:
        self.inner = inner
        self.workload = workload
        # the TrialRunner protocol, as the inner runner answers it
        self.backend = inner.backend
        self.emulated = inner.emulated
        self.deployed_context = inner.deployed_context

    @property
    def rpc(self) -> tuple[str, ...]:
        return self.inner.rpc

    def devices(self) -> tuple[Device, ...]:
        return self.inner.devices()

    def cpu_profile(self) -> CpuProfile | None:
        return self.inner.cpu_profile()

    def build(self) -> dict[str, str]:
        return self.inner.build()

    def __enter__(self) -> WorkloadRunner:
        self.inner.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.inner.__exit__(et, ev, tb)

    def __getattr__(self, name: str) -> Any:  # counters and helpers of the inner runner (trials_run, model_loads)
        return getattr(self.inner, name)

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None,
            plan: MemoryPlan | None = None) -> TrialResult:
        w = self.workload
        if w.is_default_shape:
            if w.prompts is None:
                return self.inner.run(model, config, replace(spec, n_depth=w.depths[0]), timeout, plan)
            r = self.inner.run(model, config, replace(spec, n_depth=w.depths[0], prompts=w.prompts.texts), timeout,
                               plan)
            return TrialResult(replace(r.measurement, workload=w.to_json()), r.peak_vram)  # which prompts it decoded
        results: list[TrialResult] = []
        for depth in w.depths:
            r = self.inner.run(model, config, replace(spec, n_depth=depth, streams=w.concurrency), timeout, plan)
            m = r.measurement
            if m.outcome != "ok":
                failed = replace(m, reason=f"at depth {depth}: {m.reason}", workload=w.to_json(),
                                 depths=tuple(_at_depth(x.measurement) for x in results))
                return TrialResult(failed, _peaks([*results, r]))
            results.append(r)
        return TrialResult(combine(w, [r.measurement for r in results]), _peaks(results))


def _at_depth(m: Measurement) -> AtDepth:
    return AtDepth(m.spec.n_depth, m.pp, m.tg, m.tg_stream, m.ttft)


def _peaks(results: list[TrialResult]) -> dict[str, dict[str, Any]]:
    """Each device's highest peak over the depths (the deepest usually: the same buffers, more of them touched)."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        for name, peak in r.peak_vram.items():
            if name not in out or peak["bytes"] > out[name]["bytes"]:
                out[name] = dict(peak)
    return out


def combine(w: Workload, measured: list[Measurement]) -> Measurement:
    """One measurement of the workload from one per depth (in `w.depths` order), every one `ok`."""
    weights = [w.share(m.spec.n_depth) for m in measured]
    last = measured[-1]

    def rates(key: str) -> SpeedStats | None:
        stats = [getattr(m, key) for m in measured]
        if any(s is None for s in stats):
            return None
        n = stats[0].n
        reps = min(len(s.samples_ts) for s in stats)
        samples = [combined_rate([s.samples_ts[r] for s in stats], weights) for r in range(reps)]
        return SpeedStats.from_ns(n, max(w.depths), [round(n * 1e9 / x) for x in samples])

    ttft = None
    if all(m.ttft is not None for m in measured):
        lat = [m.ttft for m in measured if m.ttft is not None]
        reps = min(len(x.samples_ms) for x in lat)
        ttft = Latency.from_ms([sum(wt * x.samples_ms[r] for wt, x in zip(weights, lat, strict=True))
                                for r in range(reps)])
    first = measured[0]
    return replace(last, spec=replace(last.spec, n_depth=max(w.depths)), pp=rates("pp"), tg=rates("tg"),
                   tg_stream=rates("tg_stream"), ttft=ttft, depths=tuple(_at_depth(m) for m in measured),
                   workload=w.to_json(), load_s=first.load_s, reused_model=all(m.reused_model for m in measured),
                   wall_s=sum(m.wall_s for m in measured),
                   peak_rss=max((m.peak_rss for m in measured if m.peak_rss is not None), default=None))
