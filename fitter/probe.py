"""What this machine offers llama.cpp: NVIDIA GPUs (NVML), the CPU and its topology, RAM, and the llama.cpp build.

Pure parsers (text in, values out) come first; the I/O edge that reads /proc, /sys, NVML, psutil and
llama-cpp-python comes last (`probe()`, `detect_*`, `read_cpu_snapshot`). Nothing here prints.

`fitter probe --json` prints `probe_json(probe())`, this shape (bytes are integers, null = could not be read):

    {"gpus": [{"index": int, "name": str, "uuid": str | null, "pci_bus_id": str | null,
               "memory": {"total": B, "free": B, "used": B} | null,
               "compute_capability": [major, minor] | null, "bf16": bool | null,
               "pcie": {"current": {"gen": int | null, "width": int | null},
                        "max": {"gen": int | null, "width": int | null}},
               "memory_max_clock_mhz": int | null, "memory_bus_width_bits": int | null,
               "memory_bandwidth_gbs": float | null}],
     "nvidia": {"driver": str | null, "cuda_driver": str | null, "error": str | null},
     "cpu": {"arch": str, "model": str, "physical_cores": int, "logical_cpus": int, "usable_cpus": int,
             "smt": bool, "hybrid": bool, "hybrid_source": "cpu_core/cpu_atom" | "cpuinfo_max_freq" | null,
             "performance_cores": int, "efficiency_cores": int,
             "cores": [{"cpus": [int], "max_freq_khz": int | null, "kind": "performance" | "efficiency"}],
             "numa_nodes": [{"node": int, "cpus": [int], "memory": B | null}],
             "isa": {flag: bool}, "governor": str | null, "recommended_threads": int},
     "ram": {"total": B, "available": B, "swap_total": B, "swap_free": B},
     "llama_cpp": {"installed": bool, "version": str | null, "supports_gpu_offload": bool | null,
                   "supports_rpc": bool | null, "gpu_backend": bool | null,
                   "backends": [{"name": str, "devices": int}] | null,
                   "devices": [{"name": str, "description": str, "type": "cpu" | "gpu" | "igpu" | "accel" | "meta"}]
                              | null,
                   "system_info": str | null, "error": str | null}}

Notes:
- `cores` has one entry per physical core (an SMT sibling group from thread_siblings_list); `usable_cpus` counts the
  CPUs this process may run on (sched_getaffinity: containers and taskset narrow it).
- `isa` keys are /proc/cpuinfo's spellings (x86: avx512_bf16, amx_tile/amx_int8/amx_bf16; ARM: asimddp = dotprod).
- `nvidia.error` starts with "no NVIDIA driver found: " when NVML cannot be loaded; the other sections still fill.
- `llama_cpp.supports_gpu_offload` is llama.cpp's own answer, which is also true for a CPU build with the RPC backend
  (src/llama.cpp `llama_supports_gpu_offload`); `gpu_backend` says whether ggml has a GPU device.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import platform
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitter.errors import FitterError

REINSTALL_GPU_BUILD = (
    'CMAKE_ARGS="-DGGML_CUDA=on -DGGML_RPC=ON" pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36'
)
NO_DRIVER = "no NVIDIA driver found"
BF16_MIN_CC = (8, 0)  # Ampere and newer have BF16 tensor cores
# Two core classes differ when their max frequencies are at least this far apart (1 - low/high). Preferred-core
# boosts on one die (AMD CPPC, Intel Turbo Boost Max 3.0) stay within ~5 %; P/E and big.LITTLE differ by 20-40 %.
HYBRID_FREQ_GAP = 0.15

X86_ISA = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
           "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
ARM_ISA = ("asimd", "asimdhp", "asimddp", "i8mm", "bf16", "sve", "sve2")

# MIDR part numbers of ARM Ltd (implementer 0x41) cores, as util-linux's lscpu names them.
ARM_PARTS = {
    0xD03: "Cortex-A53", 0xD04: "Cortex-A35", 0xD05: "Cortex-A55", 0xD07: "Cortex-A57", 0xD08: "Cortex-A72",
    0xD09: "Cortex-A73", 0xD0A: "Cortex-A75", 0xD0B: "Cortex-A76", 0xD0C: "Neoverse-N1", 0xD0D: "Cortex-A77",
    0xD40: "Neoverse-V1", 0xD41: "Cortex-A78", 0xD44: "Cortex-X1", 0xD46: "Cortex-A510", 0xD47: "Cortex-A710",
    0xD48: "Cortex-X2", 0xD49: "Neoverse-N2", 0xD4D: "Cortex-A715", 0xD4E: "Cortex-X3", 0xD4F: "Neoverse-V2",
    0xD80: "Cortex-A520", 0xD81: "Cortex-A720", 0xD82: "Cortex-X4", 0xD84: "Neoverse-V3", 0xD85: "Cortex-X925",
    0xD87: "Cortex-A725", 0xD8E: "Neoverse-N3",
}
GGML_DEVICE_TYPES = ("cpu", "gpu", "igpu", "accel", "meta")  # ggml-backend.h enum ggml_backend_dev_type
NON_GPU_BACKENDS = frozenset({"CPU", "RPC", "BLAS"})


# ---------------------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class PcieLink:
    gen: int | None
    width: int | None


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str | None = None
    pci_bus_id: str | None = None
    memory_total: int | None = None
    memory_free: int | None = None
    memory_used: int | None = None
    compute_capability: tuple[int, int] | None = None
    pcie_current: PcieLink = PcieLink(None, None)
    pcie_max: PcieLink = PcieLink(None, None)
    memory_max_clock_mhz: int | None = None
    memory_bus_width_bits: int | None = None

    @property
    def bf16(self) -> bool | None:
        return None if self.compute_capability is None else self.compute_capability >= BF16_MIN_CC

    @property
    def memory_bandwidth_gbs(self) -> float | None:
        if not self.memory_max_clock_mhz or not self.memory_bus_width_bits:
            return None
        return memory_bandwidth_gbs(self.memory_max_clock_mhz, self.memory_bus_width_bits)


@dataclass(frozen=True)
class NvidiaInfo:
    driver: str | None
    cuda_driver: str | None
    error: str | None


@dataclass(frozen=True)
class Core:
    """One physical core: its logical CPUs (SMT siblings), max frequency and class."""

    cpus: tuple[int, ...]
    max_freq_khz: int | None
    kind: str = "performance"  # "performance" | "efficiency"


@dataclass(frozen=True)
class NumaNode:
    node: int
    cpus: tuple[int, ...]
    memory: int | None


@dataclass(frozen=True)
class CpuInfo:
    arch: str
    model: str
    physical_cores: int
    logical_cpus: int
    usable_cpus: tuple[int, ...]
    cores: tuple[Core, ...]  # empty when sysfs has no topology
    hybrid_source: str | None
    numa_nodes: tuple[NumaNode, ...]
    isa: tuple[tuple[str, bool], ...]
    governor: str | None

    @property
    def smt(self) -> bool:
        return any(len(c.cpus) > 1 for c in self.cores)

    @property
    def performance_cores(self) -> int:
        if not self.cores:
            return self.physical_cores
        return sum(c.kind == "performance" for c in self.cores)

    @property
    def efficiency_cores(self) -> int:
        return sum(c.kind == "efficiency" for c in self.cores)

    @property
    def recommended_threads(self) -> int:
        return recommend_threads(self.cores, self.usable_cpus, self.physical_cores)


@dataclass(frozen=True)
class RamInfo:
    total: int
    available: int
    swap_total: int
    swap_free: int


@dataclass(frozen=True)
class BackendDevice:
    name: str
    description: str
    type: str  # GGML_DEVICE_TYPES


@dataclass(frozen=True)
class BackendReg:
    name: str
    devices: int


@dataclass(frozen=True)
class LlamaCppInfo:
    installed: bool
    version: str | None = None
    supports_gpu_offload: bool | None = None
    supports_rpc: bool | None = None
    system_info: str | None = None
    backends: tuple[BackendReg, ...] | None = None  # None: ggml's registry could not be read
    devices: tuple[BackendDevice, ...] | None = None
    error: str | None = None

    @property
    def gpu_backend(self) -> bool | None:
        """Whether ggml has a GPU device; None when its devices could not be listed and llama.cpp's answer is yes."""
        if self.devices is not None:
            return any(d.type in ("gpu", "igpu") for d in self.devices)
        return False if not self.installed or self.supports_gpu_offload is False else None


