"""A `TrialRunner` that replays a recorded landscape (fitter.grid.landscape, `fitter grid`): each trial returns one of
the runs recorded for its config, so a tune replayed against it meets the real machine's noise.

How a trial is answered:
- its config is found by the parsed launch config (the flags' spelling and the RPC endpoint ignored) and its
  threads, as SimRunner keys configs; a config the landscape does not hold (outside its space, or screened out by
  the estimator when it was recorded, so never measured) raises `NotRecorded`, a WorkerError naming the config and
  why: replay never invents a measurement;
- ONE recorded run of the config is drawn by a seeded RNG (seed, the config, how many times this runner replayed
  it), so the between-run noise is the recorded runs' and the within-run spread their recorded repetitions'; a
  recorded oom, crash or timeout replays as that outcome, with its reason;
- a spec asking for fewer repetitions than recorded takes the run's first ones; one asking for more (confirm runs
  take 2×r, at least 5) keeps the run's own and draws the rest with replacement from every repetition recorded for
  the config across its ok runs (pooling mixes in between-run noise: the extra samples are wider than one run's);
- buffers, devices, peak VRAM and peak RSS are the drawn run's; model loads count like SimRunner (a config with the
  loaded model's model-level flags reuses it: load 0 s, else the run's load time, or the landscape's median load
  when the drawn run had reused its model).
"""

from __future__ import annotations

import hashlib
import random
import statistics
from dataclasses import replace
from types import TracebackType
from typing import Any

from fitter.errors import LaunchConfigError
from fitter.flags import LaunchConfig, parse_flags, pin
from fitter.flags.config import recorded_repr
from fitter.flags.consumers import with_bench_context
from fitter.flags.vocabulary import MODEL_LEVEL
from fitter.grid.landscape import Landscape, Point
from fitter.measure.types import (
    BenchSpec,
    LoggedBuffer,
    Measurement,
    OomInfo,
    SpeedStats,
    TrialResult,
    WorkerError,
)
from fitter.memory.backends.devices import CpuProfile, Device
from fitter.memory.plan.estimator import MemoryPlan
from fitter.units import MIB


class NotRecorded(WorkerError):
    """A config the landscape has no measurement of (outside its space, screened out when recorded, or not reached
    by a recording that stopped early)."""


def config_key(config: LaunchConfig, threads: int, threads_batch: int) -> str:
    """A config as the replay matches it: the parsed launch config (flags as typed, RPC endpoints ignored: an emulated
    GPU listens on a fresh port each time) and its threads."""
    text = recorded_repr(replace(config, rpc=()))
    for endpoint in config.rpc:
        text = text.replace(endpoint, "<rpc>")
    return f"{text}|t{threads}|tb{threads_batch}"


