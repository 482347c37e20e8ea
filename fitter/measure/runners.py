"""What runs a trial: one configuration in, one measurement (with its peak VRAM) out.

`fitter bench`, `fitter tune` and `fitter check` talk to a `TrialRunner` only, so the same command runs on fitter's
worker (`WorkerRunner`: llama-cpp-python in a persistent child), the user's llama-server (`ServerRunner`) or
llama-bench (`LlamaBenchRunner`), a simulated machine (fitter.sim) or a fake in a test. Each is a context manager
(what it starts lives inside the `with`), knows the llama.cpp build that measures before it starts, and is handed
the memory plan the caller already screened the config with (a simulated machine measures that plan instead of
estimating again; the real runners measure what llama.cpp allocates). The real runners share the emulated GPU
(started on enter, its peak counter restarted before each trial, a fresh one on the same endpoint when its server
died) and NVML's per-process peak sampled during each trial.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from fitter.flags import LaunchConfig, ProcessFlags
from fitter.flags.consumers import server_flags
from fitter.machine.llama_cpp import llama_cpp_python_build
from fitter.measure.types import BenchSpec, Measurement, TrialResult, WorkerError
from fitter.measure.worker import LlamaWorker
from fitter.memory.backends.devices import CpuProfile, Device
from fitter.memory.plan.estimator import MemoryPlan

# The CUDA-shaped emulated GPU's client rules are loaded into fitter's own llama.cpp client (fitter.measure.capi):
# a llama-server or llama-bench binary would see a plain RPC device. The Vulkan one (capdev's client mode) caps the
# Vulkan devices of any llama.cpp process fitter starts: a Vulkan build's binaries, or the worker on its libraries.
CUDA_SHAPED_NEEDS_WORKER = ("--emulated-gpu cuda:MiB: CUDA's rules live in fitter's own llama.cpp client, which a "
                            "llama-server or llama-bench binary is not; use --emulated-gpu MiB with them")
DEFAULT_TIMEOUT_S = 600.0  # a user's llama-server or llama-bench, when the caller gives no limit


class TrialRunner(Protocol):
    backend: str  # "llama-cpp-python" | "llama-server" | "llama-bench" | "sim", as in `fitter bench --json`
    emulated: bool  # the device is fitter's emulated GPU
    deployed_context: bool  # the trial allocates the deployed context (so the memory plan is what it measures)

    @property
    def rpc(self) -> tuple[str, ...]:
        """The RPC endpoints every trial's config must carry (the emulated GPU's)."""
        ...

    def devices(self) -> tuple[Device, ...]:
        """The devices this runner brings (an emulated or simulated GPU); () means the machine's own."""
        ...

    def cpu_profile(self) -> CpuProfile | None:
        """The repack rules of the CPU that runs the trials when it is not this machine's (a simulated one)."""
        ...

    def build(self) -> dict[str, str]:
        """The llama.cpp build that measures ({"commit", "source"}), known before the runner starts."""
        ...

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None,
            plan: MemoryPlan | None = None) -> TrialResult: ...

    def __enter__(self) -> TrialRunner: ...

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None: ...


# How commands make runners: factory(emulated_gpu_mib=MiB | (MiB, …) | None, cpus=(cpu, …) | None
# [, emulated_kind="rpc" | "cuda" | "vulkan"]).
RunnerFactory = Callable[..., TrialRunner]


def with_rpc(config: LaunchConfig, endpoints: tuple[str, ...]) -> LaunchConfig:
    """`config` with the runner's RPC endpoints added, as `--rpc` on its command line would add them."""
    if not endpoints or config.rpc == endpoints:
        return config
    return config.with_given(rpc=endpoints)


def emulated_caps(emulated_gpu_mib: int | tuple[int, ...] | None) -> tuple[int, ...]:
    """The caps of the emulated GPUs a runner starts: one MiB value, a tuple of them (`--emulated-gpu 96,48`), or
    none."""
    if emulated_gpu_mib is None:
        return ()
    return (emulated_gpu_mib,) if isinstance(emulated_gpu_mib, int) else tuple(emulated_gpu_mib)