@dataclass(frozen=True)
class Probe:
    gpus: tuple[GpuInfo, ...]
    nvidia: NvidiaInfo
    cpu: CpuInfo
    ram: RamInfo
    llama_cpp: LlamaCppInfo


@dataclass(frozen=True)
class CpuSnapshot:
    """The raw text `build_cpu_info` needs, as read from /proc and /sys (keys: CPU or node numbers)."""

    arch: str
    cpuinfo: str
    siblings: Mapping[int, str] = field(default_factory=dict)  # cpuN/topology/thread_siblings_list
    max_freq_khz: Mapping[int, str] = field(default_factory=dict)  # cpuN/cpufreq/cpuinfo_max_freq
    governors: Mapping[int, str] = field(default_factory=dict)  # cpuN/cpufreq/scaling_governor
    core_cpus: str | None = None  # /sys/devices/cpu_core/cpus (Intel hybrid P-cores)
    atom_cpus: str | None = None  # /sys/devices/cpu_atom/cpus (Intel hybrid E-cores)
    nodes: Mapping[int, tuple[str, str | None]] = field(default_factory=dict)  # nodeN: (cpulist, meminfo)
    logical_cpus: int | None = None  # psutil.cpu_count()
    physical_cores: int | None = None  # psutil.cpu_count(logical=False)
    usable_cpus: tuple[int, ...] | None = None  # os.sched_getaffinity(0)


