"""Peak VRAM per CUDA device of fitter's child processes (the worker, a user's llama-server or llama-bench), sampled
through NVML's per-process accounting while a trial runs.

NVML reports each process's used memory per device (nvmlDeviceGetComputeRunningProcesses). That includes the CUDA
context (a few hundred MiB that llama.cpp's buffer lines never show), so the peak is what the device really lost,
not what the estimate predicts. Sampling misses allocations shorter than the interval; llama.cpp allocates its
buffers once per load and context, so they live for the whole trial.

Device names are llama.cpp's (`CUDA{i}`): `order` gives NVML's index of each, CUDA0 first (a machine snapshot's
`nvml_indices()`); without it the sampler works the order out from NVML and this environment
(fitter.machine.gpu_order), as the children it samples see it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import psutil

from fitter.errors import FitterError
from fitter.machine.gpu_order import cuda_environment, cuda_order
from fitter.machine.nvidia import nvml, nvml_gpus


def child_pids() -> set[int]:
    """Every process this one started, at any depth."""
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


class NvmlPeakSampler:
    """`with NvmlPeakSampler() as s: ...` then `s.peaks` → {"CUDA0": bytes}; empty when NVML is unavailable."""

    def __init__(self, nvml: Any = None, pids: Callable[[], set[int]] = child_pids, interval_s: float = 0.05,
                 order: Sequence[int] | None = None) -> None:
        self._nvml = nvml
        self._pids = pids
        self._interval = interval_s
        self._order = None if order is None else tuple(order)
        self._handles: list[tuple[str, Any]] = []  # (llama.cpp's device name, NVML handle)
        self._session: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peaks: dict[str, int] = {}

    def __enter__(self) -> NvmlPeakSampler:
        self._session = nvml(self._nvml)
        lib, _ = self._session.__enter__()
        self._nvml = lib
        try:
            if lib is not None:
                order = self._order if self._order is not None else _cuda_indices(lib)
                self._handles = [(f"CUDA{i}", lib.nvmlDeviceGetHandleByIndex(n)) for i, n in enumerate(order)]
        except FitterError:  # GPUs whose CUDA order cannot be known: the caller must not guess either
            self.__exit__(None, None, None)
            raise
        except Exception:  # no device: nothing to sample (pynvml raises one class per return code)
            self._handles = []
        if self._handles:
            self.sample()
            self._thread = threading.Thread(target=self._run, name="fitter-nvml-peak", daemon=True)
            self._thread.start()
        return self

    def sample(self) -> None:
        """One reading: each device's memory used by our children, kept when it is a new peak."""
        pids = self._pids()
        for name, handle in self._handles:
            try:
                procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:
                continue
            used = sum(int(p.usedGpuMemory or 0) for p in procs if p.pid in pids)
            if used and used > self.peaks.get(name, 0):
                self.peaks[name] = used

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self._session is not None:
            self._session.__exit__(None, None, None)
            self._session = None


def _cuda_indices(lib: Any) -> tuple[int, ...]:
    """NVML's index of each GPU llama.cpp sees, CUDA0 first, under this process's environment."""
    return tuple(c.gpu.index for c in cuda_order(nvml_gpus(lib), cuda_environment()))
