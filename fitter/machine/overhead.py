"""The overhead NVML measured on this machine's GPUs, kept between commands: per machine fingerprint, NVIDIA driver
and GPU (`fitter_home()/overhead.json`), the largest seen. Read when a command builds this machine's devices, so
the estimate, fit and tune budgets use what this machine showed instead of fitter.memory.overhead's default."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fitter.machine.nvidia import GpuInfo
from fitter.memory.overhead import Overhead, default_overhead, measured_overhead, sm_count
from fitter.paths import fitter_home

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


def record(fingerprint: str, driver: str | None, gpu: str, nbytes: int, where: str) -> None:
    """Keep the largest overhead seen for this GPU of this machine and driver (written whole, then renamed)."""
    data = _read()
    key = _key(fingerprint, driver, gpu)
    old = data.get(key) or {}
    if isinstance(old.get("bytes"), int) and old["bytes"] >= nbytes:
        return
    data[key] = {"bytes": int(nbytes), "where": where}
    path = _path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def overhead_for(gpu: GpuInfo, fingerprint: str | None, driver: str | None) -> Overhead:
    """What this machine measured for the GPU, else the default for its class."""
    if fingerprint:
        seen = _read().get(_key(fingerprint, driver, gpu.uuid or gpu.name)) or {}
        if isinstance(seen.get("bytes"), int):
            return measured_overhead(seen["bytes"], str(seen.get("where") or "an earlier trial"))
    return default_overhead(gpu.name, gpu.compute_capability, sm_count(gpu.cuda_cores, gpu.compute_capability))


def record_measurement(measurement: dict[str, Any], gpus: tuple[GpuInfo, ...], fingerprint: str,
                       driver: str | None, where: str) -> None:
    """Keep the overhead a measurement (`fitter bench --json` shape) saw on this machine's GPUs: its devices'
    `overhead`, NVML's peak beyond the buffers llama.cpp logged there."""
    by_name = {f"CUDA{g.index}": g for g in gpus}
    for name, device in (measurement.get("devices") or {}).items():
        nbytes = device.get("overhead")
        if name in by_name and isinstance(nbytes, int) and nbytes >= 0:
            gpu = by_name[name]
            record(fingerprint, driver, gpu.uuid or gpu.name, nbytes, where)