# ---------------------------------------------------------------------------------------------------------------
# Pure parsing and arithmetic


def memory_bandwidth_gbs(max_mem_clock_mhz: int, bus_width_bits: int) -> float:
    """Peak memory bandwidth in GB/s (10^9 bytes) from NVML's max memory clock and bus width.

    GB/s = clock_MHz × 2 × bus_width_bits / 8 / 1000. NVML reports the memory clock such that ×2 (double data
    rate) gives the per-pin data rate for both memory families: GDDR6/6X/7 cards report half the marketed Gbps
    (GTX 1650 GDDR6: 6001 MHz × 2 × 128 / 8 = 192 GB/s; RTX 4090: 10501 MHz, 384-bit → 1008 GB/s) and HBM reports
    its real clock (A100 40 GB: 1215 MHz, 5120-bit → 1555 GB/s; B200: 3996 MHz, 7680-bit → 7672 GB/s). A peak:
    streaming kernels reach roughly 80-90 % of it.
    """
    return round(max_mem_clock_mhz * 2 * bus_width_bits / 8 / 1000, 1)


def cuda_version(value: int | None) -> str | None:
    """NVML's CUDA driver version integer (12040) as "12.4"."""
    if not value:
        return None
    return f"{value // 1000}.{value % 1000 // 10}"


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """A kernel cpulist ("0-3,8,10-11") as sorted CPU numbers; "" → ()."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a cpulist: {text!r}")
        cpus.update(range(int(lo), int(hi) + 1) if sep else (int(lo),))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The inverse of parse_cpu_list: (0, 1, 2, 3, 8) → "0-3,8"."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    blocks: list[dict[str, str]] = [{}]
    for line in text.splitlines():
        if not line.strip():
            if blocks[-1]:
                blocks.append({})
            continue
        key, sep, value = line.partition(":")
        if sep:
            blocks[-1][key.strip().lower()] = value.strip()
    return [b for b in blocks if b]


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The ISA flags every processor in /proc/cpuinfo has (x86 `flags`, ARM `Features`)."""
    sets = [frozenset((b.get("flags") or b.get("features") or "").split()) for b in _cpuinfo_blocks(cpuinfo)]
    sets = [s for s in sets if s]
    return frozenset.intersection(*sets) if sets else frozenset()


def cpu_model(cpuinfo: str, arch: str) -> str:
    """The CPU's name: x86 `model name`; ARM cores by MIDR part ("4× Cortex-A55 + 4× Cortex-A76"); else arch."""
    blocks = _cpuinfo_blocks(cpuinfo)
    for b in blocks:
        name = b.get("model name", "")
        if name and not name.startswith("ARMv"):  # 32-bit ARM kernels print "ARMv7 Processor rev 3 (v7l)"
            return " ".join(name.split())
    parts: dict[str, int] = {}
    for b in blocks:
        if "cpu part" in b:
            implementer, part = int(b.get("cpu implementer", "0"), 16), int(b["cpu part"], 16)
            known = ARM_PARTS.get(part) if implementer == 0x41 else None
            key = known or f"implementer {implementer:#x} part {part:#x}"
            parts[key] = parts.get(key, 0) + 1
    if parts:
        return " + ".join(f"{n}× {name}" for name, n in parts.items()) if len(parts) > 1 else next(iter(parts))
    for b in blocks:
        for key in ("hardware", "model", "model name"):
            if b.get(key):
                return b[key]
    return arch


