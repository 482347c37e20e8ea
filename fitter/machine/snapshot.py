"""One snapshot of this machine per command, passed down: the CPU and its topology, RAM, the NVIDIA GPUs (free
memory now) and the driver, and the llama.cpp build llama-cpp-python provides. Taken once at the command's edge
(`take_snapshot`), so NVML is opened and /proc/cpuinfo read once; everything below reads the snapshot.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fitter.machine.cpu import CpuInfo, RamInfo, build_cpu_info, detect_ram, read_cpu_snapshot
from fitter.machine.environment import with_environment
from fitter.machine.gpu_order import (
    CudaGpu,
    GpuOrderError,
    Listed,
    cuda_environment,
    cuda_order,
    gpu_map,
    normal_bus_id,
    pci_order,
)
from fitter.machine.llama_cpp import llama_cpp_python_build
from fitter.machine.measured_overhead import overhead_for
from fitter.machine.nvidia import GpuInfo, NvidiaInfo, detect_nvidia
from fitter.memory.backends.devices import (
    CUDA,
    CpuProfile,
    Device,
    cpu_profile_for,
)


@dataclass(frozen=True)
class MachineSnapshot:
    cpu: CpuInfo
    ram: RamInfo
    gpus: tuple[GpuInfo, ...]  # NVML's order
    nvidia: NvidiaInfo
    llama_cpp: dict[str, str] = field(default_factory=dict)  # llama-cpp-python's build: commit, source, version
    cuda_env: dict[str, str] = field(default_factory=dict)  # CUDA_DEVICE_ORDER, CUDA_VISIBLE_DEVICES when set
    cuda_listing: tuple[Listed, ...] | None = None  # a llama.cpp build's `--list-devices`, when one was asked

    def gpu_order(self) -> tuple[CudaGpu, ...]:
        """The GPUs llama.cpp sees, as it numbers them (fitter.machine.gpu_order); GpuOrderError when that cannot be
        known."""
        return cuda_order(self.gpus, self.cuda_env, self.cuda_listing)

    def with_listing(self, listed: Sequence[Listed]) -> MachineSnapshot:
        """The same machine, its CUDA order confirmed (or given) by a llama.cpp build's own device list."""
        return replace(self, cuda_listing=tuple(listed))

    def nvml_indices(self) -> tuple[int, ...]:
        """NVML's index of each GPU llama.cpp sees, CUDA0 first (for the peak sampler's handles)."""
        return tuple(c.gpu.index for c in self.gpu_order())

    def devices(self) -> tuple[Device, ...]:
        """The NVIDIA GPUs as the estimator sees them, named as llama.cpp names them (`gpu_order`), with their free
        memory when the snapshot was taken and the memory each will use outside llama.cpp's buffers (measured here
        before, else the default of its class); `gpus_now()` re-reads the free memory."""
        order = self.gpu_order()
        fingerprint = self.record()["fingerprint"] if order else None
        return with_environment(tuple(Device(c.device, CUDA, c.gpu.memory_total, c.gpu.memory_free,
                                             overhead_for(c.gpu, fingerprint, self.nvidia.driver)) for c in order))

    @property
    def cpu_profile(self) -> CpuProfile:
        """Which weight types the CPU backend repacks (CPU_REPACK), from the CPU's ISA flags."""
        return cpu_profile_for({name for name, present in self.cpu.isa if present})

    def record(self) -> dict[str, Any]:
        """What a measurement depends on in this machine, and its fingerprint."""
        try:
            order, unknown = self.gpu_order(), None
        except GpuOrderError as e:
            # the record only names the machine: in PCI order, saying CUDA's is unknown; what places buffers on the
            # GPUs (devices(), gpus_now()) still refuses. An --emulated-gpu or --rpc tune here needs no CUDA order.
            order, unknown = tuple(CudaGpu(i, g) for i, g in enumerate(pci_order(self.gpus))), str(e)
        record = machine_record(self.cpu, self.ram.total, [c.gpu.name for c in order], self.nvidia.driver,
                                gpu_map(order))
        if unknown is not None:
            record["gpu_order_unknown"] = unknown
        return record


