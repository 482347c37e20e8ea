"""What runs a tuning trial: one configuration in, one measurement (with its peak VRAM) out.

The tuner talks to a `TrialRunner` only, so the same search runs on llama.cpp itself (`WorkerRunner`: fitter's
persistent worker, on real GPUs, `--rpc` devices or the emulated GPU) and, for fakes in tests and simulated machines,
on anything with the same two methods.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from fitter.devices import RPC, Device
from fitter.launch_config import LaunchConfig
from fitter.worker import BenchSpec, Measurement, Worker

MIB = 1024 * 1024


@dataclass(frozen=True)
class TrialResult:
    measurement: Measurement
    peak_vram: dict[str, dict[str, Any]] = field(default_factory=dict)  # device → {"bytes", "source"}


class TrialRunner(Protocol):
    backend: str  # "llama-cpp-python" | "sim" | …, as in `fitter bench --json`
    emulated: bool

    def build(self) -> dict[str, str]:
        """The llama.cpp build that measures ({"commit", "source"})."""
        ...

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None) -> TrialResult: ...


class WorkerRunner:
    """fitter's worker, optionally with an emulated GPU whose peak counter is reset before each trial.

    `rpc` is what every trial's config must carry (`--rpc` endpoints of the emulated or user's RPC devices)."""

    backend = "llama-cpp-python"

    def __init__(self, emulated_gpu_mib: int | None = None, cpus: tuple[int, ...] | None = None,
                 nvml: bool = False, log_path: str | Path | None = None) -> None:
        self.emulated = emulated_gpu_mib is not None
        self._cap_mib = emulated_gpu_mib
        self._gpu: Any = None
        self._worker = Worker(log_path=log_path, cpus=cpus)
        self._nvml = nvml
        self.trials_run = 0
        self.model_loads = 0

    def __enter__(self) -> WorkerRunner:
        if self._cap_mib is not None:
            from fitter.emulated_gpu import EmulatedGpu

            self._gpu = EmulatedGpu(cap_mib=self._cap_mib).start()
        self._worker.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._worker.close()
        if self._gpu is not None:
            self._gpu.stop()

    @property
    def rpc(self) -> tuple[str, ...]:
        return (self._gpu.endpoint,) if self._gpu is not None else ()

    def devices(self) -> tuple[Device, ...]:
        """The emulated device as the estimator sees it (its free memory is its cap)."""
        if self._gpu is None:
            return ()
        cap = self._gpu.cap_bytes
        return (Device(self._gpu.device_name, RPC, cap, cap),)

    def build(self) -> dict[str, str]:
        info = self._worker.start().build_info
        return {"commit": info.get("commit", "unknown"), "source": info.get("source", "")}

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None) -> TrialResult:
        from fitter.nvml_peak import NvmlPeakSampler

        if self._gpu is not None:
            if self._worker.will_reload(model, config):
                self._worker.unload()  # else the old model's bytes are still in use when the peak restarts
            self._gpu.reset_peak()
        sampler: Any = NvmlPeakSampler() if self._nvml else contextlib.nullcontext()
        with sampler:
            m = self._worker.run(model, config, spec, timeout)
        self.trials_run += 1
        self.model_loads += 0 if m.reused_model else 1
        peak: dict[str, dict[str, Any]] = {}
        if self._gpu is not None:
            peak[self._gpu.device_name] = {"bytes": self._gpu.stats().peak_bytes, "source": "emulator"}
        if isinstance(sampler, NvmlPeakSampler):
            peak.update({name: {"bytes": b, "source": "nvml"} for name, b in sampler.peaks.items()})
        return TrialResult(m, peak)
