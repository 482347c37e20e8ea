"""A measurement as fitter records it (`fitter bench --json`'s shape, in pareto.json, the study's trials and a
landscape's runs), typed where commands compute with it, and the one VRAM rule.

VRAM, everywhere fitter reports or optimizes it, is what the devices measured: the peak each device reached during
the run (its own counter: NVML's per-process accounting, the emulated GPU's cap counter, the simulated machine),
summed over devices; where no device counted (no NVML, CPU only), the device buffers llama.cpp logged. Never the
estimate.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from fitter.errors import FitterError, LaunchConfigError
from fitter.measure.bench_table import bench_json
from fitter.measure.types import TrialResult
from fitter.memory.backends.devices import rpc_devices


def measurement_json(result: TrialResult, backend: str, plan: Any, emulated: bool) -> dict[str, Any]:
    """A trial's measurement as pareto.json, the study and a landscape record it (`fitter bench --json`'s shape)."""
    return bench_json(result.measurement, backend, plan, emulated=emulated, peak_vram=result.peak_vram)


def device_peaks(measurement: dict[str, Any] | None) -> dict[str, tuple[int, str]]:
    """Each accelerator's measured memory and where the number comes from: its own peak (NVML, the emulator, the
    simulated machine), else llama.cpp's logged buffers. The VRAM rule, per device."""
    m = measurement or {}
    peak = m.get("peak_vram") or {}
    if peak:
        return {name: (int(p["bytes"]), f"peak, {p.get('source', '?')}") for name, p in peak.items()}
    return {name: (int(d["total"]), "llama.cpp's buffers") for name, d in (m.get("devices") or {}).items()
            if name != "CPU" and "total" in d}


def vram_bytes(measurement: dict[str, Any] | None) -> int:
    """A measurement's VRAM (see the module docstring): its devices' measured memory, summed."""
    return sum(b for b, _ in device_peaks(measurement).values())


def speed(measurement: dict[str, Any] | None, key: str) -> float | None:
    """The average t/s of `pp`, `tg` or `tg_stream`; None when the measurement has none (a failed outcome)."""
    value = ((measurement or {}).get(key) or {}).get("avg_ts")
    return float(value) if isinstance(value, int | float) else None


def round_avgs(measurement: dict[str, Any] | None) -> dict[str, list[float]]:
    """Per-round averages of a confirmed measurement (fitter.tune.confirm.pooled); empty for one without rounds (a
    single run, or a result written before confirm runs were interleaved)."""
    confirm = (measurement or {}).get("confirm")
    raw = confirm.get("round_avg_ts") if isinstance(confirm, dict) else None
    if not isinstance(raw, dict):
        return {}
    return {k: [float(x) for x in v] for k, v in raw.items()
            if isinstance(v, list) and v and all(isinstance(x, int | float) for x in v)}


@dataclass(frozen=True)
class MeasurementRecord:
    """A recorded measurement: what commands compute with, typed, and the JSON as written (`data`) for the rest
    (buffers, per-depth speeds, the build, a draft's acceptance)."""

    outcome: str  # ok | oom | crash | timeout | …
    reason: str
    speeds: dict[str, float]  # average t/s of each test measured: pp, tg and, with streams, tg_stream
    rounds: dict[str, list[float]]  # each speed's confirm rounds' averages (empty: one run)
    peaks: dict[str, tuple[int, str]]  # each accelerator's measured memory and its source (the VRAM rule)
    emulated: bool  # measured on fitter's emulated GPU
    data: dict[str, Any] = field(compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def vram_bytes(self) -> int:
        return sum(b for b, _ in self.peaks.values())

    def speed(self, key: str) -> float | None:
        return self.speeds.get(key)

    @property
    def logged_devices(self) -> dict[str, dict[str, Any]]:
        """llama.cpp's logged buffers by device (`{"CUDA0": {"model": …, "total": …}}`)."""
        return dict(self.data.get("devices") or {})

    @staticmethod
    def of(data: dict[str, Any]) -> MeasurementRecord:
        """A measurement fitter wrote (a study's trial, a run just measured): read, not checked."""
        return MeasurementRecord(
            outcome=str(data.get("outcome") or ""), reason=str(data.get("reason") or ""),
            speeds={k: s for k in ("pp", "tg", "tg_stream") if (s := speed(data, k)) is not None},
            rounds=round_avgs(data), peaks=device_peaks(data), emulated=bool(data.get("emulated")), data=data)

    @staticmethod
    def from_json(data: dict[str, Any], where: str, source: str) -> MeasurementRecord:
        """A measurement read from a file: speeds, confirm rounds and VRAM as fitter writes them, so a hand-edited or
        damaged file fails here with the field (`source: where: measurement.<part> must be …`), not later in a
        command's arithmetic."""
        check_measurement(data, where, source)
        return MeasurementRecord.of(data)


class ResultError(FitterError):
    """A recorded result (pareto.json, a measurement in it) fitter cannot use: `source` is the file, `reason` what is
    wrong with it."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source, self.reason = source, reason


def finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def shown(value: Any) -> str:
    text = repr(value)  # one line, whatever the file holds
    return text if len(text) <= 80 else text[:77] + "..."


def check_measurement(m: dict[str, Any], where: str, source: str) -> None:
    """The parts of a measurement the commands compute with, checked once (see MeasurementRecord.from_json)."""
    def need(ok: bool, part: str, rule: str, value: Any) -> None:
        if not ok:
            raise ResultError(source, f"{where}: measurement.{part} must be {rule}, got {shown(value)}")

    def obj(part: str, value: Any) -> dict[str, Any]:
        need(value is None or isinstance(value, dict), part, "an object", value)
        return value or {}

    for key in ("pp", "tg"):
        for k, v in obj(key, m.get(key)).items():
            if k in ("avg_ts", "stddev_ts"):
                need(finite(v), f"{key}.{k}", "a finite number", v)
            elif k in ("n", "depth"):
                need(isinstance(v, int) and not isinstance(v, bool), f"{key}.{k}", "an integer", v)
            elif k == "samples_ts":
                need(isinstance(v, list) and all(map(finite, v)), f"{key}.{k}", "a list of finite numbers", v)
    rounds = obj("confirm.round_avg_ts", obj("confirm", m.get("confirm")).get("round_avg_ts"))
    for k, v in rounds.items():
        need(isinstance(v, list) and all(map(finite, v)), f"confirm.round_avg_ts.{k}", "a list of finite numbers", v)
    for name, peak in obj("peak_vram", m.get("peak_vram")).items():
        need(isinstance(peak, dict) and isinstance(peak.get("bytes"), int), "peak_vram", "{device: {bytes: int}}",
             {name: peak})
    for name, d in obj("devices", m.get("devices")).items():
        need(isinstance(d, dict) and isinstance(d.get("total", 0), int), "devices", "{device: {total: int}}",
             {name: d})
        rpc = re.fullmatch(r"RPC\d+\[(.+)\]", name)  # a re-plan rebuilds the RPC device from its endpoint
        need(rpc is None or _endpoint(rpc.group(1)), "devices", "named as llama.cpp names RPC devices, "
             "RPC<i>[HOST:PORT]", name)
    obj("llama_cpp", m.get("llama_cpp"))


def _endpoint(text: str) -> bool:
    try:
        rpc_devices([text])
    except LaunchConfigError:
        return False
    return True
