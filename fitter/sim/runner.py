"""A `TrialRunner` on a simulated machine: the memory plan it is handed (else the estimator's) for memory, the
performance model (fitter.sim.physics) for speed, seeded noise per repetition."""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import replace
from types import TracebackType
from typing import Any

from fitter.errors import FitterError
from fitter.flags import LaunchConfig, pin
from fitter.flags.config import recorded_repr
from fitter.flags.consumers import DEFAULT_CONSUMER
from fitter.flags.vocabulary import MODEL_LEVEL
from fitter.gguf.model_spec import ModelSpec
from fitter.measure.types import (
    BenchSpec,
    Latency,
    LoggedBuffer,
    Measurement,
    OomInfo,
    SpeedStats,
    TrialResult,
    WorkerError,
)
from fitter.memory.backends.devices import CUDA, CpuProfile, Device
from fitter.memory.plan.estimator import CPU, Buffer, MemoryPlan, estimate
from fitter.sim.physics import context_bytes, decode_seconds, out_of_memory, prefill_seconds
from fitter.sim.profile import CPU_PROFILES, Machine
from fitter.units import GIB, MIB


def _noise_factors(seed: int, key: str, n: int, noise: float) -> list[float]:
    out = []
    for rep in range(n):
        digest = hashlib.sha256(f"{seed}|{key}|{rep}".encode()).digest()
        out.append(max(0.2, 1.0 + noise * random.Random(digest).gauss(0.0, 1.0)))
    return out


