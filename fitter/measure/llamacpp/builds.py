"""The user's own llama.cpp build (`--llama-cpp DIR`, its `bin/` folder): its binaries, the commit they report and
the devices they see.

With it, trials run that build's `llama-server` (the binary deployed), the baseline is that build's
`llama-fit-params`, and results are keyed by its commit. Read from the binaries themselves: `llama-server
--version` (common/build-info: `version: N (commit)`) and `llama-server --list-devices` (common/arg.cpp
`--list-devices`: one line per device, `  NAME: DESCRIPTION (TOTAL MiB, FREE MiB free)`; an RPC device's
description is its server).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fitter.errors import FitterError
from fitter.machine.snapshot import MachineSnapshot
from fitter.machine.vulkan import VulkanDevice, match
from fitter.memory.backends.devices import Device
from fitter.memory.backends.registry import EXACT, backend_of, device_profile
from fitter.units import MIB

BINARIES = ("llama-server", "llama-fit-params", "llama-bench", "llama-perplexity", "llama-quantize")


@dataclass(frozen=True)
class ListedDevice:
    name: str  # CUDA0, Vulkan0, RPC0[host:port], …
    description: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class LlamaCppBuild:
    folder: Path
    llama_server: Path
    llama_fit_params: Path | None
    llama_bench: Path | None
    llama_perplexity: Path | None = None  # output quality (fitter.measure.llamacpp.perplexity)
    llama_quantize: Path | None = None

    def build(self) -> dict[str, Any]:
        """The commit and version the build reports, where they were read (`llama-server --version`), its
        backends and its llama-server (`binary_build`)."""
        return binary_build(str(self.llama_server))

    def perplexity_tool(self) -> Path:
        """The build's llama-perplexity, which measures quality; refused in one line when the build lacks it."""
        if self.llama_perplexity is None:
            raise FitterError(f"--llama-cpp {self.folder}: no llama-perplexity in it, which measures quality; build it "
                              "there (cmake --build build --target llama-perplexity)")
        return self.llama_perplexity


