"""Simulated machines: a deterministic performance model of llama.cpp on a GPU+CPU machine, driven by the
estimator's memory plan, for tuning without hardware (`--backend sim --machine NAME|FILE`).

A machine profile (`fitter/machines/*.toml`, or any TOML file of the same keys) holds physical parameters only;
nothing in it refers to a flag or a configuration. Where each tensor lives, the KV cache, the context and the
device totals all come from `fitter.estimator.estimate`. The equations, for one ubatch of m tokens whose queries
attend n_kv cells on average:

    ubatch(m)  = Σ_work max(flops / F_dev, bytes / B_dev)          roofline of each weight and each layer's attention
               + Σ_cpu-resident weights bytes_w / B_pcie            op offload only: m ≥ 32 and a GPU (ggml-cuda.cu
                                                                     offload_op), the weights copied per ubatch
               + hand_offs · t_split                                changes of device along the graph: the token
                                                                     embedding (CPU), then per layer its attention
                                                                     weights, attention, router, FFN or experts, and
                                                                     the output (graph splits − 1)
               + ops_gpu · t_launch + ops_cpu · t_sync · threads    kernel launches; a CPU barrier per op

  weight w:  bytes = its size (experts: × u, the share of experts any of the m tokens routes to,
             u = 1 − (1 − k/E)^m for top-k of E), flops = 2 · elements · m (experts: × k/E; output: one row, as
             llama-bench asks logits of the last token only). It runs where it lives; under op offload the
             CPU-resident ones (not the token embedding, a row lookup) run on the first GPU.
  attention: on the device of the layer's KV (the CPU with -nkvo), bytes = n_kv' · (K + V row bytes of the cache
             types: q8_0 reads 34/64 of f16) + without flash attention 3 passes over the f32 scores
             (4 · n_head · m · n_kv'), flops = 2 · m · n_kv' · n_head · (d_k + d_v) + 2 per quantized KV element
             (dequantisation); n_kv' = min(n_kv, window) on sliding-window layers.
  GPU:       F = tflops, B = bandwidth (achieved, not nominal).
  CPU:       threads fill P-cores, then E-cores (speed e), then SMT siblings (gain s on compute, nothing on
             bandwidth: siblings share their core's miss slots); past the logical CPUs, time slicing scales both by
             logical / threads. With c and b those P-core equivalents, F = c · core_gflops and
             B = min(b · core_gbps, channels · MT/s · 8 B · efficiency): decode saturates at the memory limit.

    decode t/s  = 1 / ubatch(1) at n_kv = depth + n/2                         (threads: -t)
    prefill t/s = n_prompt / Σ ubatch(m_i) over the -b/-ub chunks at n_kv = their mean position (-tb, else -t)

Each repetition's time is multiplied by 1 + noise · N(0, 1), drawn from a generator seeded by (the profile's seed,
the config however its flags are spelled, the threads, the test, the repetition): the same config gives the same
samples in any order. A model load takes file bytes / disk + GPU weight bytes / PCIe, and none when the model-level
flags repeat the previous trial's (llama-bench's rule, fitter.worker.MODEL_LEVEL).
Memory is the plan: a GPU whose buffers plus the CUDA context exceed its free memory (total − reserved), or host
buffers (the model mapping included) over the RAM, fail with `oom` at the first buffer, in llama.cpp's order of
allocation (model, KV, compute, output), that does not fit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fitter.devices import CPU_AVX2, CPU_AVX512, CPU_NO_REPACK, CUDA, CpuProfile, Device
from fitter.errors import FitterError
from fitter.estimator import CPU, KINDS, Buffer, MemoryPlan, estimate, row_bytes
from fitter.launch_config import KV_CACHE_TYPES, LaunchConfig
from fitter.llama_logs import LoggedBuffer
from fitter.model_spec import ModelSpec, Role
from fitter.trial_runner import TrialResult
from fitter.worker import MODEL_LEVEL, BenchSpec, Measurement, OomInfo, SpeedStats, WorkerError

GIB = 1024**3
MIB = 1024**2
MACHINES_DIR = Path(__file__).parent / "machines"
OP_OFFLOAD_MIN_BATCH = 32  # ggml-cuda.cu ggml_backend_cuda_device_offload_op: get_op_batch_size(op) >= 32
FA_OFF_PASSES = 3  # without flash attention the f32 KQ scores are written, soft-maxed in place, then read
DEQUANT_FLOPS = 2.0  # per element of a quantized KV cache read
CPU_PROFILES = {"avx2": CPU_AVX2, "avx512": CPU_AVX512, "none": CPU_NO_REPACK}
# Order of a layer's work (for counting splits): attention weights and norms, the attention itself, then the FFN.
_STEP = {Role.ROUTER: 2, Role.SHARED_EXPERT: 3, Role.DENSE_FFN: 4, Role.EXPERT: 4}


def _num(lo: float, doc: str, default: Any = dataclasses.MISSING, lo_open: bool = False,
         hi: float | None = None) -> Any:
    """A numeric profile key: its lower bound (open or closed), optional upper bound, and what it means."""
    return field(default=default, metadata={"lo": lo, "lo_open": lo_open, "hi": hi, "doc": doc})


@dataclass(frozen=True)
class Gpu:
    memory_gib: float = _num(0, "memory of each GPU", lo_open=True)
    bandwidth_gbps: float = _num(0, "achieved memory bandwidth, GB/s", lo_open=True)
    tflops: float = _num(0, "achieved matmul throughput on quantized weights, TFLOPS", lo_open=True)
    pcie_gbps: float = _num(0, "achieved host-to-GPU copy bandwidth from mapped host memory, GB/s", lo_open=True)
    count: int = _num(1, "GPUs (identical)", 1)
    reserved_gib: float = _num(0, "memory the desktop and driver hold before llama.cpp starts", 0.0)
    context_mib: float = _num(0, "CUDA context, cuBLAS workspace and pools: memory beyond llama.cpp's buffers", 400.0)
    launch_us: float = _num(0, "per op: kernel launch and graph overhead", 5.0)
    split_sync_us: float = _num(0, "per CPU↔GPU hand-off: stream sync, activation copy, waking the CPU threads", 80.0)


@dataclass(frozen=True)
class Cpu:
    p_cores: int = _num(1, "performance cores")
    core_gflops: float = _num(0, "one P-core's matmul rate on quantized weights, GFLOPS", lo_open=True)
    core_gbps: float = _num(0, "one P-core's weight streaming rate (load, dequantise, dot), GB/s", lo_open=True)
    e_cores: int = _num(0, "efficiency cores (no SMT)", 0)
    smt: int = _num(1, "hardware threads per P-core", 1, hi=8)
    e_core_speed: float = _num(0, "an E-core's rate relative to a P-core", 0.5, hi=1)
    smt_gain: float = _num(0, "compute a P-core's SMT sibling adds, relative to the core", 0.15, hi=1)
    sync_us: float = _num(0, "per op and thread: the barrier that ends every CPU op", 0.1)
    isa: str = field(default="avx2", metadata={"choices": tuple(CPU_PROFILES), "doc": "CPU repack kernels"})


@dataclass(frozen=True)
class Ram:
    gib: float = _num(0, "RAM for the model mapping and host buffers", lo_open=True)
    channels: int = _num(1, "memory channels")
    mts: float = _num(0, "transfers per second of each 64-bit channel, MT/s", lo_open=True)
    efficiency: float = _num(0, "share of the channels' peak bandwidth that reads reach", 0.65, lo_open=True, hi=1)

    @property
    def gbps(self) -> float:
        return self.channels * self.mts * 8 / 1000 * self.efficiency


@dataclass(frozen=True)
class Machine:
    name: str
    cpu: Cpu
    ram: Ram
    gpu: Gpu | None = None  # None: CPU only
    description: str = field(default="", metadata={"doc": "what the machine stands for"})
    models: tuple[str, ...] = field(default=(), metadata={"doc": "fitter.demo_models SHAPES it is meant for"})
    disk_gbps: float = _num(0, "model file read rate, GB/s (load time only)", 3.0, lo_open=True)
    noise: float = _num(0, "relative standard deviation of one repetition's time", 0.0, hi=0.5)
    seed: int = _num(0, "seed of the noise", 0)
    path: str = ""

    @property
    def cpu_threads(self) -> int:
        return self.cpu.p_cores * self.cpu.smt + self.cpu.e_cores


# ----------------------------------------------------------------------------------------------------------------
# Profiles


_TABLES: dict[str, Any] = {"gpu": Gpu, "cpu": Cpu, "ram": Ram}


def shipped_machines() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in MACHINES_DIR.glob("*.toml")))


def load_machine(name_or_path: str | Path) -> Machine:
    """A shipped profile by name (`fitter machines` lists them) or a TOML file of the same keys."""
    path = Path(name_or_path)
    if str(name_or_path) in shipped_machines():
        path = MACHINES_DIR / f"{name_or_path}.toml"
    elif not path.is_file():
        shipped = ", ".join(shipped_machines())
        raise FitterError(f"machine {str(name_or_path)!r}: neither a shipped profile ({shipped}) nor a file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise FitterError(f"{path}: cannot read the machine profile: {e}") from e
    top = _values(path, "", Machine, {k: v for k, v in data.items() if k not in _TABLES})
    tables = {}
    for key, cls in _TABLES.items():
        if key not in data and key != "gpu":
            raise FitterError(f"{path}: missing table [{key}] (only [gpu] may be left out: a CPU-only machine)")
        if key in data:
            if not isinstance(data[key], dict):
                raise FitterError(f"{path}: {key} = {data[key]!r}: must be a table [{key}]")
            tables[key] = cls(**_values(path, key, cls, data[key]))
    return Machine(name=path.stem, path=str(path), **top, **tables)


def _values(path: Path, section: str, cls: Any, data: dict[str, Any]) -> dict[str, Any]:
    """One table's keys checked against cls's documented fields: unknown keys, types, bounds, required keys."""
    fields = {f.name: f for f in dataclasses.fields(cls) if "doc" in f.metadata}
    out = {}
    for key, value in data.items():
        if key not in fields:
            where, allowed = (f" in [{section}]", [*fields]) if section else ("", [*fields, *_TABLES])
            raise FitterError(f"{path}: unknown key {key!r}{where}; allowed: {', '.join(allowed)}")
        rule = _rule(fields[key], value)
        if rule is not None:
            name = f"{section}.{key}" if section else key
            raise FitterError(f"{path}: {name} = {value!r}: must be {rule} ({fields[key].metadata['doc']})")
        out[key] = tuple(value) if isinstance(value, list) else value
    missing = [name for name, f in fields.items() if name not in data and f.default is dataclasses.MISSING]
    if missing:
        raise FitterError(f"{path}: [{section}] is missing {', '.join(missing)}")
    return out


def _rule(f: dataclasses.Field[Any], value: Any) -> str | None:
    """The rule a profile value breaks, or None."""
    meta, kind = f.metadata, str(f.type)
    if "choices" in meta:
        return None if value in meta["choices"] else "one of " + ", ".join(meta["choices"])
    if kind == "str":
        return None if isinstance(value, str) else "a string"
    if kind.startswith("tuple"):
        return None if isinstance(value, list) and all(isinstance(v, str) for v in value) else "a list of strings"
    integer, lo, hi = kind == "int", meta["lo"], meta["hi"]
    rule = ("an integer" if integer else "a number") + (" > " if meta["lo_open"] else " >= ") + f"{lo:g}"
    rule += f" and <= {hi:g}" if hi is not None else ""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return rule
    in_range = (value > lo if meta["lo_open"] else value >= lo) and (hi is None or value <= hi)
    return None if in_range else rule


def machines_table() -> str:
    """The shipped profiles, one line each (`fitter machines`)."""
    rows = [("machine", "GPU", "CPU", "RAM", "for")]
    for name in shipped_machines():
        m = load_machine(name)
        g = m.gpu
        gpu = "none" if g is None else (f"{g.count}× {g.memory_gib:g} GiB {g.bandwidth_gbps:g} GB/s "
                                        f"{g.tflops:g} TFLOPS, PCIe {g.pcie_gbps:g} GB/s")
        c = m.cpu
        cpu = f"{c.p_cores}P" + (f"+{c.e_cores}E" if c.e_cores else "") + f" cores, {m.cpu_threads} threads"
        ram = f"{m.ram.gib:g} GiB {m.ram.channels}×{m.ram.mts:g} MT/s ({m.ram.gbps:.0f} GB/s)"
        rows.append((name, gpu, cpu, ram, ", ".join(m.models)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, [*widths, 0], strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# The performance model


def thread_capacity(cpu: Cpu, threads: int) -> tuple[float, float]:
    """(compute, bandwidth) of `threads` threads in P-core equivalents."""
    p = min(threads, cpu.p_cores)
    e = min(max(threads - cpu.p_cores, 0), cpu.e_cores)
    s = min(max(threads - cpu.p_cores - cpu.e_cores, 0), cpu.p_cores * (cpu.smt - 1))
    compute, bandwidth = p + e * cpu.e_core_speed + s * cpu.smt_gain, p + e * cpu.e_core_speed
    logical = cpu.p_cores * cpu.smt + cpu.e_cores
    scale = min(1.0, logical / threads)
    return compute * scale, bandwidth * scale


def _rates(m: Machine, dev: str, threads: int) -> tuple[float, float]:
    """(FLOP/s, bytes/s) of a device."""
    if dev == CPU:
        compute, bandwidth = thread_capacity(m.cpu, threads)
        return compute * m.cpu.core_gflops * 1e9, min(bandwidth * m.cpu.core_gbps, m.ram.gbps) * 1e9
    assert m.gpu is not None
    return m.gpu.tflops * 1e12, m.gpu.bandwidth_gbps * 1e9


def ubatch_seconds(m: Machine, plan: MemoryPlan, n_tokens: int, n_kv: float, threads: int) -> float:
    """One llama_decode of n_tokens whose queries attend n_kv cells on average (the module's equation)."""
    spec, config = plan.model, plan.config
    gpus = [d.name for d in plan.devices]
    offload = bool(gpus) and not config.no_op_offload and n_tokens >= OP_OFFLOAD_MIN_BATCH
    k_share = spec.n_expert_used / spec.n_expert if spec.n_expert else 1.0
    used = 1 - (1 - k_share) ** n_tokens
    work: list[tuple[tuple[int, int], str, float, float]] = []  # (order, device, flops, bytes)
    pcie = 0.0
    for p in plan.placements:
        t = p.tensor
        if t.role is Role.EMBEDDING:
            continue  # get_rows on the CPU: a row per token
        n_el = 1
        for d in t.ne:
            n_el *= d
        rows: float = 1 if t.role is Role.OUTPUT else n_tokens
        size: float = t.n_bytes
        if t.role is Role.EXPERT:
            rows, size = n_tokens * k_share, t.n_bytes * used
        dev = p.buft if p.buft in gpus else CPU
        if dev == CPU and offload:
            dev, pcie = gpus[0], pcie + size
        layer = spec.n_layer if t.layer is None else t.layer
        work.append(((layer, _STEP.get(t.role, 0)), dev, 2.0 * n_el * rows, size))
    for il in range(spec.n_layer):
        work.append(((il, 1), *_attention(plan, il, n_tokens, n_kv)))
    work.sort(key=lambda w: w[0])
    seconds = pcie / m.gpu.pcie_gbps / 1e9 if m.gpu and pcie else 0.0
    rates = {dev: _rates(m, dev, threads) for dev in {CPU, *gpus}}
    for _, dev, flops, size in work:
        f, b = rates[dev]
        seconds += max(flops / f, size / b)
    path = [CPU] + [w[1] for w in work]  # the token embedding is looked up on the CPU
    hand_offs = sum(a != b for a, b in itertools.pairwise(path))
    cpu_ops = sum(w[1] == CPU for w in work)
    if m.gpu is not None:
        seconds += (hand_offs * m.gpu.split_sync_us + (len(work) - cpu_ops) * m.gpu.launch_us) * 1e-6
    return seconds + cpu_ops * m.cpu.sync_us * threads * 1e-6


def _attention(plan: MemoryPlan, il: int, n_tokens: int, n_kv: float) -> tuple[str, float, float]:
    """(device, flops, bytes) of layer il's attention over its KV cache."""
    spec, config, ctx = plan.model, plan.config, plan.context
    dev = CPU if config.no_kv_offload else plan.layer_devices[il]
    cells = min(n_kv, spec.n_swa) if spec.swa_layers[il] and spec.n_swa else n_kv
    k_el, v_el = spec.n_embd_k_gqa(il), 0 if spec.is_mla else spec.n_embd_v_gqa(il)
    cell_bytes = row_bytes(config.cache_type_k, k_el) + (row_bytes(config.cache_type_v, v_el) if v_el else 0)
    heads = spec.n_head[il]
    flops = 2.0 * n_tokens * cells * heads * (spec.head_dim_k + spec.head_dim_v)
    quantized = sum(el for el, t in ((k_el, config.cache_type_k), (v_el, config.cache_type_v))
                    if KV_CACHE_TYPES[t][0] > 1)
    flops += DEQUANT_FLOPS * cells * quantized
    size = cells * cell_bytes + n_tokens * cell_bytes  # read the cache, write the new cells
    if not ctx.flash_attn:
        size += FA_OFF_PASSES * 4.0 * heads * n_tokens * cells
    return dev, flops, size


def decode_seconds(m: Machine, plan: MemoryPlan, bench: BenchSpec) -> float:
    """-n tokens generated one at a time after -d tokens of context."""
    return bench.n_gen * ubatch_seconds(m, plan, 1, bench.n_depth + bench.n_gen / 2, bench.threads)


def prefill_seconds(m: Machine, plan: MemoryPlan, n_prompt: int, depth: int, threads: int) -> float:
    """n_prompt tokens after depth tokens, in batches of -b split into ubatches of -ub (llama_decode)."""
    ctx = plan.context
    seconds, done = 0.0, 0
    while done < n_prompt:
        batch = min(n_prompt - done, ctx.n_batch)
        for start in range(0, batch, ctx.n_ubatch):
            n = min(ctx.n_ubatch, batch - start)
            seconds += ubatch_seconds(m, plan, n, depth + done + start + n / 2, threads)
        done += batch
    return seconds


def speeds(m: Machine, plan: MemoryPlan, bench: BenchSpec) -> tuple[float, float]:
    """Noise-free (prefill, decode) tokens per second."""
    tb = bench.threads_batch or bench.threads
    pp = bench.n_prompt / prefill_seconds(m, plan, bench.n_prompt, bench.n_depth, tb) if bench.n_prompt else 0.0
    tg = bench.n_gen / decode_seconds(m, plan, bench) if bench.n_gen else 0.0
    return pp, tg


def out_of_memory(m: Machine, plan: MemoryPlan) -> tuple[OomInfo, str, int, list[Buffer]] | None:
    """The first buffer, in llama.cpp's order of allocation, that a GPU (free memory less the CUDA context) or the
    RAM cannot hold: (what failed, its device, that device's capacity, the buffers allocated before); None: fits."""
    caps = {CPU: round(m.ram.gib * GIB)}
    for d in plan.devices:
        caps[d.name] = (d.free_bytes or 0) - _context_bytes(m)
    used = dict.fromkeys(caps, 0)
    done: list[Buffer] = []
    for kind in KINDS:
        for b in plan.buffers:
            if b.kind != kind:
                continue
            if used[b.device] + b.bytes > caps[b.device]:
                return OomInfo(kind, b.buft, b.bytes), b.device, caps[b.device], done
            used[b.device] += b.bytes
            done.append(b)
    return None


def _context_bytes(m: Machine) -> int:
    return round(m.gpu.context_mib * MIB) if m.gpu else 0


# ----------------------------------------------------------------------------------------------------------------
# The runner


def _noise_factors(seed: int, key: str, n: int, noise: float) -> list[float]:
    out = []
    for rep in range(n):
        digest = hashlib.sha256(f"{seed}|{key}|{rep}".encode()).digest()
        out.append(max(0.2, 1.0 + noise * random.Random(digest).gauss(0.0, 1.0)))
    return out


class SimRunner:
    """A `TrialRunner` on a simulated machine: the estimator's plan for memory, the module's model for speed."""

    backend = "sim"
    emulated = False

    def __init__(self, machine: Machine, spec: ModelSpec, seed: int | None = None) -> None:
        self.machine = machine
        self.spec = spec
        self.seed = machine.seed if seed is None else seed
        self.trials_run = 0
        self.model_loads = 0
        self._loaded: tuple[Any, ...] | None = None

    def devices(self) -> tuple[Device, ...]:
        g = self.machine.gpu
        if g is None:
            return ()
        total = round(g.memory_gib * GIB)
        return tuple(Device(f"CUDA{i}", CUDA, total, total - round(g.reserved_gib * GIB)) for i in range(g.count))

    def cpu_profile(self) -> CpuProfile:
        return CPU_PROFILES[self.machine.cpu.isa]

    def build(self) -> dict[str, str]:
        return {"commit": f"sim-{self.machine.name}",
                "source": f"fitter.sim model of {self.machine.path or self.machine.name}"}

    def plan(self, config: LaunchConfig) -> MemoryPlan:
        try:
            return estimate(self.spec, config, self.devices(), self.cpu_profile())
        except FitterError as e:
            raise WorkerError(f"llama.cpp rejected {' '.join(config.flags) or 'the config'}: {e}") from e

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None) -> TrialResult:
        m, plan = self.machine, self.plan(config)
        self.trials_run += 1
        key = (model, *(getattr(config, k) for k in MODEL_LEVEL))
        reused = key == self._loaded
        self.model_loads += 0 if reused else 1
        on_gpu = sum(b.bytes for b in plan.buffers if b.kind == "model" and b.device != CPU)
        load_s = 0.0 if reused else sum(self.spec.shard_sizes) / (m.disk_gbps * 1e9) + (
            on_gpu / (m.gpu.pcie_gbps * 1e9) if m.gpu else 0.0)
        base = Measurement("ok", "", spec=spec, flags=config.flags, load_s=round(load_s, 3), wall_s=round(load_s, 3),
                           reused_model=reused, llama_cpp=self.build())
        failed = out_of_memory(m, plan)
        if failed is not None:
            self._loaded = None if failed[0].stage == "model" else key  # a failed context leaves the model loaded
            return TrialResult(self._oom(base, *failed))
        need = spec.n_depth + max(spec.n_prompt, spec.n_gen)
        if need > plan.context.n_ctx_seq:
            raise WorkerError(f"the test needs {need} cells (depth {spec.n_depth} + max(-p, -n)) but a sequence of "
                              f"this context holds {plan.context.n_ctx_seq}")
        self._loaded = key
        result = self._measure(plan, spec, base)
        if timeout is not None and result.wall_s > timeout:
            self._loaded = None
            why = f"killed after {timeout:g} s (the limit): the simulated trial takes {result.wall_s:.1f} s"
            result = replace(result, outcome="timeout", reason=why, pp=None, tg=None)
        peak = {d.name: {"bytes": plan.totals()[d.name].total + _context_bytes(m), "source": "sim"}
                for d in plan.devices}
        return TrialResult(result, peak)

    def _oom(self, base: Measurement, oom: OomInfo, device: str, cap: int, allocated: list[Buffer]) -> Measurement:
        held = sum(b.bytes for b in allocated if b.device == device)
        context = _context_bytes(self.machine)
        where = "of RAM" if device == CPU else f"free on {device} less {context / MIB:.0f} MiB of CUDA context"
        reason = (f"out of memory allocating the {oom.stage} buffer: {oom.buft} refused {oom.requested_bytes} "
                  f"bytes ({(oom.requested_bytes or 0) / MIB:.2f} MiB) with {held / MIB:.2f} MiB held, of the "
                  f"{cap / MIB:.2f} MiB {where} (sim machine {self.machine.name})")
        logged = tuple(LoggedBuffer(b.buft, b.kind, b.bytes / MIB) for b in allocated)
        return replace(base, outcome="oom", reason=reason, oom=oom, buffers=logged)

    def _measure(self, plan: MemoryPlan, spec: BenchSpec, base: Measurement) -> Measurement:
        """pp and tg samples, one per repetition, and the trial's simulated wall time."""
        m, tb = self.machine, spec.threads_batch or spec.threads
        pp_s = prefill_seconds(m, plan, spec.n_prompt, spec.n_depth, tb)
        tg_s = decode_seconds(m, plan, spec)
        config_key = repr(replace(plan.config, flags=()))  # the config, however its flags were spelled

        def stats(test: str, n: int, seconds: float) -> SpeedStats | None:
            if not n:
                return None
            key = f"{config_key}|t{spec.threads}|tb{tb}|{test}"
            factors = _noise_factors(self.seed, key, spec.repetitions, m.noise)
            return SpeedStats.from_ns(n, spec.n_depth, [round(seconds * f * 1e9) for f in factors])

        pp, tg = stats("pp", spec.n_prompt, pp_s), stats("tg", spec.n_gen, tg_s)
        wall = base.wall_s + (pp_s + tg_s / max(spec.n_gen, 1) if spec.warmup else 0.0)
        depth_s = prefill_seconds(m, plan, spec.n_depth, 0, tb)  # each repetition refills the context first
        for s in (pp, tg):
            if s is not None:
                wall += sum(s.samples_ns) / 1e9 + spec.repetitions * depth_s
        return replace(base, pp=pp, tg=tg, wall_s=round(wall, 3), peak_rss=plan.totals()[CPU].total,
                       buffers=tuple(LoggedBuffer(b.buft, b.kind, b.bytes / MIB) for b in plan.buffers))
