"""This machine's CPU and RAM as llama.cpp's threads see them: physical cores, SMT siblings, hybrid P/E cores,
NUMA nodes, the ISA flags llama.cpp's kernels care about, the governor; RAM and swap.

Pure parsers (text in, values out) come first; `read_cpu_snapshot` and `detect_ram` are the I/O edge (/proc, /sys,
psutil). Nothing here prints.
"""

from __future__ import annotations

import itertools
import os
import platform
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fitter.memory.backends.devices import CpuProfile, cpu_profile_for

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


def cpu_profile_here(root: Path = Path("/")) -> CpuProfile:
    """MachineSnapshot.cpu_profile from /proc/cpuinfo alone (the ISA flags of `build_cpu_info(read_cpu_snapshot())`):
    all `fitter estimate` needs of this machine when it is given the devices."""
    isa = relevant_isa(platform.machine() or "unknown", cpu_flags(_read(root / "proc/cpuinfo") or ""))
    return cpu_profile_for({name for name, present in isa if present})


def detect_ram() -> RamInfo:
    import psutil

    vm, swap = psutil.virtual_memory(), psutil.swap_memory()
    return RamInfo(int(vm.total), int(vm.available), int(swap.total), int(swap.free))
