"""fitter.tune.result: the one loader of pareto.json, its typed entries, and the one definition of VRAM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fitter.errors import FitterError
from fitter.tune.result import Entry, ParetoDoc, load_result, ratios, vram_bytes

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
    assert Entry(1, None, m).ok
