"""A model with a draft model (-md) against what llama-server itself logged (tests/golden/draft.json on the CPU,
draft-rpc.json with the emulated GPU, draft-rpc2.json on two, where the draft's layers split by what the model
left free; scripts/make_draft_goldens.py). The model's buffers and the draft's are
compared apart, each as test_golden compares them (model, KV and output to the logged 0.01 MiB, compute within
5 %), and both contexts' parameters (slots, cells, batch sizes, logits reserved) exactly."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import ModelSpec, load_model_spec
from fitter.memory.backends.devices import CPU_AVX2
from fitter.memory.plan.estimator import MemoryPlan, estimate
from tests.memory.plan.test_golden import (
    MIB,
    _by_kind,
    assert_all_but_compute_exact,
    assert_compute_within_5_percent,
    device_target,
)
from tests.models import model_file

_DIR = Path(__file__).resolve().parents[2] / "golden"
GOLDENS = {p.stem: json.loads(p.read_text()) for p in (_DIR / "draft.json", _DIR / "draft-rpc.json",
                                                        _DIR / "draft-rpc2.json")}
CASES = [(name, c) for name, g in GOLDENS.items() for c in g["cases"]]
IDS = [f"{name}:{c['id']}" for name, c in CASES]


@cache
def _spec(model: str, draft: str) -> ModelSpec:
    return load_model_spec(str(model_file(model)), str(model_file(draft)))


@cache
def _plan(golden: str, case_id: str) -> MemoryPlan:
    case = next(c for c in GOLDENS[golden]["cases"] if c["id"] == case_id)
    flags, devices = device_target(GOLDENS[golden].get("device"),
                                   [*case["flags"], "-md", str(model_file(case["draft"])), "-fit", "off"])
    return estimate(_spec(case["model"], case["draft"]), parse_launch_flags(flags), devices, CPU_AVX2)


def _estimated(plan: MemoryPlan, model: str) -> dict[tuple[str, str], list[float]]:
    return _by_kind([(b.buft, b.kind, b.bytes / MIB) for b in plan.buffers if b.model == model])


def _logged(buffers: list[dict[str, Any]]) -> dict[tuple[str, str], list[float]]:
    return _by_kind([(b["buft"], b["kind"], b["mib"]) for b in buffers])


def test_every_case_loaded_and_logged_a_draft() -> None:
    assert len(CASES) == 69
    assert all(c["outcome"] == "ok" and c["draft_buffers"] for _, c in CASES)


@pytest.mark.parametrize(("golden", "case"), CASES, ids=IDS)
@pytest.mark.parametrize(("model", "logged"), [("", "buffers"), ("draft", "draft_buffers")], ids=["model", "draft"])
def test_model_kv_and_output_buffers_match_llama_server_exactly(golden: str, case: dict[str, Any], model: str,
                                                                logged: str) -> None:
    assert_all_but_compute_exact(_estimated(_plan(golden, case["id"]), model), _logged(case[logged]))


@pytest.mark.parametrize(("golden", "case"), CASES, ids=IDS)
@pytest.mark.parametrize(("model", "logged"), [("", "buffers"), ("draft", "draft_buffers")], ids=["model", "draft"])
def test_compute_buffers_within_5_percent(golden: str, case: dict[str, Any], model: str, logged: str) -> None:
    assert_compute_within_5_percent(_estimated(_plan(golden, case["id"]), model), _logged(case[logged]),
                                    "llama-server")


@pytest.mark.parametrize(("golden", "case"), CASES, ids=IDS)
def test_both_contexts_match_what_llama_server_made(golden: str, case: dict[str, Any]) -> None:
    plan = _plan(golden, case["id"])
    assert plan.draft is not None
    if case["id"] == "demo+gpt-oss/ngl-all":  # split by what is left free: not as the caps (-ts 1,1) would split it
        assert plan.draft.layer_devices != estimate(plan.model, replace(plan.config, tensor_split=(1.0, 1.0)),
                                                    plan.devices, CPU_AVX2).draft.layer_devices  # type: ignore[union-attr]
    for ctx, logged in ((plan.context, case["context"]), (plan.draft.context, case["draft_context"])):
        assert {"n_seq_max": ctx.n_seq_max, "n_ctx": ctx.n_ctx, "n_ctx_seq": ctx.n_ctx_seq, "n_batch": ctx.n_batch,
                "n_ubatch": ctx.n_ubatch, "n_outputs_max": ctx.n_outputs_max} == logged
