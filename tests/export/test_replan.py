"""fitter.export.replan and `fitter export` for another program: the pick is re-planned, what changed is said, and a
plan over the recorded budget is refused with the excess."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fitter.cli import main
from fitter.export.launchers import pick
from fitter.export.replan import measured_devices, recorded_budgets, replan
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.results.pareto import ParetoDoc
from fitter.units import MIB
from tests.models import model_files

RPC = "RPC0[127.0.0.1:50052]"
# gpt-oss-20b's shape (header only: 201088-token vocabulary), experts on the CPU, the rest on the emulated GPU
FLAGS = ["-c", "8192", "-b", "2048", "-ub", "2048", "-ctk", "f16", "-ctv", "f16", "-fa", "on", "-np", "4",
         "--kv-unified", "-ngl", "all", "-cmoe", "--rpc", "127.0.0.1:50052", "-fit", "off", "-t", "1", "-tb", "1"]


def _model() -> Path:
    return model_files("gpt-oss-20b", sparse=True)[0]


def _doc(model: Path, budget_mib: int | None, **extra: Any) -> dict[str, Any]:
    m = {"outcome": "ok", "reason": "", "emulated": True, "backend": "llama-cpp-python",
         "pp": {"n": 512, "avg_ts": 900.0, "stddev_ts": 9.0, "samples_ts": [900.0]},
         "tg": {"n": 128, "depth": 0, "avg_ts": 300.0, "stddev_ts": 3.0, "samples_ts": [300.0]},
         "devices": {"CPU": {"total": 22011204128}, RPC: {"total": 1785775872}}, "peak_vram": {}}
    spec = load_model_spec(str(model))
    doc = {"model": {"path": str(model), "name": model.stem, "identity": spec.identity},
           "machine": {"gpus": [], "emulated_gpu_mib": 2064}, "llama_cpp": {"commit": "0c1e570"},
           "objectives": ["tg", "pp"], "fit_target_mib": [16], "emulated": True,
           "baseline": {"name": "llama.cpp --fit", "flags": None, "measurement": None},
           "pareto": [{"trial": 3, "flags": FLAGS, "measurement": m}], "picks": {"balanced": 3}, **extra}
    if budget_mib is not None:
        doc["budgets"] = {"devices": {RPC: budget_mib * MIB}, "host": None}
    return doc


def test_the_c_api_reserves_logits_for_a_ubatch_so_the_python_plan_grows() -> None:
    model = _model()
    doc = ParetoDoc.from_json(_doc(model, 2048), "r/pareto.json")
    entry = doc.pareto[0]
    plan = replan(doc, entry, parse_launch_flags(FLAGS[:-4]), "llama-cpp-python", load_model_spec(str(model)))
    # 201088 logits × 2048 outputs × 4 B = 1571 MiB more on the device that holds the output layer
    assert plan.changes == (
        "n_outputs_max 4 → 2048",
        "CPU 20991.52 → 20991.53 MiB (compute 357.08 → 357.09)",
        f"{RPC} 1703.05 → 3110.02 MiB (compute 209.04 → 1616.01)",
    )
    assert plan.over == {RPC: 3261089536 - 2048 * MIB}
    assert plan.config.consumer == "llama-cpp-python"
    roomy = ParetoDoc.from_json(_doc(model, 3200), "r/pareto.json")
    assert replan(roomy, entry, parse_launch_flags(FLAGS[:-4]), "llama-cpp-python",
                  load_model_spec(str(model))).fits


def test_budgets_of_results_written_before_they_were_recorded() -> None:
    doc = ParetoDoc.from_json(_doc(_model(), None), "r/pareto.json")
    assert measured_devices(doc.pareto[0])[0].name == RPC
    assert recorded_budgets(doc) == {RPC: (2064 - 16) * MIB}  # the emulated cap less the fit target


def _write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    (tmp_path / "pareto.json").write_text(json.dumps(doc))
    return tmp_path


def test_export_for_another_program_says_what_changed_and_refuses_over_budget(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = _write(tmp_path, _doc(_model(), 2048))
    assert main(["export", str(result), "--format", "python"]) == 2
    err = capsys.readouterr().err
    assert "re-planned for llama-cpp-python (tuned for llama-server): n_outputs_max 4 → 2048" in err
    assert err.strip().endswith(f"the balanced pick (trial 3) run by llama-cpp-python is over the budget it was "
                                f"tuned under: {RPC} by 1062.02 MiB; tune with --for llama-cpp-python, or --force to "
                                "print it anyway")
    assert main(["export", str(result), "--format", "python", "--force"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["replanned"].startswith("re-planned for llama-cpp-python (tuned for llama-server): n_outputs_max")
    assert out["kwargs"]["n_batch"] == 2048
    # a server line from a server result: nothing re-planned
    assert main(["export", str(result), "--format", "server"]) == 0
    assert "re-planned" not in capsys.readouterr().out


def test_export_format_and_program_must_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = _write(tmp_path, _doc(_model(), 2048))
    assert main(["export", str(result), "--format", "server", "--for", "llama-cpp-python"]) == 2
    assert "that format is read by llama-server" in capsys.readouterr().err


def test_a_result_tuned_for_python_exports_for_python_without_a_replan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = _write(tmp_path, _doc(_model(), 2048, **{"for": "llama-cpp-python"}))
    assert main(["export", str(result), "--format", "python"]) == 0
    captured = capsys.readouterr()
    assert "re-planned" not in captured.err and "replanned" not in json.loads(captured.out)


def test_a_re_plan_whose_recorded_model_is_gone_names_the_result(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # found by tests/results/test_pareto_properties.py: the message named only the model path the result gave
    doc = _doc(_model(), 2048)
    doc["model"]["path"] = str(tmp_path / "gone.gguf")
    result = _write(tmp_path, doc)
    assert main(["export", str(result), "--format", "python"]) == 2
    assert capsys.readouterr().err == (
        f"fitter: error: {tmp_path}/gone.gguf: no such file; re-planning for another program needs the header of "
        f"the model {result / 'pareto.json'} was tuned on: give --model PATH\n")


def test_a_vulkan_result_is_re_planned_on_its_vulkan_device_with_vulkans_rules() -> None:
    model = _model()
    raw = _doc(model, 2048)
    entry = raw["pareto"][0]
    entry["flags"] = [f for f in FLAGS if f not in ("--rpc", "127.0.0.1:50052")]
    logged = entry["measurement"]["devices"]
    entry["measurement"]["devices"] = {"CPU": logged["CPU"], "Vulkan0": logged[RPC]}
    raw["budgets"] = {"devices": {"Vulkan0": 2048 * MIB}, "host": None}
    raw["machine"] = {"gpus": [], "emulated_gpu_mib": 2064, "emulated_gpu_kind": "vulkan", "model_devices": ["Vulkan0"]}
    doc = ParetoDoc.from_json(raw, "r/pareto.json")
    p = pick(doc, "balanced")
    assert p.config.device_names == ("Vulkan0",)  # the export pins the device the trials used
    (device,) = measured_devices(doc.pareto[0], doc, p.config.device_names)
    assert (device.name, device.profile.kind, device.profile.host_buft) == ("Vulkan0", "vulkan", "Vulkan_Host")
    plan = replan(doc, p.entry, p.config, "llama-cpp-python", load_model_spec(str(model)))
    assert plan.changes == ("n_outputs_max 4 → 2048", "CPU 11039.49 → 11039.50 MiB (compute 87.08 → 87.09)",
                            "Vulkan0 1927.52 → 3498.52 MiB (compute 433.51 → 2004.51)")
    assert plan.over == {"Vulkan0": 1285605120}
