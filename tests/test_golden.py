"""The estimator against buffers llama.cpp itself logged (tests/golden/cpu.json, from scripts/make_goldens.py).

Model, KV and output buffers must match to the logged 0.01 MiB. Cases marked
held_out were never looked at while writing the estimator's rules: they are the check that the rules generalise.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from fitter.devices import CPU_AVX2
from fitter.errors import LaunchConfigError
from fitter.estimator import estimate
from fitter.launch_config import parse_launch_flags
from fitter.model_spec import ModelSpec, load_model_spec
from tests.models import model_files

GOLDEN = json.loads((Path(__file__).parent / "golden" / "cpu.json").read_text())
MIB = 1024 * 1024
CASES = [c for c in GOLDEN["cases"] if c["outcome"] == "ok"]
_specs: dict[str, ModelSpec] = {}


def _spec(model: str) -> ModelSpec:
    if model not in _specs:
        m = GOLDEN["models"][model]
        _specs[model] = load_model_spec(str(model_files(m["shape"], m["sparse"], m["n_shards"])[0]))
    return _specs[model]


def _by_kind(buffers: list[tuple[str, str, float]]) -> dict[tuple[str, str], list[float]]:
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for buft, kind, mib in buffers:
        out[(buft, kind)].append(mib)
    return dict(out)


def estimated(case: dict[str, Any]) -> dict[tuple[str, str], list[float]]:
    plan = estimate(_spec(case["model"]), parse_launch_flags(case["flags"]), (), CPU_AVX2)
    return _by_kind([(b.buft, b.kind, b.bytes / MIB) for b in plan.buffers])


def logged(case: dict[str, Any]) -> dict[tuple[str, str], list[float]]:
    return _by_kind([(b["buft"], b["kind"], b["mib"]) for b in case["buffers"]])


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_model_kv_and_output_buffers_match_llama_cpp_exactly(case: dict[str, Any]) -> None:
    est, gold = estimated(case), logged(case)
    exact = {k: v for k, v in gold.items() if k[1] != "compute"}
    assert {k: [round(x, 2) for x in v] for k, v in est.items() if k[1] != "compute"} == exact
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_compute_buffer_within_5_percent(case: dict[str, Any]) -> None:
    est, gold = estimated(case), logged(case)
    (e,), (g,) = est[("CPU", "compute")], gold[("CPU", "compute")]
    assert abs(e - g) <= 0.05 * g, f"estimated {e:.2f} MiB, llama.cpp {g:.2f} MiB ({(e - g) / g:+.1%})"


ERRORS = [c for c in GOLDEN["cases"] if c["outcome"] == "error"]


@pytest.mark.parametrize("case", ERRORS, ids=[c["id"] for c in ERRORS])
def test_configs_llama_cpp_refused_are_refused_before_loading(case: dict[str, Any]) -> None:
    with pytest.raises(LaunchConfigError):
        estimate(_spec(case["model"]), parse_launch_flags(case["flags"]), (), CPU_AVX2)
