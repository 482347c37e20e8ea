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

from dataclasses import dataclass
from typing import Any

from fitter.machine.cpu import CpuInfo, RamInfo, format_cpu_list
from fitter.machine.llama_cpp import LlamaCppInfo, detect_llama_cpp
from fitter.machine.nvidia import GpuInfo, NvidiaInfo, PcieLink
from fitter.machine.snapshot import MachineSnapshot, take_snapshot


@dataclass(frozen=True)
class Probe:
    gpus: tuple[GpuInfo, ...]
    nvidia: NvidiaInfo
    cpu: CpuInfo
    ram: RamInfo
    llama_cpp: LlamaCppInfo


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


def probe(snapshot: MachineSnapshot | None = None) -> Probe:
    """The machine's snapshot (taken now unless given) and what the installed llama-cpp-python reports."""
    s = snapshot or take_snapshot()
    return Probe(s.gpus, s.nvidia, s.cpu, s.ram, detect_llama_cpp())