def relevant_isa(arch: str, flags: frozenset[str]) -> tuple[tuple[str, bool], ...]:
    """The flags llama.cpp's CPU kernels care about, present or not, for this architecture."""
    names = ARM_ISA if arch.startswith(("aarch64", "arm")) else X86_ISA
    return tuple((n, n in flags) for n in names)


def group_cores(siblings: Mapping[int, str], max_freq_khz: Mapping[int, int]) -> tuple[Core, ...]:
    """Physical cores from each online CPU's thread_siblings_list, with the highest max frequency of their CPUs."""
    online = set(siblings)
    groups: set[tuple[int, ...]] = set()
    for cpu, text in siblings.items():
        groups.add(tuple(sorted((set(parse_cpu_list(text)) & online) | {cpu})))
    cores = []
    for cpus in sorted(groups):
        freqs = [max_freq_khz[c] for c in cpus if c in max_freq_khz]
        cores.append(Core(cpus, max(freqs) if freqs else None))
    return tuple(cores)


def frequency_split(freqs: Iterable[int], gap: float = HYBRID_FREQ_GAP) -> int | None:
    """The lowest performance-core frequency when max frequencies fall into a fast and a slow class, else None.

    The split is at the widest relative gap between distinct frequencies, when it is at least `gap`: a Snapdragon's
    3.2/2.8/2.0 GHz clusters split into 3.2+2.8 (performance) and 2.0; one die's preferred-core boosts do not split.
    """
    distinct = sorted(set(freqs), reverse=True)
    best, at = 0.0, None
    for hi, lo in itertools.pairwise(distinct):
        drop = 1 - lo / hi
        if drop > best:
            best, at = drop, hi
    return at if best >= gap else None


def classify_cores(
    cores: tuple[Core, ...], core_cpus: str | None, atom_cpus: str | None
) -> tuple[tuple[Core, ...], str | None]:
    """Mark efficiency cores: Intel's cpu_core/cpu_atom PMU lists when present, else by max-frequency class."""
    atom = set(parse_cpu_list(atom_cpus)) if atom_cpus else set()
    if atom:
        return tuple(Core(c.cpus, c.max_freq_khz, "efficiency" if atom & set(c.cpus) else "performance")
                     for c in cores), "cpu_core/cpu_atom"
    freqs = [c.max_freq_khz for c in cores]
    if not cores or any(f is None for f in freqs):
        return cores, None
    split = frequency_split(f for f in freqs if f is not None)
    if split is None:
        return cores, None
    return tuple(Core(c.cpus, c.max_freq_khz, "performance" if (c.max_freq_khz or 0) >= split else "efficiency")
                 for c in cores), "cpuinfo_max_freq"


def recommend_threads(cores: tuple[Core, ...], usable: tuple[int, ...], physical: int) -> int:
    """llama.cpp's advice: one thread per physical performance core (`-t` on P-cores), among the usable CPUs."""
    if not cores:
        return max(1, min(physical, len(usable)) if usable else physical)
    ok = set(usable) if usable else {c for core in cores for c in core.cpus}
    usable_cores = [c for c in cores if ok & set(c.cpus)]
    perf = [c for c in usable_cores if c.kind == "performance"]
    return max(1, len(perf) or len(usable_cores))


def node_memory(meminfo: str) -> int | None:
    """Bytes from a NUMA node's meminfo ("Node 0 MemTotal:  24683652 kB")."""
    m = re.search(r"MemTotal:\s*(\d+)\s*kB", meminfo)
    return int(m.group(1)) * 1024 if m else None


def _int(text: str | None) -> int | None:
    return int(text.strip()) if text and text.strip().isdigit() else None


def build_cpu_info(snap: CpuSnapshot) -> CpuInfo:
    """Everything `fitter probe` says about the CPU, from the raw text of one snapshot."""
    freqs = {cpu: f for cpu, text in snap.max_freq_khz.items() if (f := _int(text)) is not None}
    cores, source = classify_cores(group_cores(snap.siblings, freqs), snap.core_cpus, snap.atom_cpus)
    logical = snap.logical_cpus or len(snap.siblings) or 1
    physical = len(cores) or snap.physical_cores or logical
    nodes = tuple(NumaNode(n, parse_cpu_list(cpulist), node_memory(meminfo) if meminfo else None)
                  for n, (cpulist, meminfo) in sorted(snap.nodes.items()))
    governors = sorted({g.strip() for g in snap.governors.values() if g.strip()})
    return CpuInfo(
        arch=snap.arch,
        model=cpu_model(snap.cpuinfo, snap.arch),
        physical_cores=physical,
        logical_cpus=logical,
        usable_cpus=snap.usable_cpus if snap.usable_cpus is not None else tuple(sorted(snap.siblings)),
        cores=cores,
        hybrid_source=source,
        numa_nodes=nodes,
        isa=relevant_isa(snap.arch, cpu_flags(snap.cpuinfo)),
        governor=",".join(governors) or None,
    )


