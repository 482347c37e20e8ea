"""A model with a vision projector (--mmproj) against what llama-server itself allocated (tests/golden/mmproj-cpu.json,
mmproj-rpc.json on the emulated GPU, mmproj-cuda-emulated.json on the CUDA-shaped one, mmproj-vulkan-emulated.json
on lavapipe; scripts/make_projector_goldens.py):
the model's buffers as test_golden has them, the projector's compute buffers to the logged 0.01 MiB on every
backend, its weights and compute per device as libmtmd's own probe counts them (unpadded bytes), and on an emulated
GPU the device's peak, every buffer on it, to the byte."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import ModelSpec, load_model_spec
from fitter.memory.backends.devices import CPU_AVX2
from fitter.memory.graph.clip_graph import clip_graph
from fitter.memory.plan.estimator import MemoryPlan, estimate
from fitter.memory.plan.mmproj import MODEL
from tests.memory.plan.test_golden import MIB, _by_kind, assert_all_but_compute_exact, device_target
from tests.models import model_file, projector_file

_DIR = Path(__file__).resolve().parents[2] / "golden"
GOLDENS = {p.stem: json.loads(p.read_text()) for p in sorted(_DIR.glob("mmproj-*.json"))}
CASES = [(name, c) for name, g in GOLDENS.items() for c in g["cases"]]
IDS = [f"{name}:{c['id']}" for name, c in CASES]


@cache
def _spec(model: str, projector: str) -> ModelSpec:
    return load_model_spec(str(model_file(model)), mmproj=str(projector_file(projector, model)))


@cache
def _plan(golden: str, case_id: str) -> MemoryPlan:
    case = next(c for c in GOLDENS[golden]["cases"] if c["id"] == case_id)
    mmproj = str(projector_file(case["projector"], case["model"]))
    flags, devices = device_target(GOLDENS[golden]["device"], [*case["flags"], "--mmproj", mmproj, "-fit", "off"])
    return estimate(_spec(case["model"], case["projector"]), parse_launch_flags(flags), devices, CPU_AVX2)


def test_the_goldens_cover_every_backend_the_projector_runs_on_here() -> None:
    assert {"mmproj-cpu", "mmproj-rpc", "mmproj-cuda-emulated", "mmproj-vulkan-emulated"} <= set(GOLDENS)
    assert all(c["outcome"] == "ok" and c["mmproj_compute"] for _, c in CASES)


@pytest.mark.parametrize(("golden", "case"), CASES, ids=IDS)
def test_the_models_own_buffers_are_unchanged_by_the_projector(golden: str, case: dict[str, Any]) -> None:
    plan = _plan(golden, case["id"])
    est = _by_kind([(b.buft, b.kind, b.bytes / MIB) for b in plan.buffers if b.model == ""])
    assert_all_but_compute_exact(est, _by_kind([(b["buft"], b["kind"], b["mib"]) for b in case["buffers"]]))


@pytest.mark.parametrize(("golden", "case"), CASES, ids=IDS)
def test_projector_compute_buffers_match_the_warm_up_to_the_logged_hundredth(golden: str,
                                                                               case: dict[str, Any]) -> None:
    plan = _plan(golden, case["id"])
    est = {b.buft: round(b.bytes / MIB, 2) for b in plan.buffers if b.model == MODEL and b.kind == "compute"}
    assert {k: v for k, v in est.items() if v > 0} == {b["buft"]: b["mib"] for b in case["mmproj_compute"]}


@pytest.mark.parametrize(("golden", "case"), CASES, ids=IDS)
def test_projector_weights_and_compute_per_device_match_libmtmds_probe(golden: str, case: dict[str, Any]) -> None:
    """The probe (mtmd_get_memory_usage) counts each weight's ggml_nbytes on its device, plus that device's compute
    buffer; the plan's weight buffer is the same tensors padded to the buffer's alignment. (fitter's own loader, the
    CUDA-shaped GPU's, runs no --fit and so no probe.)"""
    if not case["mmproj_probe"]:
        assert golden == "mmproj-cuda-emulated"
        return
    plan = _plan(golden, case["id"])
    spec = plan.model.projector
    assert spec is not None
    unpadded = sum(t.n_bytes for t in spec.tensors)
    probe: dict[str, float] = {}
    for b in plan.buffers:
        if b.model != MODEL:
            continue
        device = b.device.split("[")[0]  # the probe names a device as ggml does: RPC0, not its buffer type
        probe[device] = probe.get(device, 0.0) + (unpadded if b.kind == "model" else b.bytes)
        assert b.kind != "model" or unpadded <= b.bytes < unpadded + len(spec.tensors) * 128
    assert {k: round(v / MIB, 2) for k, v in probe.items() if v} == case["mmproj_probe"]


@pytest.mark.parametrize(("golden", "case"), [(n, c) for n, c in CASES if c["peaks"]],
                         ids=[f"{n}:{c['id']}" for n, c in CASES if c["peaks"]])
def test_the_emulated_gpus_peak_is_the_plans_device_total_to_the_byte(golden: str, case: dict[str, Any]) -> None:
    totals = _plan(golden, case["id"]).totals()
    assert {name: totals[name].total for name in case["peaks"]} == case["peaks"]


@pytest.mark.parametrize("case", GOLDENS["mmproj-cpu"]["cases"], ids=[c["id"] for c in GOLDENS["mmproj-cpu"]["cases"]])
def test_the_warm_up_graph_has_the_logged_node_count(case: dict[str, Any]) -> None:
    """On the CPU the scheduler runs the graph in one split, so its logged node count is the replay's own (clip.cpp
    reserve_compute_meta: "graph splits = 1, nodes = N")."""
    spec = _spec(case["model"], case["projector"]).projector
    assert spec is not None
    assert len(clip_graph(spec, case["mmproj_flash_attn"]).nodes) == case["mmproj_nodes"]