def find_build(folder: str | Path) -> LlamaCppBuild:
    """The binaries of a llama.cpp build's `bin/` folder; llama-server is required, the others optional (a command
    that needs one refuses the build without it)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FitterError(f"--llama-cpp {folder}: not a folder; give a llama.cpp build's bin/ folder")
    found = {name: root / name for name in BINARIES if (root / name).is_file()}
    if "llama-server" not in found:
        raise FitterError(f"--llama-cpp {folder}: no llama-server in it; give the bin/ folder of a llama.cpp build "
                          "(cmake --build build --target llama-server llama-fit-params)")
    return LlamaCppBuild(root, found["llama-server"], found.get("llama-fit-params"), found.get("llama-bench"),
                         found.get("llama-perplexity"), found.get("llama-quantize"))


def parse_list_devices(text: str) -> tuple[ListedDevice, ...]:
    """`llama-server --list-devices` output → the devices (the CPU is not listed)."""
    out = []
    for line in text.splitlines():
        m = re.match(r"\s+(\S+): (.*) \((\d+) MiB, (\d+) MiB free\)\s*$", line)
        if m:
            out.append(ListedDevice(m.group(1), m.group(2), int(m.group(3)) * MIB, int(m.group(4)) * MIB))
    return tuple(out)


def list_devices(build: LlamaCppBuild, rpc: tuple[str, ...] = (), timeout: float = 60.0) -> tuple[ListedDevice, ...]:
    """The devices the build sees (with `--rpc` servers, if any)."""
    # --rpc first: the list is printed while the arguments are parsed, with the servers registered so far
    argv = [str(build.llama_server), *(["--rpc", ",".join(rpc)] if rpc else []), "--list-devices"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FitterError(f"{build.llama_server} --list-devices failed: {e}") from None
    return parse_list_devices(proc.stdout + proc.stderr)


def binary_devices(binary: str | Path, timeout: float = 60.0) -> tuple[ListedDevice, ...]:
    """The devices one llama.cpp binary lists (`llama-server` or `llama-bench --list-devices`, common/arg.cpp)."""
    path = Path(binary)
    return list_devices(LlamaCppBuild(path.parent, path, None, None), timeout=timeout)


def listed_by(snapshot: MachineSnapshot, binary: str | Path | None) -> MachineSnapshot:
    """`snapshot` with `binary`'s own device list, when a binary measures and the machine has GPUs: it confirms (or
    gives) which GPU llama.cpp calls CUDA0 (fitter.machine.gpu_order)."""
    if binary is None or not snapshot.gpus:
        return snapshot
    return snapshot.with_listing(binary_devices(binary))


def build_devices(listed: tuple[ListedDevice, ...], vulkan: tuple[VulkanDevice, ...] | None = None
                  ) -> tuple[tuple[Device, ...], list[str]]:
    """The estimator's devices for what the build lists, each with its backend's rules
    (fitter.memory.backends.registry; a Vulkan device with its driver's limits from `vulkan`, this machine's Vulkan
    devices), and one note for each device whose figures are not fitter's exact rules: a backend fitter plans with
    the build's projection, CUDA's code on other hardware, a Vulkan device whose limits were not read, an
    accelerator llama.cpp never gives a model."""
    devices, notes = [], []
    for d in listed:
        backend = backend_of(d.name)
        if backend.device_type == "accel":
            notes.append(f"{d.name} ({d.description}): an accelerator of the host's own memory; llama.cpp never places "
                         "a model on it (src/llama.cpp skips ACCEL devices)")
            continue
        limits = None
        if backend.name == "Vulkan":
            found = match(vulkan or (), d.description)
            limits = found.limits() if found is not None else None
        profile = device_profile(backend, limits)
        if backend.name == "Vulkan" and limits is None:
            notes.append(f"{d.name} ({d.description}): its Vulkan limits could not be read here (no Vulkan loader, or "
                         "no device of that name): planned with a typical discrete card's (buffer range 4 GiB)")
        elif backend.rules != EXACT:
            notes.append(f"{d.name} ({d.description}): {profile.validated}")
        # an RPC device's buffers are named after its server (`RPC0[host:port]`, ggml-rpc.cpp), its listing is not
        name = f"{d.name}[{d.description}]" if backend.name == "RPC" else d.name
        devices.append(Device(name, profile, d.total_bytes, d.free_bytes))
    return tuple(devices), notes


def devices_of_build(build: LlamaCppBuild, rpc: tuple[str, ...] = ()) -> tuple[tuple[Device, ...], list[str]]:
    """The devices a user's build sees (`llama-server --list-devices`, with `rpc`), whatever its backend, each with
    its backend's rules (a Vulkan device with its driver's limits, read here only when the build lists one; a CUDA
    device with what NVML measured of it, its overhead, where NVML's CUDA order names it alike: NVML never adds or
    drops a device), and the notes `build_devices` gives."""
    listed = list_devices(build, rpc)
    vulkan = None
    if any(backend_of(d.name).name == "Vulkan" for d in listed):
        from fitter.machine.vulkan import vulkan_devices

        vulkan = vulkan_devices()
    devices, notes = build_devices(listed, vulkan)
    seen = {backend_of(d.name).name for d in listed}
    silent = sorted(b for b in library_backends(build.llama_server.resolve().parent)
                    if b not in ("CPU", "RPC", "BLAS") and b not in seen)
    if silent:  # a backend library beside the binary whose devices it does not list: it cannot run on this machine
        listed_text = ", ".join(d.name for d in listed) or "none"
        notes.append(f"{build.folder}: the build has {', '.join(silent)} but lists no device of it here (its devices: "
                     f"{listed_text}): that backend cannot run on this machine (no driver or no card); planned "
                     "without it")
    return _with_nvml(devices, listed), notes


def device_records(devices: tuple[Device, ...]) -> list[dict[str, Any]]:
    """A build's devices as a machine record keeps them (`build_devices`): name, backend, total memory."""
    return [{"device": d.name, "backend": d.profile.kind, "memory_total": d.total_bytes} for d in devices]


def build_change(recorded: dict[str, Any], now: list[dict[str, Any]], backends_then: Any,
                 backends_now: list[str]) -> str | None:
    """How the devices a build lists now (`now`, `device_records`) and its backends differ from those a result was
    tuned on (its machine record's `build_devices`, its llama_cpp's `backends`), or None when they are the same
    (each device's name and backend, its total memory within 1 %: a driver may move it a little) (pure)."""
    then = recorded.get("build_devices")
    if isinstance(backends_then, list) and sorted(backends_then) != sorted(backends_now):
        return (f"was tuned with a build of {', '.join(backends_then)}; it is now a build of "
                f"{', '.join(backends_now)}: tune again with this build")
    if not isinstance(then, list):
        return None

    def same(a: Any, b: dict[str, Any]) -> bool:
        if not isinstance(a, dict) or (a.get("device"), a.get("backend")) != (b["device"], b["backend"]):
            return False
        x, y = a.get("memory_total"), b["memory_total"]
        return not (isinstance(x, int) and isinstance(y, int)) or abs(x - y) <= 0.01 * max(x, y)

    if len(then) == len(now) and all(same(a, b) for a, b in zip(then, now, strict=True)):
        return None

    def text(devices: list[Any]) -> str:
        return ", ".join(f"{d.get('device')} ({d.get('backend')}, {(d.get('memory_total') or 0) // MIB} MiB)"
                         for d in devices if isinstance(d, dict)) or "no device"

    return (f"was tuned on {text(then)}, as the build listed them; it lists {text(now)} now: its placement and "
            "budgets are for those devices; tune again here")


