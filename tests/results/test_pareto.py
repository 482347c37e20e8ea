"""fitter.results.pareto: the one loader of pareto.json, its typed entries, and the one definition of VRAM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitter.errors import FitterError
from fitter.results.measurement import MeasurementRecord, vram_bytes
from fitter.results.pareto import Entry, ParetoDoc, load_result, ratios

MIB = 1024 * 1024


def test_vram_is_the_devices_measured_peak_else_their_logged_buffers_never_the_estimate() -> None:
    devices = {"CUDA0": {"total": 70 * MIB, "estimated_total": 60 * MIB}, "CPU": {"total": 900 * MIB}}
    peak = {"CUDA0": {"bytes": 75 * MIB, "source": "nvml"}, "CUDA1": {"bytes": 5 * MIB, "source": "nvml"}}
    assert vram_bytes({"peak_vram": peak, "devices": devices}) == 80 * MIB  # every device's peak, summed
    assert vram_bytes({"peak_vram": {}, "devices": devices}) == 70 * MIB  # no counter: the logged device buffers
    assert vram_bytes({"devices": {"CPU": {"total": 900 * MIB}}}) == 0  # CPU only
    assert vram_bytes(None) == 0


def _doc(**extra: object) -> dict[str, object]:
    m = {"outcome": "ok", "pp": {"avg_ts": 500.0}, "tg": {"avg_ts": 100.0}}
    return {"model": {"path": "/m.gguf"}, "pareto": [{"trial": 3, "flags": ["-c", "4096"], "measurement": m,
                                                      "vram_bytes": 5 * MIB, "phase": "tpe"}],
            "baseline": {"name": "llama.cpp --fit", "flags": None, "measurement": None}, "picks": {"balanced": 3},
            **extra}


def test_entries_are_typed_over_the_document_as_written() -> None:
    doc = ParetoDoc.from_json(_doc(), "r/pareto.json")
    (e,) = doc.pareto
    assert (e.trial, e.flags, e.vram_bytes, e.phase, e.speed("tg")) == (3, ("-c", "4096"), 5 * MIB, "tpe", 100.0)
    assert doc.entry("balanced") is e and e.data["phase"] == "tpe" and not doc.baseline.ok
    assert doc.fit_targets() == () and doc.model == {"path": "/m.gguf"}


@pytest.mark.parametrize(("data", "message"), [
    ([], "r/pareto.json: expected a JSON object written by `fitter tune`"),
    ({"picks": {}}, 'r/pareto.json: no "pareto" list; is this a pareto.json written by `fitter tune`?'),
    (_doc(pareto=[{"trial": 1, "flags": "-c 4096"}]),
     "r/pareto.json: trial 1: \"flags\" must be a list of strings, got '-c 4096'"),
])
def test_a_document_fitter_cannot_use_is_one_error_naming_the_file(data: object, message: str) -> None:
    with pytest.raises(FitterError) as e:
        ParetoDoc.from_json(data, "r/pareto.json")
    assert str(e.value) == message


def test_fit_targets_must_be_integers() -> None:
    with pytest.raises(FitterError) as e:
        ParetoDoc.from_json(_doc(fit_target_mib=["16"]), "r/pareto.json").fit_targets()
    assert str(e.value) == "r/pareto.json: \"fit_target_mib\" must be a list of integers (MiB), got ['16']"


def test_load_result_takes_the_folder_or_the_file(tmp_path: Path) -> None:
    (tmp_path / "pareto.json").write_text(json.dumps(_doc()))
    assert load_result(tmp_path).source == load_result(tmp_path / "pareto.json").source == str(tmp_path / "pareto.json")
    (tmp_path / "pareto.json").write_text("{")
    with pytest.raises(FitterError, match=r"pareto\.json: not valid JSON \(Expecting property name"):
        load_result(tmp_path)
    with pytest.raises(FitterError, match=r"nope/pareto\.json: cannot read the tuning result: No such file"):
        load_result(tmp_path / "nope" / "pareto.json")


def test_ratios_are_over_an_ok_baseline_only() -> None:
    base = {"outcome": "ok", "pp": {"avg_ts": 400.0}, "tg": {"avg_ts": 80.0}}
    m = {"outcome": "ok", "pp": {"avg_ts": 500.0}, "tg": {"avg_ts": 100.0}}
    assert ratios(m, base) == {"pp": 1.25, "tg": 1.25}
    assert ratios(m, {**base, "outcome": "oom"}) == ratios(m, None) == {"pp": None, "tg": None}
    assert Entry(1, None, MeasurementRecord.of(m)).ok


def _measured(**fields: object) -> dict[str, object]:
    """_doc() whose entry's measurement has `fields` too."""
    doc = _doc()
    doc["pareto"][0]["measurement"] = {"outcome": "ok", **fields}  # type: ignore[index]
    return doc


# Found by tests/results/test_pareto_properties.py; the old failure of each in a command that reads the result.
@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_doc(model=True), '"model" must be an object, got True'),  # TypeError in ParetoDoc.model
        (_doc(dropped=[[1.0]]), '"dropped" must be a list of objects, got [[1.0]]'),  # AttributeError in report
        ({**_doc(), "pareto": [{"trial": 3, "ratios": [1]}]},
         'trial 3: "ratios" must map tg/pp to a number, got [1]'),  # TypeError in Entry.from_json
        ({**_doc(), "pareto": [{"trial": 3, "vram_bytes": float("nan")}]},
         'trial 3: "vram_bytes" must be a number of bytes, got nan'),  # ValueError: int(nan)
        (_measured(pp=True), "trial 3: measurement.pp must be an object, got True"),  # AttributeError in speed()
        (_measured(peak_vram={"CUDA0": {}}),
         "trial 3: measurement.peak_vram must be {device: {bytes: int}}, got {'CUDA0': {}}"),  # KeyError: 'bytes'
        (_measured(confirm={"round_avg_ts": {"tg": [1.0, float("inf")]}}),
         "trial 3: measurement.confirm.round_avg_ts.tg must be a list of finite numbers, got [1.0, inf]"),  # stdev
        (_measured(devices={"RPC0[x]": {"total": 1}}),
         "trial 3: measurement.devices must be named as llama.cpp names RPC devices, RPC<i>[HOST:PORT], got "
         "'RPC0[x]'"),  # a re-plan's LaunchConfigError "--rpc 'x': expected HOST:PORT", naming no file
    ],
    ids=["model", "dropped", "ratios", "vram", "speed", "peak", "rounds", "rpc-name"],
)
def test_what_the_commands_compute_with_is_checked_once_by_the_loader(data: object, message: str) -> None:
    with pytest.raises(FitterError) as e:
        ParetoDoc.from_json(data, "r/pareto.json")
    assert str(e.value) == f"r/pareto.json: {message}"


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"pareto": [' + "9" * 4301 + "]}", "an integer of more than 4300 digits"),  # was ValueError
        ("[" * 100_000, "arrays or objects nested too deeply"),  # was RecursionError
    ],
)
def test_json_python_cannot_hold_is_one_error(tmp_path: Path, text: str, reason: str) -> None:
    (tmp_path / "pareto.json").write_text(text)
    with pytest.raises(FitterError) as e:
        load_result(tmp_path)
    assert str(e.value) == f"{tmp_path}/pareto.json: not a result fitter can read ({reason})"
