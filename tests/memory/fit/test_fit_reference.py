"""fitter fit against llama.cpp's own --fit (tests/golden/fit_reference.json, from scripts/llama_fit_reference.py).

For every case llama.cpp's fit answered on the capped emulated GPU(s), fitter's placement must fit the same budgets
and leave no more device memory unused than llama.cpp's answer did when it was really loaded; and loaded on the
emulated GPU(s), fitter's placement must load and use exactly the memory it predicted, device by device.

On two or three devices also (the cases whose placement the script did not load included):
- fitter puts at least as many bytes on the devices as llama.cpp's placement, under llama-server's outputs and
  under llama-fit-params' own (n_outputs_max 0 = n_batch, what llama.cpp's fit projects), llama.cpp's placement
  being estimated by fitter's estimator, which equals each device's loaded peak where the script loaded it and
  llama.cpp's own projection (MiB, floored) everywhere;
- every device is left at most one layer's experts beyond its target, unless every expert tensor of its layers is
  already on it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from fitter.flags import LaunchConfig, TensorOverride, parse_launch_flags, pin
from fitter.gguf.model_spec import ModelSpec, Role, load_model_spec
from fitter.memory.backends.devices import RPC, Device
from fitter.memory.fit.fit import FitResult, fit
from fitter.memory.plan.estimator import MemoryPlan, estimate
from tests.models import model_files

# 56 references of llama.cpp's own fit (13 on two or three devices), 52 loaded on the emulated GPU(s): ~2.5 min:
# deselected by the default test command, run by .ci/run (pytest -m slow)
pytestmark = pytest.mark.slow

MIB = 1024 * 1024
REFERENCE = json.loads((Path(__file__).resolve().parents[2] / "golden" / "fit_reference.json").read_text())
CANONICAL_PORT = 50052  # scripts/llama_fit_reference.py CANONICAL_PORTS: endpoint i is 127.0.0.1:50052+i
ALL = {c["id"]: c for c in REFERENCE["cases"]}
CASES = {i: c for i, c in ALL.items() if (c.get("load_server") or c.get("load"))}
CONSUMERS = ("llama-server", "llama-fit-params")


def _caps(case: dict[str, Any]) -> list[int]:
    return case["cap_mib"] if isinstance(case["cap_mib"], list) else [case["cap_mib"]]


def _targets(case: dict[str, Any]) -> tuple[int, ...]:
    t = case["fit_target_mib"]
    return tuple(t) if isinstance(t, list) else (t,)


def _endpoints(case: dict[str, Any]) -> list[str]:
    return [f"127.0.0.1:{CANONICAL_PORT + i}" for i in range(len(_caps(case)))]


MULTI = sorted(i for i, c in ALL.items() if len(_caps(c)) > 1 and c["llama_fit"]["status"] == "ok")


@cache
def _spec(model: str) -> ModelSpec:
    m = REFERENCE["models"][model]
    return load_model_spec(str(model_files(m["shape"], m["sparse"], m["n_shards"])[0]))


def _devices(case: dict[str, Any]) -> tuple[Device, ...]:
    return tuple(Device(f"RPC0[{e}]", RPC, cap * MIB, cap * MIB) for e, cap in zip(_endpoints(case), _caps(case),
                                                                                   strict=True))


def _config(case: dict[str, Any], extra: list[str], consumer: str) -> LaunchConfig:
    return parse_launch_flags([*case["flags"], *extra, "--rpc", ",".join(_endpoints(case))], consumer=consumer)


@cache
def fitted(case_id: str, consumer: str = CONSUMERS[0]) -> FitResult:
    case = ALL[case_id]
    return fit(_spec(case["model"]), _config(case, [], consumer), _devices(case), _targets(case),
               case.get("fit_ctx_min") or 4096)


def _per_device(plan: MemoryPlan) -> list[int]:
    totals = plan.totals()
    return [totals[d.name].total for d in plan.devices]


def _device_total(result: FitResult) -> int:
    return sum(_per_device(result.plan))


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_fitter_leaves_no_more_device_memory_unused_than_llama_cpp_fit(case_id: str) -> None:
    case = CASES[case_id]
    result = fitted(case_id, CONSUMERS[0])
    assert result.fits
    totals = result.plan.totals()
    for d in result.plan.devices:
        assert totals[d.name].total <= result.budgets[d.name]
    llama_peak = (case.get("load_server") or case["load"])["device_peak_bytes"]
    assert _device_total(result) >= llama_peak


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("case_id", MULTI)
def test_on_several_devices_fitter_places_at_least_as_much_as_llama_cpp_fit(case_id: str, consumer: str) -> None:
    case = ALL[case_id]
    llama = _per_device(estimate(_spec(case["model"]), _config(case, case["llama_fit"]["args"], consumer),
                                 _devices(case)))
    # the estimate of llama.cpp's placement is what llama.cpp itself projected and, where loaded, really used
    if consumer == "llama-fit-params":
        assert [b // MIB for b in llama] == case["llama_fit"]["projected_device_mib"]
    load = case.get("load_server" if consumer == "llama-server" else "load")
    if load is not None:
        assert llama == load["device_peak_bytes_per_device"]
    result = fitted(case_id, consumer)
    assert result.fits
    mine = _per_device(result.plan)
    budgets = [result.budgets[d.name] for d in result.plan.devices]
    assert all(m <= b for m, b in zip(mine, budgets, strict=True))
    assert sum(mine) >= sum(llama), ([round(b / MIB, 2) for b in mine], [round(b / MIB, 2) for b in llama])


def _one_layers_experts(spec: ModelSpec) -> int:
    per_layer: dict[int, int] = defaultdict(int)
    for t in spec.tensors:
        if t.role is Role.EXPERT and t.layer is not None:
            per_layer[t.layer] += t.n_bytes
    return max(per_layer.values())


@pytest.mark.parametrize("consumer", CONSUMERS)
@pytest.mark.parametrize("case_id", MULTI)
def test_every_device_is_left_at_most_one_layers_experts_beyond_its_target(case_id: str, consumer: str) -> None:
    result = fitted(case_id, consumer)
    plan = result.plan
    assert result.fits
    one_layer = _one_layers_experts(plan.model)
    # expert bytes of each device's own layers that are not on it (on the CPU, or on another device)
    elsewhere: dict[str, int] = defaultdict(int)
    for p in plan.placements:
        if p.tensor.role is Role.EXPERT and p.tensor.layer is not None:
            owner = plan.layer_devices[p.tensor.layer]
            if p.buft != owner:
                elsewhere[owner] += p.tensor.n_bytes
    totals = plan.totals()
    for d in plan.devices:
        left = result.budgets[d.name] - totals[d.name].total
        assert left >= 0, (d.name, left / MIB)
        if elsewhere[d.name]:  # more experts could come onto it: it must be full to within one layer's
            assert left <= one_layer, (d.name, left / MIB, one_layer / MIB)


SMALL = sorted(i for i, c in CASES.items() if not REFERENCE["models"][c["model"]]["sparse"])


def _on(config: LaunchConfig, names: dict[str, str], endpoints: tuple[str, ...]) -> LaunchConfig:
    """`config` on the running emulated GPUs: their endpoints, and rules naming a device renamed to match."""
    rules = tuple(TensorOverride(o.pattern, names.get(o.buft, o.buft)) for o in config.overrides)
    return replace(config, rpc=endpoints, overrides=rules)


@pytest.mark.llama
@pytest.mark.parametrize("case_id", SMALL)
def test_fitter_placement_loads_on_the_capped_device_using_what_it_predicted(case_id: str) -> None:
    from fitter.measure.emulator.emulated_gpu import EmulatedGpus
    from fitter.measure.loader import load_and_capture

    case = CASES[case_id]
    result = fitted(case_id, CONSUMERS[0])
    m = REFERENCE["models"][case["model"]]
    with EmulatedGpus(tuple(_caps(case))) as gpus:
        names = {d.name: g.device_name for d, g in zip(result.plan.devices, gpus.gpus, strict=True)}
        flags = pin(_on(result.config, names, gpus.endpoints), result.plan.context)
        res = load_and_capture(str(model_files(m["shape"], m["sparse"], m["n_shards"])[0]), parse_launch_flags(flags))
        peaks = [g.stats().peak_bytes for g in gpus.gpus]
    assert res.ok, res.error
    assert peaks == _per_device(result.plan)