def gpus_now(snapshot: MachineSnapshot | None = None, module: Any = None) -> tuple[Device, ...]:
    """The NVIDIA GPUs with their free memory *now*: read again once a runner has started, so what its worker holds
    already (a CUDA context, cuBLAS workspaces) is not counted as free for the trials' budgets, nor again as
    overhead: each device's overhead is what is left of it beyond what fitter's processes hold on it now. Named as
    the snapshot's CUDA order names them (matched by PCI bus id); empty when NVML no longer shows one of them.
    `module` stands in for pynvml in tests."""
    from fitter.machine.nvml_peak import NvmlPeakSampler

    gpus, nvidia = detect_nvidia(module)
    if snapshot is not None:
        order = _again(snapshot.gpu_order(), gpus)
        fingerprint = snapshot.record()["fingerprint"] if order else None
    else:
        order, fingerprint = cuda_order(gpus, cuda_environment()), None
    if order is None:
        return ()
    held: dict[str, int] = {}
    if order:
        with NvmlPeakSampler(module, order=[c.gpu.index for c in order]) as sampler:
            sampler.sample()
        held = sampler.peaks
    out = []
    for c in order:
        name = c.device
        overhead = overhead_for(c.gpu, fingerprint, nvidia.driver)
        left = replace(overhead, bytes=max(0, overhead.bytes - held.get(name, 0)),
                       source=overhead.source + (f", less {held[name] / 2**20:.0f} MiB fitter's processes already hold"
                                                 if held.get(name) else ""))
        out.append(Device(name, CUDA, c.gpu.memory_total, c.gpu.memory_free, left))
    return with_environment(tuple(out))


def _again(order: tuple[CudaGpu, ...], gpus: tuple[GpuInfo, ...]) -> tuple[CudaGpu, ...] | None:
    """`order` with NVML's fresh reading of each GPU (by PCI bus id, else NVML index); None when one is gone."""
    def key(g: GpuInfo) -> str:
        return normal_bus_id(g.pci_bus_id) or f"nvml {g.index}"

    fresh = {key(g): g for g in gpus}
    if any(key(c.gpu) not in fresh for c in order):
        return None
    return tuple(CudaGpu(c.index, fresh[key(c.gpu)]) for c in order)


def take_snapshot() -> MachineSnapshot:
    """Read the machine once: /proc and /sys, psutil's RAM, NVML, llama-cpp-python's libggml-base (not imported:
    its commit is read through ctypes)."""
    gpus, nvidia = detect_nvidia()
    return MachineSnapshot(build_cpu_info(read_cpu_snapshot()), detect_ram(), gpus, nvidia, llama_cpp_python_build(),
                           cuda_environment())


def machine_record(cpu: CpuInfo, ram_total: int, gpus: list[str], driver: str | None,
                   gpu_map: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """What a measurement depends on in the machine, and a fingerprint over it (pure). `gpu_map`: each GPU llama.cpp
    sees, CUDA0 first, with its PCI bus id, name and total memory (fitter.machine.gpu_order.gpu_map); the
    fingerprint covers it, so another card in a slot, or another CUDA_VISIBLE_DEVICES, is another machine."""
    freqs = sorted({c.max_freq_khz for c in cpu.cores if c.max_freq_khz})
    record: dict[str, Any] = {
        "cpu": cpu.model, "arch": cpu.arch, "physical_cores": cpu.physical_cores, "logical_cpus": cpu.logical_cpus,
        "performance_cores": cpu.performance_cores, "max_freq_khz": freqs[-1] if freqs else None,
        "governor": cpu.governor, "ram_bytes": ram_total, "gpus": gpus, "gpu_map": list(gpu_map or []),
        "nvidia_driver": driver,
    }
    stable = {k: record[k] for k in ("cpu", "arch", "physical_cores", "logical_cpus", "ram_bytes", "gpus",
                                     "nvidia_driver")}
    if record["gpu_map"]:  # only then: a machine without GPUs keeps the fingerprint its results are stored under
        stable["gpu_map"] = record["gpu_map"]
    record["fingerprint"] = hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]
    return record


def with_build_devices(record: dict[str, Any], devices: list[dict[str, Any]]) -> dict[str, Any]:
    """`record` of a machine tuned through a user's build, with the devices that build listed (name, backend,
    total memory; `build_devices`) in it and in its fingerprint: another card, or a build of another backend, is
    another machine (pure)."""
    out = dict(record, build_devices=devices)
    base = record["fingerprint"]
    out["fingerprint"] = hashlib.sha256(json.dumps([base, devices], sort_keys=True).encode()).hexdigest()[:16]
    return out
