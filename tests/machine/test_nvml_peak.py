from __future__ import annotations

from dataclasses import dataclass

import pytest

from fitter.machine.nvml_peak import NvmlPeakSampler

MIB = 1024 * 1024


@dataclass
class Proc:
    pid: int
    usedGpuMemory: int | None


class FakeNvml:
    """Two devices; each call to nvmlDeviceGetComputeRunningProcesses returns the next scripted reading."""

    def __init__(self, readings: dict[int, list[list[Proc]]]) -> None:
        self.readings = readings
        self.shut = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.readings)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Proc]:
        queue = self.readings[handle]
        return queue.pop(0) if len(queue) > 1 else queue[0]


def test_peak_counts_only_our_children_and_keeps_the_maximum() -> None:
    nvml = FakeNvml({0: [[Proc(11, 300 * MIB), Proc(99, 5000 * MIB)], [Proc(11, 900 * MIB)], [Proc(11, 400 * MIB)]],
                     1: [[Proc(12, None)], [Proc(12, 70 * MIB), Proc(11, 30 * MIB)]]})
    sampler = NvmlPeakSampler(nvml, pids=lambda: {11, 12}, interval_s=3600, order=(0, 1))  # CUDA0 is NVML's 0
    with sampler:  # one reading on entry
        sampler.sample()
        sampler.sample()
    assert sampler.peaks == {"CUDA0": 900 * MIB, "CUDA1": 100 * MIB}  # pid 99 is another user's process
    assert nvml.shut


def test_no_driver_means_no_peaks() -> None:
    class Broken(FakeNvml):
        def nvmlInit(self) -> None:
            raise RuntimeError("NVML Shared Library Not Found")

    with NvmlPeakSampler(Broken({}), pids=lambda: {1}) as sampler:
        pass
    assert sampler.peaks == {}


@pytest.mark.gpu
def test_a_real_worker_on_a_cuda_device_has_an_nvml_peak() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pytest.skip("no NVIDIA driver")
    from fitter.flags import parse_launch_flags
    from fitter.measure.types import BenchSpec
    from fitter.measure.worker import LlamaWorker
    from tests.models import model_file

    with NvmlPeakSampler() as sampler, LlamaWorker() as worker:
        m = worker.run(model_file("gpt-oss-tiny"), parse_launch_flags(["-ngl", "all", "-c", "2048"]),
                       BenchSpec(n_prompt=32, n_gen=8, repetitions=1, threads=1))
    assert m.outcome == "ok" and sampler.peaks["CUDA0"] > 0
