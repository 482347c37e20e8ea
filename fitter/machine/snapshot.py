"""One snapshot of this machine per command, passed down: the CPU and its topology, RAM, the NVIDIA GPUs (free
memory now) and the driver, and the llama.cpp build llama-cpp-python provides. Taken once at the command's edge
(`take_snapshot`), so NVML is opened and /proc/cpuinfo read once; everything below reads the snapshot.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any

from fitter.machine.cpu import CpuInfo, RamInfo, build_cpu_info, detect_ram, read_cpu_snapshot
from fitter.machine.environment import with_environment
from fitter.machine.llama_cpp import llama_cpp_python_build
from fitter.machine.nvidia import GpuInfo, NvidiaInfo, detect_nvidia
from fitter.machine.overhead import overhead_for
from fitter.memory.devices import (
    CUDA,
    CpuProfile,
    Device,
    cpu_profile_for,
)


@dataclass(frozen=True)
class MachineSnapshot:
    cpu: CpuInfo
    ram: RamInfo
    gpus: tuple[GpuInfo, ...]
    nvidia: NvidiaInfo
    llama_cpp: dict[str, str] = field(default_factory=dict)  # llama-cpp-python's build: commit, source, version

    def devices(self) -> tuple[Device, ...]:
        """The NVIDIA GPUs as the estimator sees them, with their free memory when the snapshot was taken
        (llama.cpp's CUDA numbering under CUDA_DEVICE_ORDER=PCI_BUS_ID is NVML's order) and the memory each will use
        outside llama.cpp's buffers (measured here before, else the default of its class); `gpus_now()` re-reads
        the free memory."""
        fingerprint = self.record()["fingerprint"] if self.gpus else None
        return with_environment(tuple(Device(f"CUDA{g.index}", CUDA, g.memory_total, g.memory_free,
                                             overhead_for(g, fingerprint, self.nvidia.driver)) for g in self.gpus))

    @property
    def cpu_profile(self) -> CpuProfile:
        """Which weight types the CPU backend repacks (CPU_REPACK), from the CPU's ISA flags."""
        return cpu_profile_for({name for name, present in self.cpu.isa if present})

    def record(self) -> dict[str, Any]:
        """What a measurement depends on in this machine, and its fingerprint."""
        return machine_record(self.cpu, self.ram.total, [g.name for g in self.gpus], self.nvidia.driver)


def gpus_now(snapshot: MachineSnapshot | None = None) -> tuple[Device, ...]:
    """The NVIDIA GPUs with their free memory *now*: read again once a runner has started, so what its worker holds
    already (a CUDA context, cuBLAS workspaces) is not counted as free for the trials' budgets, nor again as
    overhead: each device's overhead is what is left of it beyond what fitter's processes hold on it now."""
    from fitter.machine.nvml_peak import NvmlPeakSampler

    gpus, nvidia = detect_nvidia()
    fingerprint = snapshot.record()["fingerprint"] if snapshot is not None and gpus else None
    held: dict[str, int] = {}
    if gpus:
        with NvmlPeakSampler() as sampler:
            sampler.sample()
        held = sampler.peaks
    out = []
    for g in gpus:
        name = f"CUDA{g.index}"
        overhead = overhead_for(g, fingerprint, nvidia.driver)
        left = replace(overhead, bytes=max(0, overhead.bytes - held.get(name, 0)),
                       source=overhead.source + (f", less {held[name] / 2**20:.0f} MiB fitter's processes already hold"
                                                 if held.get(name) else ""))
        out.append(Device(name, CUDA, g.memory_total, g.memory_free, left))
    return with_environment(tuple(out))


def take_snapshot() -> MachineSnapshot:
    """Read the machine once: /proc and /sys, psutil's RAM, NVML, llama-cpp-python's libggml-base (not imported:
    its commit is read through ctypes)."""
    gpus, nvidia = detect_nvidia()
    return MachineSnapshot(build_cpu_info(read_cpu_snapshot()), detect_ram(), gpus, nvidia, llama_cpp_python_build())


def machine_record(cpu: CpuInfo, ram_total: int, gpus: list[str], driver: str | None) -> dict[str, Any]:
    """What a measurement depends on in the machine, and a fingerprint over it (pure)."""
    freqs = sorted({c.max_freq_khz for c in cpu.cores if c.max_freq_khz})
    record = {
        "cpu": cpu.model, "arch": cpu.arch, "physical_cores": cpu.physical_cores, "logical_cpus": cpu.logical_cpus,
        "performance_cores": cpu.performance_cores, "max_freq_khz": freqs[-1] if freqs else None,
        "governor": cpu.governor, "ram_bytes": ram_total, "gpus": gpus, "nvidia_driver": driver,
    }
    stable = {k: record[k] for k in ("cpu", "arch", "physical_cores", "logical_cpus", "ram_bytes", "gpus",
                                     "nvidia_driver")}
    record["fingerprint"] = hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]
    return record