class SimRunner:
    """A `TrialRunner` on a simulated machine: the plan it is handed (else the estimator's) for memory, the
    performance model for speed. Nothing to start: entering it is a no-op."""

    backend = "sim"
    emulated = False
    deployed_context = True
    rpc: tuple[str, ...] = ()

    def __init__(self, machine: Machine, spec: ModelSpec, seed: int | None = None) -> None:
        self.machine = machine
        self.spec = spec
        self.seed = machine.seed if seed is None else seed
        self.trials_run = 0
        self.model_loads = 0
        self._loaded: tuple[Any, ...] | None = None
        self._runs: dict[str, int] = {}  # runs of each config so far: its next run's between-run factor

    def devices(self) -> tuple[Device, ...]:
        return tuple(Device(f"CUDA{i}", CUDA, round(g.memory_gib * GIB),
                            round(g.memory_gib * GIB) - round(g.reserved_gib * GIB))
                     for i, g in enumerate(self.machine.gpus))

    def cpu_profile(self) -> CpuProfile:
        return CPU_PROFILES[self.machine.cpu.isa]

    def build(self) -> dict[str, str]:
        return {"commit": f"sim-{self.machine.name}",
                "source": f"fitter.sim model of {self.machine.path or self.machine.name}"}

    def __enter__(self) -> SimRunner:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        pass

    def plan(self, config: LaunchConfig) -> MemoryPlan:
        try:
            return estimate(self.spec, config, self.devices(), self.cpu_profile())
        except FitterError as e:
            raise WorkerError(f"llama.cpp rejected {' '.join(pin(config, given=True)) or 'the config'}: {e}") from e

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None,
            plan: MemoryPlan | None = None) -> TrialResult:
        """One simulated trial of `config`: the caller's plan of it (the screen's) is measured as it is, so the
        config is not estimated twice."""
        m, plan = self.machine, plan if plan is not None else self.plan(config)
        self.trials_run += 1
        key = (model, *(getattr(config, k) for k in MODEL_LEVEL))
        reused = key == self._loaded
        self.model_loads += 0 if reused else 1
        # llama.cpp uploads each device's weights in turn (llama_model_loader::load_all_data)
        upload_s = sum(b.bytes / (m.gpu_of(b.device).pcie_gbps * 1e9) for b in plan.buffers
                       if b.kind == "model" and b.device != CPU)
        load_s = 0.0 if reused else sum(self.spec.shard_sizes) / (m.disk_gbps * 1e9) + upload_s
        base = Measurement("ok", "", spec=spec, flags=tuple(pin(config, given=True)), load_s=round(load_s, 3),
                           wall_s=round(load_s, 3), reused_model=reused, llama_cpp=self.build())
        failed = out_of_memory(m, plan)
        if failed is not None:
            self._loaded = None if failed[0].stage == "model" else key  # a failed context leaves the model loaded
            self._take(base.wall_s)
            return TrialResult(self._oom(base, *failed))
        need = spec.n_depth + max(spec.n_prompt, spec.n_gen)
        if need > plan.context.n_ctx_seq:
            raise WorkerError(f"the test needs {need} cells (depth {spec.n_depth} + max(-p, -n)) but a sequence of "
                              f"this context holds {plan.context.n_ctx_seq}")
        if spec.streams > plan.context.n_seq_max:
            raise WorkerError(f"{spec.streams} streams at once but the config serves {plan.context.n_seq_max} (-np): "
                              "the rest would wait for a slot")
        if plan.context.n_stream == 1 and spec.streams * need > plan.context.n_ctx:
            raise WorkerError(f"{spec.streams} streams of {need} cells (depth {spec.n_depth} + max(-p, -n)) but the "
                              f"unified KV cache holds {plan.context.n_ctx}")
        self._loaded = key
        result = self._measure(plan, spec, base)
        if timeout is not None and result.wall_s > timeout:
            self._loaded = None
            why = f"killed after {timeout:g} s (the limit): the simulated trial takes {result.wall_s:.1f} s"
            result = replace(result, outcome="timeout", reason=why, pp=None, tg=None)
        peak = {d.name: {"bytes": plan.totals()[d.name].total + context_bytes(m, d.name), "source": "sim"}
                for d in plan.devices}
        self._take(min(result.wall_s, timeout) if timeout is not None else result.wall_s)
        return TrialResult(result, peak)

    def _take(self, wall_s: float) -> None:
        """The run's simulated time as real time, at the machine's pace (none by default)."""
        if self.machine.pace:
            time.sleep(wall_s * self.machine.pace)

    def _oom(self, base: Measurement, oom: OomInfo, device: str, cap: int, allocated: list[Buffer]) -> Measurement:
        held = sum(b.bytes for b in allocated if b.device == device)
        context = context_bytes(self.machine, device) if device != CPU else 0
        where = "of RAM" if device == CPU else f"free on {device} less {context / MIB:.0f} MiB of CUDA context"
        reason = (f"out of memory allocating the {oom.stage} buffer: {oom.buft} refused {oom.requested_bytes} "
                  f"bytes ({(oom.requested_bytes or 0) / MIB:.2f} MiB) with {held / MIB:.2f} MiB held, of the "
                  f"{cap / MIB:.2f} MiB {where} (sim machine {self.machine.name})")
        logged = tuple(LoggedBuffer(b.buft, b.kind, b.bytes / MIB) for b in allocated)
        return replace(base, outcome="oom", reason=reason, oom=oom, buffers=logged)

    def _measure(self, plan: MemoryPlan, spec: BenchSpec, base: Measurement) -> Measurement:
        """pp and tg samples, one per repetition, and the trial's simulated wall time."""
        m, tb, streams = self.machine, spec.threads_batch or spec.threads, spec.streams
        pp_s = prefill_seconds(m, plan, streams * spec.n_prompt, spec.n_depth, tb)  # every stream's prompt at once
        tg_s = decode_seconds(m, plan, spec)  # every stream's -n tokens, a token of each per step
        # the config, however its flags were spelled; llama-server's configs keep the key they had before a config
        # named its program (`consumer`) or its split mode (`-sm`), so seeded figures recorded then reproduce
        config_key = recorded_repr(plan.config).replace(f", consumer='{DEFAULT_CONSUMER}'", "")

        run_key = f"{config_key}|t{spec.threads}|tb{tb}"
        run = self._runs.get(run_key, 0)
        self._runs[run_key] = run + 1
        # between runs: one factor for the whole run (none without run_noise, so seeded figures stay as they were)
        between = _noise_factors(self.seed, f"{run_key}|run", run + 1, m.run_noise)[run] if m.run_noise else 1.0

        def stats(test: str, n: int, seconds: float) -> SpeedStats | None:
            """Aggregate over the streams: a repetition's `seconds` serve n tokens in each stream."""
            if not n:
                return None
            key = f"{run_key}|{test}" + (f"|x{streams}" if streams > 1 else "")
            factors = _noise_factors(self.seed, key, spec.repetitions, m.noise)
            return SpeedStats.from_ns(n, spec.n_depth, [round(seconds * f * between * 1e9 / streams) for f in factors])

        pp, tg = stats("pp", spec.n_prompt, pp_s), stats("tg", spec.n_gen, tg_s)
        tg_stream = ttft = None
        if streams > 1:  # each stream decodes at the aggregate's 1/S; its first token comes when the prompts are done
            tg_stream = None if tg is None else SpeedStats.from_ns(spec.n_gen, spec.n_depth,
                                                                   [ns * streams for ns in tg.samples_ns])
            ttft = None if pp is None else Latency.from_ms([ns * streams / 1e6 for ns in pp.samples_ns])
        wall = base.wall_s + (pp_s + tg_s / max(spec.n_gen, 1) if spec.warmup else 0.0)
        depth_s = prefill_seconds(m, plan, spec.n_depth, 0, tb)  # each repetition refills the context first
        for s in (pp, tg):
            if s is not None:
                wall += sum(s.samples_ns) * streams / 1e9 + spec.repetitions * depth_s
        return replace(base, pp=pp, tg=tg, tg_stream=tg_stream, ttft=ttft, wall_s=round(wall, 3),
                       peak_rss=plan.totals()[CPU].total,
                       buffers=tuple(LoggedBuffer(b.buft, b.kind, b.bytes / MIB) for b in plan.buffers))