def gpu_build_problem(info: LlamaCppInfo) -> str | None:
    """Why this llama-cpp-python cannot offload to a GPU, with the reinstall line; None when it can."""
    fix = f"reinstall it with CUDA: {REINSTALL_GPU_BUILD}"
    if not info.installed:
        return f"{info.error or 'llama-cpp-python is not installed'}; {fix}"
    if info.gpu_backend or (info.gpu_backend is None and info.supports_gpu_offload):
        return None  # a GPU device, or devices unknown and llama.cpp says it can offload
    gpu_regs = [b.name for b in info.backends or () if b.name not in NON_GPU_BACKENDS]
    if gpu_regs:
        return (f"llama-cpp-python {info.version} has the {', '.join(gpu_regs)} backend but it finds no GPU: "
                "check the NVIDIA driver (nvidia-smi)")
    names = ", ".join(b.name for b in info.backends) if info.backends else "unknown"
    why = " (llama_supports_gpu_offload() is true only through the RPC backend)" if info.supports_gpu_offload else ""
    return f"llama-cpp-python {info.version} is a CPU build (backends: {names}){why}; {fix}"


# ---------------------------------------------------------------------------------------------------------------
# Output


def probe_json(p: Probe) -> dict[str, Any]:
    cpu, lc = p.cpu, p.llama_cpp
    return {
        "gpus": [_gpu_json(g) for g in p.gpus],
        "nvidia": {"driver": p.nvidia.driver, "cuda_driver": p.nvidia.cuda_driver, "error": p.nvidia.error},
        "cpu": {
            "arch": cpu.arch, "model": cpu.model, "physical_cores": cpu.physical_cores,
            "logical_cpus": cpu.logical_cpus, "usable_cpus": len(cpu.usable_cpus), "smt": cpu.smt,
            "hybrid": cpu.hybrid_source is not None, "hybrid_source": cpu.hybrid_source,
            "performance_cores": cpu.performance_cores, "efficiency_cores": cpu.efficiency_cores,
            "cores": [{"cpus": list(c.cpus), "max_freq_khz": c.max_freq_khz, "kind": c.kind} for c in cpu.cores],
            "numa_nodes": [{"node": n.node, "cpus": list(n.cpus), "memory": n.memory} for n in cpu.numa_nodes],
            "isa": dict(cpu.isa), "governor": cpu.governor, "recommended_threads": cpu.recommended_threads,
        },
        "ram": {"total": p.ram.total, "available": p.ram.available, "swap_total": p.ram.swap_total,
                "swap_free": p.ram.swap_free},
        "llama_cpp": {
            "installed": lc.installed, "version": lc.version, "supports_gpu_offload": lc.supports_gpu_offload,
            "supports_rpc": lc.supports_rpc, "gpu_backend": lc.gpu_backend,
            "backends": None if lc.backends is None else [{"name": b.name, "devices": b.devices} for b in lc.backends],
            "devices": None if lc.devices is None else
            [{"name": d.name, "description": d.description, "type": d.type} for d in lc.devices],
            "system_info": lc.system_info, "error": lc.error,
        },
    }


def _gpu_json(g: GpuInfo) -> dict[str, Any]:
    mem = None if g.memory_total is None else {"total": g.memory_total, "free": g.memory_free, "used": g.memory_used}
    return {
        "index": g.index, "name": g.name, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id, "memory": mem,
        "compute_capability": None if g.compute_capability is None else list(g.compute_capability),
        "bf16": g.bf16,
        "pcie": {"current": {"gen": g.pcie_current.gen, "width": g.pcie_current.width},
                 "max": {"gen": g.pcie_max.gen, "width": g.pcie_max.width}},
        "memory_max_clock_mhz": g.memory_max_clock_mhz, "memory_bus_width_bits": g.memory_bus_width_bits,
        "memory_bandwidth_gbs": g.memory_bandwidth_gbs,
    }


def _size(b: int | None) -> str:
    if b is None:
        return "?"
    return f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def _link(link: PcieLink) -> str:
    return f"gen{link.gen or '?'} x{link.width or '?'}"


