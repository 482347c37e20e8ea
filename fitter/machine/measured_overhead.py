"""The overhead NVML measured on this machine's GPUs, kept between commands: per machine fingerprint, NVIDIA driver
and GPU (`fitter_home()/overhead.json`), the largest seen. Read when a command builds this machine's devices, so
the estimate, fit and tune budgets use what this machine showed instead of fitter.memory.backends.overhead's default."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fitter.machine.nvidia import GpuInfo
from fitter.memory.backends.overhead import Overhead, default_overhead, measured_overhead, sm_count
from fitter.paths import WriteError, fitter_home, write_atomic

FILE = "overhead.json"


def _path() -> Path:
    return fitter_home() / FILE


def _key(fingerprint: str, driver: str | None, gpu: str) -> str:
    return f"{fingerprint}|{driver or 'no-driver'}|{gpu}"


def _read() -> dict[str, Any]:
    try:
        data = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: the defaults stand, and the next measurement rewrites it
    return data if isinstance(data, dict) else {}


def _entry(data: dict[str, Any], key: str) -> int | None:
    seen = data.get(key)
    return seen["bytes"] if isinstance(seen, dict) and isinstance(seen.get("bytes"), int) else None


def record(fingerprint: str, driver: str | None, gpu: str, nbytes: int, where: str) -> None:
    """Keep the largest overhead seen for this GPU of this machine and driver (written to a temporary file of its
    own, then renamed: concurrent commands never see half a file). OSError when fitter's home cannot be written."""
    data = _read()
    key = _key(fingerprint, driver, gpu)
    old = _entry(data, key)
    if old is not None and old >= nbytes:
        return
    data[key] = {"bytes": int(nbytes), "where": where}
    path = _path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def overhead_for(gpu: GpuInfo, fingerprint: str | None, driver: str | None) -> Overhead:
    """What this machine measured for the GPU, else the default for its class."""
    if fingerprint:
        data = _read()
        key = _key(fingerprint, driver, gpu.uuid or gpu.name)
        nbytes = _entry(data, key)
        if nbytes is not None:
            return measured_overhead(nbytes, str(data[key].get("where") or "an earlier trial"))
    return default_overhead(gpu.name, gpu.compute_capability, sm_count(gpu.cuda_cores, gpu.compute_capability))


def record_measurements(measurements: Iterable[tuple[dict[str, Any], str]], gpus: tuple[GpuInfo, ...],
                        fingerprint: str, driver: str | None) -> str | None:
    """Keep the largest overhead measurements (`fitter bench --json` shape, each with where it was taken) saw on
    this machine's GPUs (`gpus`: in llama.cpp's CUDA order, CUDA0 first, as MachineSnapshot.gpu_order gives them):
    their devices' `overhead`, NVML's peak beyond the buffers llama.cpp logged there; the file is written once per
    GPU, not once per measurement. Returns why it could not be kept (a fitter home that cannot be written), else
    None: the measurements themselves are never lost to this."""
    by_name = {f"CUDA{i}": g for i, g in enumerate(gpus)}
    largest: dict[str, tuple[int, str]] = {}
    for measurement, where in measurements:
        for name, device in (measurement.get("devices") or {}).items():
            nbytes = device.get("overhead")
            if name in by_name and isinstance(nbytes, int) and nbytes >= largest.get(name, (0, ""))[0]:
                largest[name] = (nbytes, where)
    for name, (nbytes, where) in largest.items():
        gpu = by_name[name]
        try:
            record(fingerprint, driver, gpu.uuid or gpu.name, nbytes, where)
        except OSError as e:
            return f"could not keep the measured overhead in {_path()}: {e.strerror or e}"
        except WriteError as e:
            return f"could not keep the measured overhead: {e}"
    return None
