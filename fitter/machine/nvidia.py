"""NVIDIA GPUs and their driver through NVML (nvidia-ml-py): memory, compute capability, PCIe, memory bandwidth.

NVML is opened in one place (`nvml()`), for this snapshot and for the peak sampler (fitter.machine.nvml_peak);
without a driver (or without pynvml) it is simply absent and the rest of the machine is still reported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

NO_DRIVER = "no NVIDIA driver found"
BF16_MIN_CC = (8, 0)  # Ampere and newer have BF16 tensor cores


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
    cuda_cores: int | None = None  # nvmlDeviceGetNumGpuCores (R520+ drivers): the SM count with the capability

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


@contextlib.contextmanager
def nvml(module: Any = None) -> Iterator[tuple[Any, str | None]]:
    """NVML, initialised for the block and shut down after it: (the pynvml module, None), or (None, why it is
    absent). `module` stands in for pynvml in tests. The one place fitter opens NVML."""
    if module is None:
        try:
            import pynvml
        except ImportError as e:
            yield None, f"{NO_DRIVER}: nvidia-ml-py (pynvml) is not installed: {e}"
            return
        module = pynvml
    try:
        module.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, …: one class per return code
        yield None, f"{NO_DRIVER}: {e}"
        return
    try:
        yield module, None
    finally:
        _opt(module.nvmlShutdown)


def detect_nvidia(module: Any = None) -> tuple[tuple[GpuInfo, ...], NvidiaInfo]:
    """NVIDIA GPUs and the driver through NVML (`module`: the pynvml module, or a stand-in for tests)."""
    with nvml(module) as (lib, absent):
        if lib is None:
            return (), NvidiaInfo(None, None, absent)
        gpus: list[GpuInfo] = []
        driver = cuda = None
        try:
            driver = _text(_opt(lib.nvmlSystemGetDriverVersion))
            cuda = cuda_version(_opt(lib.nvmlSystemGetCudaDriverVersion))
            for i in range(lib.nvmlDeviceGetCount()):
                gpus.append(nvml_gpu(lib, i))
            return tuple(gpus), NvidiaInfo(driver, cuda, None)
        except Exception as e:
            return tuple(gpus), NvidiaInfo(driver, cuda, f"NVML failed: {type(e).__name__}: {e}")


def nvml_gpus(nvml: Any) -> tuple[GpuInfo, ...]:
    """Every GPU an open NVML (`nvml()`) lists, in its order; NVMLError when it cannot count them."""
    return tuple(nvml_gpu(nvml, i) for i in range(nvml.nvmlDeviceGetCount()))


def nvml_gpu(nvml: Any, index: int) -> GpuInfo:
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
        cuda_cores=_opt(getattr(nvml, "nvmlDeviceGetNumGpuCores", lambda _: None), h),
    )