def _gpu_line(g: GpuInfo) -> str:
    parts = [g.name, f"{_size(g.memory_total)} total, {_size(g.memory_free)} free, {_size(g.memory_used)} used"]
    if g.compute_capability:
        parts.append(f"compute {g.compute_capability[0]}.{g.compute_capability[1]} ({'BF16' if g.bf16 else 'no BF16'})")
    parts.append(f"PCIe {_link(g.pcie_current)} now, {_link(g.pcie_max)} max")
    if g.memory_bandwidth_gbs:
        parts.append(f"{g.memory_bandwidth_gbs:.0f} GB/s peak ({g.memory_max_clock_mhz} MHz × 2 × "
                     f"{g.memory_bus_width_bits}-bit)")
    return "; ".join(parts)


def _freq_summary(cpu: CpuInfo) -> str:
    if not cpu.cores or all(c.max_freq_khz is None for c in cpu.cores):
        return "unknown (no cpufreq in /sys)"
    classes: dict[tuple[str, int | None], int] = {}
    for c in cpu.cores:
        classes[(c.kind, c.max_freq_khz)] = classes.get((c.kind, c.max_freq_khz), 0) + 1
    return ", ".join(f"{n}× {f / 1e6:.2f} GHz" + (f" ({kind})" if cpu.hybrid_source else "") if f else f"{n}× ?"
                     for (kind, f), n in sorted(classes.items(), key=lambda kv: -(kv[0][1] or 0)))


def probe_table(p: Probe) -> str:
    """`fitter probe`'s readable report: one labelled line per fact."""
    cpu, lc = p.cpu, p.llama_cpp
    rows: list[tuple[str, str]] = []
    for g in p.gpus:
        rows.append((f"GPU {g.index}", _gpu_line(g)))
    if not p.gpus:
        rows.append(("GPUs", f"none: {p.nvidia.error}" if p.nvidia.error else "none (NVML sees no GPU)"))
    if p.nvidia.driver:
        cuda = f" (CUDA {p.nvidia.cuda_driver})" if p.nvidia.cuda_driver else ""
        rows.append(("NVIDIA driver", p.nvidia.driver + cuda + (f"; {p.nvidia.error}" if p.gpus and p.nvidia.error
                                                                 else "")))
    smt = f"SMT {max(len(c.cpus) for c in cpu.cores)}-way" if cpu.smt else "no SMT"
    rows += [
        ("CPU", f"{cpu.model} ({cpu.arch})"),
        ("cores", f"{cpu.physical_cores} physical, {cpu.logical_cpus} logical ({smt}), "
                  f"{len(cpu.usable_cpus)} usable by this process"),
        ("hybrid", f"{cpu.performance_cores} performance + {cpu.efficiency_cores} efficiency cores "
                   f"(from {cpu.hybrid_source})" if cpu.hybrid_source else "no"),
        ("max frequency", _freq_summary(cpu)),
        ("NUMA", "; ".join(f"node{n.node}: cpus {format_cpu_list(n.cpus)}, {_size(n.memory)}"
                           for n in cpu.numa_nodes) or "unknown"),
        ("ISA", " ".join(n for n, ok in cpu.isa if ok)
         + ("; missing: " + " ".join(n for n, ok in cpu.isa if not ok) if not all(ok for _, ok in cpu.isa) else "")),
        ("governor", cpu.governor or "unknown"),
        ("threads", f"-t {cpu.recommended_threads} (one per physical performance core)"),
        ("RAM", f"{_size(p.ram.total)} total, {_size(p.ram.available)} available; swap "
                + (f"{_size(p.ram.swap_total)} ({_size(p.ram.swap_free)} free)" if p.ram.swap_total else "none")),
    ]
    if not lc.installed:
        rows.append(("llama.cpp", lc.error or "llama-cpp-python is not installed"))
    else:
        backends = ", ".join(f"{b.name} ({b.devices} device{'s' if b.devices != 1 else ''})"
                             for b in lc.backends or ()) or "unknown"
        gpu = ("yes" if lc.gpu_backend else "unknown" if lc.gpu_backend is None
               else "no GPU backend (llama.cpp reports offload support through RPC)" if lc.supports_gpu_offload
               else "no")
        rows += [
            ("llama.cpp", f"llama-cpp-python {lc.version}; backends {backends}; GPU offload: {gpu}; "
                          f"RPC: {'yes' if lc.supports_rpc else 'no'}"),
            ("system info", lc.system_info or "?"),
        ]
        if lc.error:
            rows.append(("llama.cpp error", lc.error))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ---------------------------------------------------------------------------------------------------------------