def emulated_gpus(kind: str, caps: tuple[int, ...], beside: str | Path | None = None) -> Any:
    """The group of emulated GPUs of `kind` (not started): capped RPC devices ("rpc"), CUDA-shaped ones ("cuda"),
    or Vulkan devices on lavapipe ("vulkan", the Vulkan build beside `beside` or fitter's own)."""
    if kind == "vulkan":
        from fitter.measure.emulator.emulated_vulkan import EmulatedVulkanGpus

        return EmulatedVulkanGpus(caps, beside=beside)
    from fitter.measure.emulator.emulated_gpu import EmulatedGpus

    return EmulatedGpus(caps, cuda=kind == "cuda", beside=beside)


def _one_stream(spec: BenchSpec, who: str) -> None:
    if spec.streams > 1:
        raise WorkerError(f"{who} measures one stream; {spec.streams} concurrent streams are served by llama-server "
                          "(--llama-cpp DIR) or a simulated machine (--backend sim)")


class _Devices:
    """The emulated GPUs and NVML peak sampling every real runner shares."""

    backend = ""
    deployed_context = True

    def __init__(self, emulated_gpu_mib: int | tuple[int, ...] | None = None, nvml: bool = False,
                 emulated_kind: str = "rpc", beside: str | None = None,
                 gpu_order: tuple[int, ...] | None = None) -> None:
        self._caps = emulated_caps(emulated_gpu_mib)
        self.emulated = bool(self._caps)
        self._beside = beside  # a user's binary: its own ggml serves the emulated GPU when it can
        # rpc, cuda (the CUDA-shaped one: fitter's own llama.cpp client only) or vulkan (`emulated_gpus`)
        self.emulated_kind = emulated_kind
        self._gpu: Any = None  # an emulated GPU group while running
        self._nvml = nvml
        self._gpu_order = gpu_order  # NVML's index of each CUDA device, CUDA0 first (MachineSnapshot.nvml_indices)
        self.trials_run = 0
        self.model_loads = 0

    def __enter__(self) -> Any:
        if self._caps:
            self._gpu = emulated_gpus(self.emulated_kind, self._caps, self._beside).start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self._gpu is not None:
            self._gpu.stop()

    @property
    def rpc(self) -> tuple[str, ...]:
        return self._gpu.endpoints if self._gpu is not None else ()


    def devices(self) -> tuple[Device, ...]:
        """The emulated devices as the estimator sees them (each one's free memory is its cap)."""
        if self._gpu is None:
            return ()
        return self._gpu.devices()  # type: ignore[no-any-return]

    def cpu_profile(self) -> CpuProfile | None:
        return None  # this machine's CPU runs the trials

    def _fresh_gpu(self) -> bool:
        """Restart any emulated GPU whose server died (a fresh one on the same endpoint); whether one did."""
        if self._gpu is None:
            return False
        return self._gpu.restart_dead()  # type: ignore[no-any-return]

    def _measured(self, measure: Callable[[], Measurement], emptied: bool = True) -> TrialResult:
        """Run `measure` with the emulated GPUs' peaks restarted and NVML sampling; the device peaks it reached. A
        trial during which an emulated GPU's server died is a crash that says so (its client died or hung with it).
        `emptied`: no client holds a buffer on the devices now (the last trial's process ended, or its model was
        unloaded), so the peaks restart once the servers have freed them all."""
        from fitter.machine.nvml_peak import NvmlPeakSampler

        if self._gpu is not None:
            if emptied:
                self._gpu.wait_until_empty()
            self._gpu.reset_peak()
        sampler: Any = NvmlPeakSampler(order=self._gpu_order) if self._nvml else contextlib.nullcontext()
        with sampler:
            m = measure()
        if self._gpu is not None and m.outcome in ("crash", "timeout"):
            # the client sees the connection drop as soon as the server's sockets close, a moment before it is reaped
            died = self._gpu.died(wait_s=1.0)
            if died is not None:
                m = replace(m, outcome="crash", reason=f"the emulated GPU's server {died} during the trial; "
                            f"{m.reason}")
        self.trials_run += 1
        self.model_loads += 0 if m.reused_model else 1
        peak: dict[str, dict[str, Any]] = {}
        if self._gpu is not None:
            peak.update({name: {"bytes": b, "source": "emulator"} for name, b in self._gpu.peaks().items()})
        if isinstance(sampler, NvmlPeakSampler):
            peak.update({name: {"bytes": b, "source": "nvml"} for name, b in sampler.peaks.items()})
        return TrialResult(m, peak)