def _with_nvml(devices: tuple[Device, ...], listed: tuple[ListedDevice, ...]) -> tuple[Device, ...]:
    if not any(d.profile.kind == "cuda" for d in devices):
        return devices
    from fitter.machine.snapshot import take_snapshot

    try:
        nvml = {d.name: d for d in take_snapshot().with_listing(listed).devices()}
    except FitterError:
        return devices  # NVML cannot tell which GPU is which: the build's figures alone
    return tuple(replace(d, overhead=nvml[d.name].overhead) if d.name in nvml else d for d in devices)


# -- what a binary reports of its build -----------------------------------------------------------------------


def server_build(binary: str) -> dict[str, str]:
    """The build the binary reports: its commit and version (`version_info`)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": "unknown", "source": f"{binary} --version failed"}
    version, commit = version_info(out.stdout + out.stderr)
    return {"commit": commit, "source": f"{Path(binary).name} --version", "version": version}


# `--version` as llama.cpp prints it: common/build-info.cpp.in at 0c1e570 (`version: %s (build %d, commit %s)`), and
# common/arg.cpp before it (`version: %d (%s)`, e.g. e3a74b2, llama-cpp-python 0.3.30's) — builds deployed today
_VERSION_NOW = re.compile(r"^version: (.*) \(build (\d+), commit (\S+)\)\s*$", re.M)
_VERSION_BEFORE = re.compile(r"^version: (\d+) \((\S+)\)\s*$", re.M)


def version_info(text: str) -> tuple[str, str]:
    """(version, commit) a llama.cpp binary's `--version` names; "unknown" for what it does not name."""
    if (m := _VERSION_NOW.search(text)) is not None:
        return f"{m.group(1)}, build {m.group(2)}", m.group(3)
    if (m := _VERSION_BEFORE.search(text)) is not None:
        return f"build {m.group(1)}", m.group(2)
    return "unknown", "unknown"


# ggml's backend libraries (ggml/src/ggml-<name>/) by the name their devices carry (CUDA0, ROCm0, Vulkan0, RPC0[…])
_BACKEND_NAMES = {"cpu": "CPU", "rpc": "RPC", "cuda": "CUDA", "hip": "ROCm", "vulkan": "Vulkan", "metal": "Metal",
                  "sycl": "SYCL", "opencl": "OpenCL", "musa": "MUSA", "cann": "CANN", "blas": "BLAS"}
_BACKEND_LIBRARY = re.compile(r"libggml-([a-z]+)(?:-[\w-]+)?\.so(?:\.[\d.]+)?")


def library_backends(folder: Path) -> set[str]:
    """The backends whose ggml libraries lie in a shared build's folder (libggml-vulkan.so → Vulkan), and the CPU."""
    found = {"CPU"}
    for f in folder.iterdir():
        if (m := _BACKEND_LIBRARY.fullmatch(f.name)) is not None and m.group(1) != "base":
            found.add(_BACKEND_NAMES.get(m.group(1), m.group(1)))
    return found


def build_backends(binary: str) -> list[str]:
    """The backends a build has: its ggml backend libraries beside the binary (a shared build), the devices it lists
    (`--list-devices`: a static build's GPUs; RPC servers are not listed without --rpc), and the CPU."""
    path = Path(binary).resolve()
    found = library_backends(path.parent)
    try:
        listed = list_devices(LlamaCppBuild(path.parent, path, None, None))
    except FitterError:
        listed = ()
    found.update(m.group(0) for d in listed if (m := re.match(r"[A-Za-z]+", d.name)) is not None)
    return sorted(found)


def binary_build(binary: str) -> dict[str, Any]:
    """`server_build`, the backends and the binary itself (results and exports name it: `--llama-cpp DIR`)."""
    return {**server_build(binary), "backends": build_backends(binary), "llama_server": str(Path(binary).resolve())}


def recorded_build_devices(machine: dict[str, Any], llama_cpp: dict[str, Any], binary: str,
                           source: str) -> tuple[Device, ...]:
    """The devices of the build a result was tuned through (`--llama-cpp DIR`: its machine record's
    `build_devices`), as the build lists them now; refused in one line (`source` first) when they or its backends
    are not those it was tuned on (`build_change`)."""
    devices, _ = devices_of_build(find_build(Path(binary).parent))
    change = build_change(machine, device_records(devices), llama_cpp.get("backends"), build_backends(binary))
    if change is not None:
        raise FitterError(f"{source} {change}")
    return devices
