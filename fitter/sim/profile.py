"""Simulated machines' profiles: physical parameters only (GPU memory, bandwidth, TFLOPS, PCIe, peer links, CUDA
context; P/E cores, SMT, per-core rates; RAM channels and speed; noise and seed), read strictly from
`fitter/sim/machines/*.toml` or any TOML file of the same keys. Nothing in a profile refers to a flag or a
configuration. GPUs: one `[gpu]` table (with `count` identical ones), or `[[gpu]]` tables, one per kind of GPU in the
machine in CUDA's order (CUDA0 first), each with its own memory, speed and links.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitter.errors import FitterError
from fitter.memory.backends.devices import CPU_AVX2, CPU_AVX512, CPU_NO_REPACK

MACHINES_DIR = Path(__file__).parent / "machines"
CPU_PROFILES = {"avx2": CPU_AVX2, "avx512": CPU_AVX512, "none": CPU_NO_REPACK}


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
    pcie_pinned_gbps: float = _num(0, "achieved host-to-GPU copy bandwidth from page-locked host memory (CUDA_Host), "
                                   "GB/s: the link's own rate, no staging copy (0: as from mapped memory)", 0.0)
    count: int = _num(1, "GPUs (identical)", 1)
    reserved_gib: float = _num(0, "memory the desktop and driver hold before llama.cpp starts", 0.0)
    context_mib: float = _num(0, "CUDA context, cuBLAS workspace and pools: memory beyond llama.cpp's buffers", 400.0)
    launch_us: float = _num(0, "per op: kernel launch and graph overhead", 5.0)
    split_sync_us: float = _num(0, "per CPU↔GPU hand-off: stream sync, activation copy, waking the CPU threads", 80.0)
    fa_efficiency: float = _num(0, "the flash-attention kernel's rate relative to the unfused attention path's "
                                "(< 1: FA is slower on this GPU)", 1.0, lo_open=True)
    name: str = field(default="", metadata={"doc": "what the GPU stands for (e.g. RTX 3060)"})
    peer_gbps: float = _num(0, "achieved copy bandwidth to another GPU, GB/s (0: no peer access, copies go through "
                            "host memory at the slower of the two PCIe links)", 0.0)
    peer_latency_us: float = _num(0, "per copy to another GPU over the peer link: the copy's start and the event the "
                                  "receiving stream waits on, μs (-sm tensor's all-reduce steps)", 10.0)
    host_copy_latency_us: float = _num(0, "per copy to another GPU without peer access, staged through host memory "
                                       "(GPU to host, then host to GPU), μs (-sm tensor's all-reduce steps)", 30.0)


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
    static_split: float = _num(0, "share of each op's work split into one equal chunk per thread, so that it ends "
                               "when the slowest thread does (0: threads share the work by speed)", 0.0, hi=1)
    busy_cores: int = _num(0, "cores another job keeps busy (P-cores first): llama.cpp's threads get the rest", 0)
    barrier_wait_us: float = _num(0, "per op, when threads outnumber the free hardware threads: the wait at the "
                                  "spin barrier for a thread the OS has descheduled", 0.0)
    fa_efficiency: float = _num(0, "the flash-attention kernel's rate relative to the unfused attention path's "
                                "(< 1: FA is slower on this CPU)", 1.0, lo_open=True)


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
    gpus: tuple[Gpu, ...] = ()  # in CUDA's order, one entry per GPU (a table's `count` expanded); none: CPU only
    description: str = field(default="", metadata={"doc": "what the machine stands for"})
    models: tuple[str, ...] = field(default=(), metadata={"doc": "fitter.gguf.demo_models SHAPES it is meant for"})
    disk_gbps: float = _num(0, "model file read rate, GB/s (load time only)", 3.0, lo_open=True)
    noise: float = _num(0, "relative standard deviation of one repetition's time", 0.0, hi=0.5)
    run_noise: float = _num(0, "relative standard deviation between runs of one config (other jobs, throttling): one "
                                "factor on every repetition of a run", 0.0, hi=0.5)
    seed: int = _num(0, "seed of the noise", 0)
    routing_spread_first: float = _num(0, "the model's routing in its first expert layer: the share of a ubatch's "
                                       "tokens beyond the first that draw experts of their own (1: every token "
                                       "draws independently; lower: tokens share experts, so a prompt reads fewer)",
                                       1.0, hi=1)
    routing_spread_last: float = _num(0, "the same in its last expert layer (linear between the two)", 1.0, hi=1)
    pace: float = _num(0, "real seconds each simulated second of a run takes (0: at once; 1: as long as on the "
                       "machine), to watch a tune run or to interrupt one", 0.0)
    path: str = ""

    @property
    def gpu(self) -> Gpu | None:
        """The first GPU (CUDA0): the one op offload runs the CPU's weights on; None on a CPU-only machine."""
        return self.gpus[0] if self.gpus else None

    def gpu_of(self, device: str) -> Gpu:
        """The GPU a llama.cpp device name (CUDA<i>) stands for."""
        return self.gpus[int(device.removeprefix("CUDA"))]

    def peer_gbps(self, a: str, b: str) -> float:
        """GB/s of an activation copy from device a to device b: their peer link, else through host memory."""
        ga, gb = self.gpu_of(a), self.gpu_of(b)
        if ga.peer_gbps and gb.peer_gbps:
            return min(ga.peer_gbps, gb.peer_gbps)
        return min(ga.pcie_gbps, gb.pcie_gbps)

    def copy_seconds(self, a: str, b: str, n_bytes: float) -> float:
        """One copy of n_bytes from GPU a to GPU b as -sm tensor's all-reduce makes it (ggml_backend_tensor_copy_async
        between two devices): over their peer link when both have one, else staged through host memory, over both
        PCIe links one after the other."""
        ga, gb = self.gpu_of(a), self.gpu_of(b)
        if ga.peer_gbps and gb.peer_gbps:
            latency = max(ga.peer_latency_us, gb.peer_latency_us) * 1e-6
            return latency + n_bytes / (min(ga.peer_gbps, gb.peer_gbps) * 1e9)
        latency = max(ga.host_copy_latency_us, gb.host_copy_latency_us) * 1e-6
        return latency + n_bytes / (ga.pcie_gbps * 1e9) + n_bytes / (gb.pcie_gbps * 1e9)

    @property
    def cpu_threads(self) -> int:
        return self.cpu.p_cores * self.cpu.smt + self.cpu.e_cores


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
        if key == "gpu" and isinstance(data.get(key), list):
            continue  # [[gpu]]: read below
        if key in data:
            if not isinstance(data[key], dict):
                raise FitterError(f"{path}: {key} = {data[key]!r}: must be a table [{key}] or tables [[{key}]]")
            tables[key] = cls(**_values(path, key, cls, data[key]))
    cpu = tables["cpu"]
    if cpu.busy_cores >= cpu.p_cores + cpu.e_cores:
        raise FitterError(f"{path}: cpu.busy_cores = {cpu.busy_cores}: must be below the {cpu.p_cores + cpu.e_cores} "
                          "cores (P + E), or llama.cpp's threads get none")
    kinds = _gpu_tables(path, data.get("gpu"), tables.pop("gpu", None))
    gpus = tuple(g for g in kinds for _ in range(g.count))
    return Machine(name=path.stem, path=str(path), gpus=gpus, **top, **tables)