# The I/O edge


def probe() -> Probe:
    gpus, nvidia = detect_nvidia()
    return Probe(gpus, nvidia, build_cpu_info(read_cpu_snapshot()), detect_ram(), detect_llama_cpp())


def require_gpu_build(info: LlamaCppInfo | None = None) -> LlamaCppInfo:
    """The llama-cpp-python build info, or a FitterError naming the reinstall line when it cannot use a GPU."""
    info = info if info is not None else detect_llama_cpp()
    problem = gpu_build_problem(info)
    if problem:
        raise FitterError(problem)
    return info


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def read_cpu_snapshot(root: Path = Path("/")) -> CpuSnapshot:
    """Read /proc/cpuinfo and the CPU and NUMA parts of /sys (under `root`) with psutil's counts."""
    import psutil

    cpu_dir = root / "sys/devices/system/cpu"
    online_text = _read(cpu_dir / "online")
    online = parse_cpu_list(online_text) if online_text else ()
    siblings: dict[int, str] = {}
    freqs: dict[int, str] = {}
    governors: dict[int, str] = {}
    for cpu in online:
        d = cpu_dir / f"cpu{cpu}"
        for target, rel in ((siblings, "topology/thread_siblings_list"), (freqs, "cpufreq/cpuinfo_max_freq"),
                            (governors, "cpufreq/scaling_governor")):
            if (text := _read(d / rel)) is not None:
                target[cpu] = text
    nodes: dict[int, tuple[str, str | None]] = {}
    node_dir = root / "sys/devices/system/node"
    for d in sorted(node_dir.glob("node[0-9]*")) if node_dir.is_dir() else []:
        if (cpulist := _read(d / "cpulist")) is not None:
            nodes[int(d.name[4:])] = (cpulist, _read(d / "meminfo"))
    try:
        usable: tuple[int, ...] | None = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        usable = None
    return CpuSnapshot(
        arch=platform.machine() or "unknown",
        cpuinfo=_read(root / "proc/cpuinfo") or "",
        siblings=siblings,
        max_freq_khz=freqs,
        governors=governors,
        core_cpus=_read(root / "sys/devices/cpu_core/cpus"),
        atom_cpus=_read(root / "sys/devices/cpu_atom/cpus"),
        nodes=nodes,
        logical_cpus=psutil.cpu_count(logical=True),
        physical_cores=psutil.cpu_count(logical=False),
        usable_cpus=usable,
    )


def detect_ram() -> RamInfo:
    import psutil

    vm, swap = psutil.virtual_memory(), psutil.swap_memory()
    return RamInfo(int(vm.total), int(vm.available), int(swap.total), int(swap.free))


def _text(x: Any) -> str | None:
    if x is None:
        return None
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


def _opt(fn: Callable[..., Any], *args: Any) -> Any:
    """An NVML query that a device may not support (NVMLError_NotSupported): None instead of an error."""
    try:
        return fn(*args)
    except Exception:  # pynvml raises one NVMLError subclass per return code
        return None


def detect_nvidia(nvml: Any = None) -> tuple[tuple[GpuInfo, ...], NvidiaInfo]:
    """NVIDIA GPUs and the driver through NVML (`nvml`: the pynvml module, or a stand-in for tests)."""
    if nvml is None:
        try:
            import pynvml
        except ImportError as e:
            return (), NvidiaInfo(None, None, f"{NO_DRIVER}: nvidia-ml-py (pynvml) is not installed: {e}")
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, …
        return (), NvidiaInfo(None, None, f"{NO_DRIVER}: {e}")
    gpus: list[GpuInfo] = []
    driver = cuda = None
    try:
        driver = _text(_opt(nvml.nvmlSystemGetDriverVersion))
        cuda = cuda_version(_opt(nvml.nvmlSystemGetCudaDriverVersion))
        for i in range(nvml.nvmlDeviceGetCount()):
            gpus.append(_nvml_gpu(nvml, i))
        return tuple(gpus), NvidiaInfo(driver, cuda, None)
    except Exception as e:
        return tuple(gpus), NvidiaInfo(driver, cuda, f"NVML failed: {type(e).__name__}: {e}")
    finally:
        _opt(nvml.nvmlShutdown)


