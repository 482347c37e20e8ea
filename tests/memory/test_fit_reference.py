"""fitter fit against llama.cpp's own --fit (tests/golden/fit_reference.json, from scripts/llama_fit_reference.py).

For every case llama.cpp's fit answered on the capped emulated GPU, fitter's placement must fit the same budget and
leave no more device memory unused than llama.cpp's answer did when it was really loaded; and loaded on the emulated
GPU, fitter's placement must load and use exactly the memory it predicted.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from fitter.flags import parse_launch_flags, pin
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.devices import RPC, Device
from fitter.memory.fit import FitResult, fit
from tests.models import model_files

# 43 references of llama.cpp's own fit, each loaded on the emulated GPU: ~2 min:
# deselected by the default test command, run by .ci/run (pytest -m slow)
pytestmark = pytest.mark.slow

MIB = 1024 * 1024
REFERENCE = json.loads((Path(__file__).resolve().parents[1] / "golden" / "fit_reference.json").read_text())
CASES = {c["id"]: c for c in REFERENCE["cases"] if (c.get("load_server") or c.get("load"))}


def _caps(case: dict[str, Any]) -> list[int]:
    return case["cap_mib"] if isinstance(case["cap_mib"], list) else [case["cap_mib"]]


def _endpoints(case: dict[str, Any]) -> list[str]:
    return [f"127.0.0.1:{50052 + i}" for i in range(len(_caps(case)))]


@cache
def fitted(case_id: str) -> FitResult:
    case = CASES[case_id]
    m = REFERENCE["models"][case["model"]]
    spec = load_model_spec(str(model_files(m["shape"], m["sparse"], m["n_shards"])[0]))
    devices = tuple(Device(f"RPC0[{e}]", RPC, cap * MIB, cap * MIB) for e, cap in zip(_endpoints(case), _caps(case),
                                                                                       strict=True))
    config = parse_launch_flags([*case["flags"], "--rpc", ",".join(_endpoints(case))])
    return fit(spec, config, devices, (case["fit_target_mib"],), case.get("fit_ctx_min") or 4096)


def _device_total(result: FitResult) -> int:
    totals = result.plan.totals()
    return sum(totals[d.name].total for d in result.plan.devices)


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_fitter_leaves_no_more_device_memory_unused_than_llama_cpp_fit(case_id: str) -> None:
    case = CASES[case_id]
    result = fitted(case_id)
    assert result.fits
    totals = result.plan.totals()
    for d in result.plan.devices:
        assert totals[d.name].total <= result.budgets[d.name]
    llama_peak = (case.get("load_server") or case["load"])["device_peak_bytes"]
    assert _device_total(result) >= llama_peak


SMALL = sorted(i for i, c in CASES.items() if not REFERENCE["models"][c["model"]]["sparse"] and len(_caps(c)) == 1)


@pytest.mark.llama
@pytest.mark.parametrize("case_id", SMALL)
def test_fitter_placement_loads_on_the_capped_device_using_what_it_predicted(case_id: str) -> None:
    from fitter.measure.emulated_gpu import EmulatedGpu
    from fitter.measure.loader import load_and_capture

    case = CASES[case_id]
    result = fitted(case_id)
    m = REFERENCE["models"][case["model"]]
    with EmulatedGpu(_caps(case)[0]) as gpu:
        flags = pin(replace(result.config, rpc=(gpu.endpoint,)), result.plan.context)
        res = load_and_capture(str(model_files(m["shape"], m["sparse"], m["n_shards"])[0]), parse_launch_flags(flags))
        peak = gpu.stats().peak_bytes
    assert res.ok, res.error
    assert peak == _device_total(result)