class WorkerRunner(_Devices):
    """fitter's persistent worker (llama-cpp-python), pinned to `cpus` when given."""

    backend = "llama-cpp-python"

    def __init__(self, emulated_gpu_mib: int | tuple[int, ...] | None = None, cpus: tuple[int, ...] | None = None,
                 nvml: bool = False, log_path: str | Path | None = None, build: dict[str, str] | None = None,
                 emulated_kind: str = "rpc", gpu_order: tuple[int, ...] | None = None) -> None:
        super().__init__(emulated_gpu_mib, nvml, emulated_kind, gpu_order=gpu_order)
        self._worker = LlamaWorker(log_path=log_path, cpus=cpus)
        self._build = build  # the machine snapshot's reading, when the caller has one

    def __enter__(self) -> WorkerRunner:
        super().__enter__()
        self._worker.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._worker.close()
        super().__exit__(et, ev, tb)

    def build(self) -> dict[str, str]:
        """Read from the libggml-base llama-cpp-python loads (the worker's own), without starting the worker."""
        info = self._build or llama_cpp_python_build()
        return {"commit": info["commit"], "source": info["source"]}

    def release_devices(self) -> None:
        """Let the emulated GPUs serve another client (llama-fit-params projecting a config): ggml's RPC server
        serves one at a time, and the worker's child holds its connection while it lives; the next trial starts a
        fresh child."""
        if self._gpu is not None:
            self._worker.close_child()

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None,
            plan: MemoryPlan | None = None) -> TrialResult:
        _one_stream(spec, "fitter's worker")
        if self._fresh_gpu():
            self._worker.close_child()  # its RPC connection died with the old server: a new child registers the new one
        reload = self._worker.will_reload(model, config)
        if self._gpu is not None and reload:
            self._worker.unload()  # else the old model's bytes are still in use when the peak restarts
        return self._measured(lambda: self._worker.run(model, config, spec, timeout), emptied=reload)


class ServerRunner(_Devices):
    """The user's llama-server binary, started for each trial with the config's flags as given, the bench spec's
    threads and the affinity of `process`."""

    backend = "llama-server"

    def __init__(self, binary: str, emulated_gpu_mib: int | tuple[int, ...] | None = None,
                 process: ProcessFlags | None = None,
                 nvml: bool = False, vocab_size: int = 256, gpu_order: tuple[int, ...] | None = None,
                 emulated_kind: str = "rpc") -> None:
        super().__init__(emulated_gpu_mib, nvml, emulated_kind, beside=binary, gpu_order=gpu_order)
        self.binary = binary
        self._process = process or ProcessFlags()
        self._vocab_size = vocab_size

    def build(self) -> dict[str, Any]:
        """The commit, version and backends the binary reports, and the binary (results and exports name it)."""
        from fitter.measure.llamacpp.builds import binary_build

        return binary_build(self.binary)

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None,
            plan: MemoryPlan | None = None) -> TrialResult:
        from fitter.measure.server import measure_server

        self._fresh_gpu()
        process = replace(self._process, threads=spec.threads, threads_batch=spec.threads_batch or spec.threads)
        flags = [*server_flags(config), *process.flags()]
        return self._measured(lambda: measure_server(self.binary, model, flags, spec, timeout or DEFAULT_TIMEOUT_S,
                                                     vocab_size=self._vocab_size))


class LlamaBenchRunner(_Devices):
    """The user's llama-bench binary. It sizes its context at p+n+d for one sequence, not the deployed one."""

    backend = "llama-bench"
    deployed_context = False

    def __init__(self, binary: str, emulated_gpu_mib: int | tuple[int, ...] | None = None,
                 cpu_mask: str | None = None,
                 nvml: bool = False, gpu_order: tuple[int, ...] | None = None, emulated_kind: str = "rpc") -> None:
        super().__init__(emulated_gpu_mib, nvml, emulated_kind, beside=binary, gpu_order=gpu_order)
        self.binary = binary
        self._cpu_mask = cpu_mask

    def build(self) -> dict[str, str]:
        return {"commit": "unknown", "source": "llama-bench reports its build with each result (build_commit)"}

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None,
            plan: MemoryPlan | None = None) -> TrialResult:
        from fitter.measure.llama_bench import measure_llama_bench

        _one_stream(spec, "llama-bench")
        self._fresh_gpu()
        return self._measured(lambda: measure_llama_bench(self.binary, model, config, spec,
                                                          timeout or DEFAULT_TIMEOUT_S, cpu_mask=self._cpu_mask))