def _nvml_gpu(nvml: Any, index: int) -> GpuInfo:
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    mem = _opt(nvml.nvmlDeviceGetMemoryInfo, h)
    cc = _opt(nvml.nvmlDeviceGetCudaComputeCapability, h)
    pci = _opt(nvml.nvmlDeviceGetPciInfo, h)
    return GpuInfo(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(h)) or f"GPU {index}",
        uuid=_text(_opt(nvml.nvmlDeviceGetUUID, h)),
        pci_bus_id=_text(getattr(pci, "busId", None)),
        memory_total=None if mem is None else int(mem.total),
        memory_free=None if mem is None else int(mem.free),
        memory_used=None if mem is None else int(mem.used),
        compute_capability=None if cc is None else (int(cc[0]), int(cc[1])),
        pcie_current=PcieLink(_opt(nvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                              _opt(nvml.nvmlDeviceGetCurrPcieLinkWidth, h)),
        pcie_max=PcieLink(_opt(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                          _opt(nvml.nvmlDeviceGetMaxPcieLinkWidth, h)),
        memory_max_clock_mhz=_opt(nvml.nvmlDeviceGetMaxClockInfo, h, nvml.NVML_CLOCK_MEM),
        memory_bus_width_bits=_opt(nvml.nvmlDeviceGetMemoryBusWidth, h),
    )


def detect_llama_cpp() -> LlamaCppInfo:
    """The installed llama-cpp-python: version, llama.cpp's own support queries, and ggml's backends and devices."""
    try:
        import llama_cpp
    except ImportError as e:
        if e.name == "llama_cpp":
            return LlamaCppInfo(installed=False, error="llama-cpp-python is not installed")
        return LlamaCppInfo(installed=False, error=f"llama-cpp-python failed to import: {e}")
    except Exception as e:  # its shared library failed to load (RuntimeError, OSError)
        return LlamaCppInfo(installed=False, error=f"llama-cpp-python failed to import: {type(e).__name__}: {e}")
    version = _text(getattr(llama_cpp, "__version__", None))
    try:
        offload = bool(llama_cpp.llama_supports_gpu_offload())
        rpc = bool(llama_cpp.llama_supports_rpc())
        system_info = (_text(llama_cpp.llama_print_system_info()) or "").strip().removesuffix("|").strip()
    except Exception as e:
        return LlamaCppInfo(installed=True, version=version, error=f"llama.cpp query failed: {type(e).__name__}: {e}")
    override = os.environ.get("LLAMA_CPP_LIB_PATH")  # where llama_cpp.llama_cpp loads libllama from
    lib_dir = Path(override) if override else Path(llama_cpp.__file__).parent / "lib"
    error = None
    try:
        backends, devices = _ggml_registry(lib_dir)
    except (OSError, AttributeError) as e:
        backends, devices, error = None, None, f"could not list ggml's devices in {lib_dir}: {e}"
    return LlamaCppInfo(True, version, offload, rpc, system_info, backends, devices, error)


def _ggml_registry(lib_dir: Path) -> tuple[tuple[BackendReg, ...], tuple[BackendDevice, ...]]:
    """ggml's backend registries and devices, through the copies libllama links against (the `.so.0` sonames)."""
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so.0"))
    ggml = ctypes.CDLL(str(lib_dir / "libggml.so.0"))
    vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    for lib, name, argtypes, restype in (
        (ggml, "ggml_backend_reg_count", [], sz), (ggml, "ggml_backend_reg_get", [sz], vp),
        (ggml, "ggml_backend_dev_count", [], sz), (ggml, "ggml_backend_dev_get", [sz], vp),
        (base, "ggml_backend_reg_name", [vp], cp), (base, "ggml_backend_reg_dev_count", [vp], sz),
        (base, "ggml_backend_dev_name", [vp], cp), (base, "ggml_backend_dev_description", [vp], cp),
        (base, "ggml_backend_dev_type", [vp], ctypes.c_int),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    regs = []
    for i in range(ggml.ggml_backend_reg_count()):
        reg = ggml.ggml_backend_reg_get(i)
        name = _text(base.ggml_backend_reg_name(reg)) or "?"
        regs.append(BackendReg(name, int(base.ggml_backend_reg_dev_count(reg))))
    devices = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        kind = int(base.ggml_backend_dev_type(dev))
        devices.append(BackendDevice(
            _text(base.ggml_backend_dev_name(dev)) or "?",
            _text(base.ggml_backend_dev_description(dev)) or "",
            GGML_DEVICE_TYPES[kind] if 0 <= kind < len(GGML_DEVICE_TYPES) else str(kind),
        ))
    return tuple(regs), tuple(devices)
