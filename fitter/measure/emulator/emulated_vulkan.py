"""fitter's emulated Vulkan GPU: the Vulkan device of Mesa's software driver (lavapipe), capped.

lavapipe is a conformant Vulkan 1.3 device on the CPU, and llama.cpp's Vulkan backend (ggml-vulkan) runs models on
it: its own code places tensors, sizes buffers, refuses ops and fails, not an emulation of it. Two things keep it
from behaving like a small GPU, and the capdev shim in client mode (fitter/measure/emulator/native/capdev.c) fixes
both inside every llama.cpp process fitter starts while an `EmulatedVulkanGpus` is started:

- lavapipe reports its 2 GiB heap as free forever (it has no VK_EXT_memory_budget) and never refuses an
  allocation: the shim answers `ggml_backend_dev_memory` (and the props' memory) with the cap less what the
  process holds on the device, and refuses a `Vulkan<i>` buffer past the cap, so llama.cpp's `--fit`, its layer
  split and its out-of-memory failures see a card of that size;
- llama.cpp skips CPU-type Vulkan devices unless `GGML_VK_VISIBLE_DEVICES` names them (ggml-vulkan.cpp
  `ggml_vk_instance_init`): it names lavapipe once per emulated GPU (`0,0` makes Vulkan0 and Vulkan1 of the same
  driver, each with its own cap).

The processes are the Vulkan build's (the llama-server a runner starts, llama-fit-params) and fitter's own
llama.cpp clients (the loader, the worker: `LLAMA_CPP_LIB_PATH` points llama-cpp-python at the Vulkan build's
libraries). The environment is set on `start()` and restored on `stop()`, as the CUDA-shaped emulated GPU's is. Each
device's counters live in `<dir>/Vulkan<i>.stats` (the RPC emulator's layout, fitter.measure.emulator.capdev), held
by the last process that allocated on the device. Speeds are CPU speeds, slower than the CPU backend: use it for
memory, placement and failure, not speed.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

from fitter import process
from fitter.measure.emulator.capdev import (
    _DIR_PREFIX,
    _W_PID,
    _W_SEQ,
    _W_USED,
    SHIM_SOURCE,
    STATS_SIZE,
    EmulatedGpuError,
    EmulatedGpuStats,
    _compiler,
    _library_path,
    _sources,
    parse_stats,
    request_peak_reset,
    shim_library,
)
from fitter.memory.backends.devices import Device, VulkanLimits, vulkan_profile
from fitter.units import MIB

VISIBLE_ENV = "GGML_VK_VISIBLE_DEVICES"  # ggml-vulkan.cpp ggml_vk_instance_init
LIB_PATH_ENV = "LLAMA_CPP_LIB_PATH"  # llama-cpp-python's libraries (llama_cpp/_ctypes_extensions.py)
_SHIM_ENV = ("FITTER_CAPDEV_DEVICES", "FITTER_CAPDEV_CAPS", "FITTER_CAPDEV_STATS_DIR")
_ENV = (VISIBLE_ENV, LIB_PATH_ENV, "LD_PRELOAD", *_SHIM_ENV)
VULKAN_LIBRARY = "libggml-vulkan.so.0"  # a shared Vulkan build's backend, beside its binaries
LAVAPIPE = "llvmpipe"  # Mesa's lavapipe names its device "llvmpipe (LLVM …)"


def is_vulkan_build(folder: Path) -> bool:
    """`folder` is a shared llama.cpp build with the Vulkan backend (its libraries beside the binaries)."""
    return (folder / VULKAN_LIBRARY).is_file() and (folder / "libggml-base.so.0").is_file()


def vulkan_build(beside: str | Path | None = None) -> Path:
    """The Vulkan build the emulated GPU runs: the folder of `beside` (a user's llama-server) when it is a shared
    Vulkan build, else fitter's own Vulkan tools."""
    from fitter.measure.emulator.capdev import binary_folder
    from fitter.measure.llamacpp.tools import built_tools, tools_dir

    if beside is not None:
        folder = binary_folder(beside)
        if is_vulkan_build(folder):
            return folder
        raise EmulatedGpuError(f"--emulated-gpu vulkan: {folder} is not a shared llama.cpp build with the Vulkan "
                               f"backend (no {VULKAN_LIBRARY} beside its binaries); give a Vulkan build's bin/ folder "
                               "as --llama-cpp, or leave it out to use fitter's")
    built = built_tools("vulkan")
    if built is None:
        raise EmulatedGpuError(f"--emulated-gpu vulkan: fitter's Vulkan build of llama.cpp is not built in "
                               f"{tools_dir('vulkan')}: run `bash .ci/setup --vulkan` (or python -m "
                               "fitter.measure.llamacpp.tools --vulkan; a few minutes once)")
    return built


def find_lavapipe() -> tuple[int, VulkanLimits, int]:
    """lavapipe's index among the Vulkan loader's devices (GGML_VK_VISIBLE_DEVICES counts in that order), its
    limits and its heap in bytes; EmulatedGpuError when the loader or the driver is missing."""
    from fitter.machine.vulkan import vulkan_devices

    devices = vulkan_devices()
    if devices is None:
        raise EmulatedGpuError("--emulated-gpu vulkan: no Vulkan loader (libvulkan.so.1) on this machine: install "
                               "Mesa's software Vulkan driver (Debian: apt-get install mesa-vulkan-drivers)")
    for i, d in enumerate(devices):
        if d.device_type == "cpu" and d.name.startswith(LAVAPIPE):
            return i, d.limits(), d.heap_bytes
    listed = ", ".join(f"{d.name} ({d.device_type})" for d in devices) or "none"
    raise EmulatedGpuError(f"--emulated-gpu vulkan: Mesa's lavapipe is not among this machine's Vulkan devices "
                           f"({listed}): install it (Debian: apt-get install mesa-vulkan-drivers)")


def emulated_vulkan_problem(beside: str | Path | None = None) -> str | None:
    """Why the emulated Vulkan GPU cannot start here (no Vulkan build, no lavapipe, no C compiler for the shim that
    is not built yet); None when it can. Asked before a command creates anything."""
    try:
        vulkan_build(beside)
        find_lavapipe()
        if not _library_path(SHIM_SOURCE, _sources(SHIM_SOURCE)).is_file():
            _compiler()
    except EmulatedGpuError as e:
        return str(e)
    return None


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmulatedVulkanGpus:
    """Capped Vulkan devices on lavapipe (`--emulated-gpu vulkan:96,48`): Vulkan0, Vulkan1, … in every llama.cpp
    process fitter starts while started, each refusing buffers past its cap.

    >>> with EmulatedVulkanGpus((512,)) as gpus:          # doctest: +SKIP
    ...     load_and_capture(model, parse_launch_flags(["-ngl", "all"]))
    ...     gpus.peaks()
    """

    kind = "vulkan"

    def __init__(self, caps_mib: tuple[int, ...], beside: str | Path | None = None) -> None:
        if not caps_mib:
            raise EmulatedGpuError("emulated Vulkan GPUs: give at least one cap")
        if any(c < 1 for c in caps_mib):
            raise EmulatedGpuError(f"emulated Vulkan GPU caps: each must be at least 1 MiB, got {list(caps_mib)}")
        self.caps_mib = tuple(caps_mib)
        self.beside = beside
        self._dir: Path | None = None
        self._saved: dict[str, str | None] = {}
        self._limits: VulkanLimits | None = None
        self._lib_dir: Path | None = None
        self._lock = threading.RLock()
        self.start_seconds = 0.0

    # -- what the estimator and the runners see ------------------------------------------------------------------

    @property
    def endpoints(self) -> tuple[str, ...]:
        """No RPC server: the devices are the Vulkan build's own."""
        return ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"Vulkan{i}" for i in range(len(self.caps_mib)))  # ggml-vulkan.cpp: GGML_VK_NAME + index

    @property
    def lib_dir(self) -> Path:
        """The Vulkan build whose libraries fitter's own llama.cpp clients load while started."""
        if self._lib_dir is None:
            raise EmulatedGpuError("emulated Vulkan GPUs: not started (call start())")
        return self._lib_dir

    def devices(self) -> tuple[Device, ...]:
        """The devices as the estimator sees them: lavapipe's limits, each one's cap its total and free memory."""
        limits = self._limits if self._limits is not None else find_lavapipe()[1]
        return emulated_vulkan_devices(self.caps_mib, limits)

    # -- lifecycle -----------------------------------------------------------------------------------------------

    def __enter__(self) -> EmulatedVulkanGpus:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> EmulatedVulkanGpus:
        with self._lock:
            if self._dir is not None:
                raise EmulatedGpuError("emulated Vulkan GPUs: already started")
            t0 = time.perf_counter()
            lib_dir = vulkan_build(self.beside)
            index, limits, heap = find_lavapipe()
            too_big = [c for c in self.caps_mib if c * MIB > heap]
            if too_big:
                raise EmulatedGpuError(
                    f"--emulated-gpu vulkan:{','.join(map(str, self.caps_mib))}: {too_big[0]} MiB is more than "
                    f"lavapipe can address ({heap // MIB} MiB, its one heap); give at most {heap // MIB} MiB per GPU")
            shim = shim_library()
            self._dir = Path(tempfile.mkdtemp(prefix=_DIR_PREFIX))
            self._limits, self._lib_dir = limits, lib_dir
            preload = os.environ.get("LD_PRELOAD", "")
            env = {
                VISIBLE_ENV: ",".join([str(index)] * len(self.caps_mib)),
                LIB_PATH_ENV: str(lib_dir),
                "LD_PRELOAD": str(shim) + (f" {preload}" if preload else ""),
                "FITTER_CAPDEV_DEVICES": ",".join(self.names),
                "FITTER_CAPDEV_CAPS": ",".join(str(c * MIB) for c in self.caps_mib),
                "FITTER_CAPDEV_STATS_DIR": str(self._dir),
            }
            self._saved = {k: os.environ.get(k) for k in _ENV}
            os.environ.update(env)
            process.register(id(self), self.stop)
            self.start_seconds = time.perf_counter() - t0
        return self

    def stop(self) -> None:
        """Restore the environment and remove the counters (idempotent)."""
        with self._lock:
            if self._dir is None:
                return
            process.unregister(id(self))
            for key, value in self._saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def died(self, wait_s: float = 0.0) -> str | None:
        """No server runs beside the clients: nothing can die on its own."""
        return None

    def restart_dead(self) -> bool:
        return False

    # -- counters ------------------------------------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        if self._dir is None:
            raise EmulatedGpuError("emulated Vulkan GPUs: not started (call start())")
        return self._dir / f"{name}.stats"

    def stats(self, name: str) -> EmulatedGpuStats | None:
        """A device's counters as its last allocating process left them; None before any process allocated on it."""
        path = self._path(name)
        for _ in range(10000):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                return None
            st = parse_stats(data[:STATS_SIZE]) if len(data) >= STATS_SIZE else None
            if st is not None:
                return st
            time.sleep(0)
        return None

    def peaks(self) -> dict[str, int]:
        """Peak bytes per device since the last reset, in the process that allocated on it last."""
        out = {}
        for name in self.names:
            st = self.stats(name)
            out[name] = st.peak_bytes if st is not None else 0
        return out

    def reset_peak(self) -> None:
        """Restart each device's peak: a live process that holds its counters restarts it from what it holds (at its
        next allocation); counters a process left behind are cleared, so a trial that never allocates reads 0."""
        for name in self.names:
            path = self._path(name)
            if not path.is_file():
                continue
            with path.open("r+b") as f, mmap.mmap(f.fileno(), STATS_SIZE) as words:
                pid = struct.unpack_from("<Q", words, _W_PID * 8)[0]
                if _alive(pid) and pid != os.getpid():
                    request_peak_reset(words)
                    continue
                seq = struct.unpack_from("<Q", words, _W_SEQ * 8)[0]
                struct.pack_into("<Q", words, _W_SEQ * 8, seq | 1)
                for w in range(_W_USED, _W_PID + 1):
                    if w not in (10, 11):  # the reset request and the last one seen stay
                        struct.pack_into("<Q", words, w * 8, 0)
                struct.pack_into("<Q", words, _W_SEQ * 8, (seq | 1) + 1)

    def wait_until_empty(self, timeout_s: float = 10.0) -> bool:
        """A client frees its Vulkan buffers itself, before it answers or exits: nothing to wait for once it did."""
        deadline = time.monotonic() + timeout_s
        while any((st := self.stats(n)) is not None and st.used_bytes and _alive(st.server_pid) for n in self.names):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True


def emulated_vulkan_devices(caps_mib: tuple[int, ...], limits: VulkanLimits) -> tuple[Device, ...]:
    """Emulated Vulkan GPUs of these caps on a driver with these limits, as the estimator sees them."""
    from fitter.machine.environment import with_environment

    profile = vulkan_profile(limits)
    return with_environment(tuple(Device(f"Vulkan{i}", profile, cap * MIB, cap * MIB)
                                  for i, cap in enumerate(caps_mib)))