def _gpu_tables(path: Path, raw: Any, table: Gpu | None) -> tuple[Gpu, ...]:
    """The machine's kinds of GPU: one [gpu] table, or [[gpu]] tables in CUDA's order."""
    if table is not None:
        return (table,)
    if raw is None:
        return ()
    if not raw or not all(isinstance(t, dict) for t in raw):
        raise FitterError(f"{path}: gpu = {raw!r}: must be a table [gpu] or tables [[gpu]]")
    return tuple(Gpu(**_values(path, f"gpu #{i + 1}", Gpu, t)) for i, t in enumerate(raw))


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


def _runs(gpus: tuple[Gpu, ...]) -> list[tuple[Gpu, int]]:
    """Consecutive identical GPUs as (GPU, how many)."""
    out: list[tuple[Gpu, int]] = []
    for g in gpus:
        if out and out[-1][0] == g:
            out[-1] = (g, out[-1][1] + 1)
        else:
            out.append((g, 1))
    return out


def machines_table() -> str:
    """The shipped profiles, one line each (`fitter machines`)."""
    rows = [("machine", "GPU", "CPU", "RAM", "for")]
    for name in shipped_machines():
        m = load_machine(name)
        gpu = " + ".join(f"{n}× {g.memory_gib:g} GiB {g.bandwidth_gbps:g} GB/s {g.tflops:g} TFLOPS, PCIe "
                         f"{g.pcie_gbps:g} GB/s" for g, n in _runs(m.gpus)) or "none"
        c = m.cpu
        cpu = f"{c.p_cores}P" + (f"+{c.e_cores}E" if c.e_cores else "") + f" cores, {m.cpu_threads} threads"
        ram = f"{m.ram.gib:g} GiB {m.ram.channels}×{m.ram.mts:g} MT/s ({m.ram.gbps:.0f} GB/s)"
        rows.append((name, gpu, cpu, ram, ", ".join(m.models)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, [*widths, 0], strict=True)).rstrip() for r in rows]
    return "\n".join(lines)