class ReplayRunner:
    """Replays `landscape` (see the module docstring). Nothing to start: entering it is a no-op."""

    backend = "replay"
    deployed_context = True

    def __init__(self, landscape: Landscape, seed: int = 0) -> None:
        self.landscape = landscape
        self.seed = seed
        self.emulated = landscape.emulated_gpu_mib is not None
        self.emulated_kind = landscape.emulated_kind if self.emulated else "rpc"
        self.trials_run = 0
        self.model_loads = 0
        self._loaded: tuple[Any, ...] | None = None
        self._replays: dict[str, int] = {}
        self._index: dict[str, Point] = {}
        b = landscape.bench
        for p in landscape.points:
            try:
                config, process = parse_flags(p.flags, landscape.consumer)
            except LaunchConfigError:  # a combination llama.cpp refuses: screened, never asked for by a trial
                continue
            config = with_bench_context(config, b["p"] + b["n"] + b["d"])
            threads = process.threads or landscape.target["default_threads"]
            self._index.setdefault(config_key(config, threads, process.threads_batch or threads), p)
        loads = [float(r["load_s"]) for p in landscape.points for r in p.runs if r.get("load_s")]
        self._median_load_s = statistics.median(loads) if loads else 0.0

    @property
    def rpc(self) -> tuple[str, ...]:
        return self.landscape.rpc

    def devices(self) -> tuple[Device, ...]:
        return self.landscape.device_objects()

    def cpu_profile(self) -> CpuProfile:
        return self.landscape.cpu_profile

    def build(self) -> dict[str, str]:
        lc = self.landscape.llama_cpp
        return {"commit": str(lc["commit"]),
                "source": f"replay of {self.landscape.path} (measured by {lc.get('source', 'llama.cpp')})"}

    def __enter__(self) -> ReplayRunner:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        pass

    def point_of(self, config: LaunchConfig, spec: BenchSpec) -> Point | None:
        return self._index.get(config_key(config, spec.threads, spec.threads_batch or spec.threads))

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None,
            plan: MemoryPlan | None = None) -> TrialResult:
        land, b = self.landscape, self.landscape.bench
        shown = " ".join(pin(config, given=True)) or "the config"
        # a test left out (-n 0: a prefill-only trial whose decode is pooled, fitter.search.pooling) is not replayed
        if (spec.n_prompt or b["p"], spec.n_gen or b["n"], spec.n_depth) != (b["p"], b["n"], b["d"]):
            raise WorkerError(f"replay: {land.path} was recorded with -p {b['p']} -n {b['n']} -d {b['d']}, this "
                              f"trial asks for -p {spec.n_prompt} -n {spec.n_gen} -d {spec.n_depth}")
        point = self.point_of(config, spec)
        where = f"{shown} -t {spec.threads} -tb {spec.threads_batch or spec.threads}"
        if point is None:
            raise NotRecorded(f"replay: {where} is not a config of {land.path} (outside its space {land.space}): "
                              "it was never measured")
        if point.screened is not None:
            raise NotRecorded(f"replay: {where}: the estimator screened it out when {land.path} was recorded "
                              f"({point.screened}), so it was never measured")
        if not point.runs:
            raise NotRecorded(f"replay: {where} has no run in {land.path} (its recording stopped before it)")
        n = self._replays.get(point.key, 0)
        self._replays[point.key] = n + 1
        rng = random.Random(hashlib.sha256(f"{self.seed}|{point.key}|{n}".encode()).digest())
        run = point.runs[rng.randrange(len(point.runs))]
        self.trials_run += 1
        key = (model, *(getattr(config, k) for k in MODEL_LEVEL))
        reused = key == self._loaded
        self.model_loads += 0 if reused else 1
        recorded_load = float(run.get("load_s") or 0.0)
        load_s = 0.0 if reused else (recorded_load or self._median_load_s)
        wall = float(run.get("wall_s") or 0.0) - recorded_load + load_s
        oom = run.get("oom")
        m = Measurement(
            run["outcome"], run.get("reason", ""), spec=spec, flags=tuple(pin(config, given=True)),
            oom=OomInfo(oom.get("stage", "unknown"), oom.get("buft"), oom.get("bytes")) if oom else None,
            buffers=tuple(LoggedBuffer(x["buft"], x["kind"], x["bytes"] / MIB) for x in run.get("buffers", [])),
            load_s=round(load_s, 3), reused_model=reused, peak_rss=run.get("peak_rss"),
            llama_cpp=dict(run.get("llama_cpp") or {}))
        if run["outcome"] == "ok":
            tests: dict[str, SpeedStats] = {}
            for test, asked, recorded in (("pp", spec.n_prompt, b["p"]), ("tg", spec.n_gen, b["n"])):
                stats, extra = _stats(point, run, test, spec.repetitions, rng)  # drawn either way: seeded draws stay
                if asked:
                    tests[test] = stats
                    wall += extra
                else:  # left out: the recorded run's time for it is not spent
                    wall -= sum(recorded / x for x in run[test]["samples_ts"])
            m = replace(m, pp=tests.get("pp"), tg=tests.get("tg"))
        self._loaded = key if run["outcome"] == "ok" else None
        m = replace(m, wall_s=round(wall, 3))
        if m.outcome == "ok" and timeout is not None and wall > timeout:
            self._loaded = None
            why = f"killed after {timeout:g} s (the limit): the recorded run took {wall:.1f} s"
            m = replace(m, outcome="timeout", reason=why, pp=None, tg=None)
        return TrialResult(m, {k: dict(v) for k, v in (run.get("peak_vram") or {}).items()})


def _stats(point: Point, run: dict[str, Any], test: str, reps: int, rng: random.Random) -> tuple[SpeedStats, float]:
    """`reps` samples of `test`: the run's own first, then draws from the config's recorded repetitions; and the
    seconds the extra samples add to the run."""
    s = run[test]
    samples = [float(x) for x in s["samples_ts"]][:reps]
    extra = 0.0
    if len(samples) < reps:
        pool = [float(x) for r in point.ok_runs() for x in r[test]["samples_ts"]]
        drawn = [pool[rng.randrange(len(pool))] for _ in range(reps - len(samples))]
        extra = sum(s["n"] / x for x in drawn)
        samples += drawn
    n = int(s["n"])
    std = statistics.stdev(samples) if len(samples) > 1 else 0.0
    stats = SpeedStats(n, int(s.get("depth", 0)), tuple(round(n * 1e9 / x) for x in samples), tuple(samples),
                       statistics.fmean(samples), std)
    return stats, extra
