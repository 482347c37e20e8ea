"""A stand-in for pynvml with several GPUs, listed in the order given (NVML does not promise PCI order), with their
compute processes: what `detect_nvidia`, `gpus_now` and `NvmlPeakSampler` read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MIB = 1024 * 1024
GIB = 1024 * MIB


@dataclass(frozen=True)
class FakeGpu:
    name: str
    bus_id: str  # as NVML gives it: 00000000:01:00.0
    uuid: str
    total: int
    free: int
    cc: tuple[int, int] = (8, 6)
    sms: int | None = None


@dataclass(frozen=True)
class Proc:
    pid: int
    usedGpuMemory: int | None


@dataclass
class FakeNvml:
    gpus: list[FakeGpu]
    processes: dict[int, list[Proc]] = field(default_factory=dict)  # by NVML index
    NVML_CLOCK_MEM: int = 2

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.65.06"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 13000

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return self.gpus[h].name

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.gpus[h].uuid

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return type("Pci", (), {"busId": self.gpus[h].bus_id.encode()})()

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        g = self.gpus[h]
        return type("Mem", (), {"total": g.total, "free": g.free, "used": g.total - g.free})()

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return self.gpus[h].cc

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return 4

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return 16

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return 4

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return 16

    def nvmlDeviceGetMaxClockInfo(self, h: int, kind: int) -> int:
        return 9751

    def nvmlDeviceGetMemoryBusWidth(self, h: int) -> int:
        return 384

    def nvmlDeviceGetNumGpuCores(self, h: int) -> int | None:
        return self.gpus[h].sms

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Proc]:
        return self.processes.get(h, [])
