"""fitter.results.measurement: a recorded measurement, typed once, and the one VRAM rule behind every figure."""

from __future__ import annotations

import pytest

from fitter.results.measurement import MeasurementRecord, ResultError, device_peaks, round_avgs, speed, vram_bytes

MIB = 1024 * 1024
RECORDED = {"outcome": "ok", "reason": "", "emulated": True,
            "pp": {"avg_ts": 500.0, "stddev_ts": 4.0}, "tg": {"avg_ts": 100.0, "stddev_ts": 1.0},
            "tg_stream": {"avg_ts": 25.0}, "confirm": {"round_avg_ts": {"tg": [99.0, 101.0], "pp": [498, 502]}},
            "peak_vram": {"RPC0[127.0.0.1:5000]": {"bytes": 70 * MIB, "source": "emulator"}},
            "devices": {"RPC0[127.0.0.1:5000]": {"model": 60 * MIB, "total": 66 * MIB}, "CPU": {"total": 900 * MIB}}}


def test_a_record_types_what_commands_compute_with_and_keeps_the_rest() -> None:
    m = MeasurementRecord.from_json(RECORDED, "trial 3", "r/pareto.json")
    assert (m.ok, m.outcome, m.emulated, m.speeds, m.rounds) == (
        True, "ok", True, {"pp": 500.0, "tg": 100.0, "tg_stream": 25.0}, {"tg": [99.0, 101.0], "pp": [498.0, 502.0]})
    assert m.peaks == {"RPC0[127.0.0.1:5000]": (70 * MIB, "peak, emulator")} and m.vram_bytes == 70 * MIB
    assert m.logged_devices["CPU"] == {"total": 900 * MIB} and m.data is RECORDED
    assert m.speed("ttft") is None


def test_the_vram_rule_is_one_the_record_and_the_json_agree() -> None:
    # each device's own peak, else llama.cpp's logged device buffers; the CPU never
    logged_only = {**RECORDED, "peak_vram": {}}
    assert device_peaks(logged_only) == {"RPC0[127.0.0.1:5000]": (66 * MIB, "llama.cpp's buffers")}
    for data in (RECORDED, logged_only, {"outcome": "oom"}):
        summed = sum(b for b, _ in device_peaks(data).values())
        assert vram_bytes(data) == MeasurementRecord.of(data).vram_bytes == summed
    assert (speed(None, "tg"), round_avgs(None), vram_bytes(None)) == (None, {}, 0)


@pytest.mark.parametrize(("change", "message"), [
    ({"tg": {"avg_ts": "fast"}}, "r/pareto.json: trial 3: measurement.tg.avg_ts must be a finite number, got 'fast'"),
    ({"peak_vram": {"CUDA0": {"bytes": 1.5}}},
     "r/pareto.json: trial 3: measurement.peak_vram must be {device: {bytes: int}}, got {'CUDA0': {'bytes': 1.5}}"),
    ({"devices": {"RPC0[nowhere]": {"total": 1}}},
     "r/pareto.json: trial 3: measurement.devices must be named as llama.cpp names RPC devices, RPC<i>[HOST:PORT], "
     "got 'RPC0[nowhere]'"),
])
def test_a_damaged_record_is_one_error_naming_the_file_and_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(ResultError) as e:
        MeasurementRecord.from_json({**RECORDED, **change}, "trial 3", "r/pareto.json")
    assert str(e.value) == message
