"""`fitter fit` on two and three GPUs (fitter.memory.fit.fit_devices): every GPU is filled to its target plus at most
one layer's experts, with more on the devices than llama.cpp's default split with -ncmoe gives."""

from __future__ import annotations

import pytest

from fitter.flags import parse_launch_flags
from fitter.flags.overrides import ncmoe_rules
from fitter.gguf.model_spec import Role, load_model_spec
from fitter.memory.backends.registry import parse_devices
from fitter.memory.fit.fit import fit
from fitter.memory.fit.fit_devices import split_by_budget
from fitter.memory.plan.estimator import estimate
from tests.models import model_files

MIB = 1024 * 1024


def _spec():  # type: ignore[no-untyped-def]
    return load_model_spec(str(model_files("gpt-oss-120b", True, 3)[0]))


def test_split_by_budget_gives_every_layer_in_proportion() -> None:
    assert split_by_budget(37, [2, 1]) == (25, 12)
    assert split_by_budget(37, [1, 1, 1]) == (13, 12, 12)
    assert split_by_budget(5, [1, 0]) == (5, 0)


@pytest.mark.parametrize("devices", ["cuda:24576,12288", "cuda:24576,12288,12288"])
def test_every_gpu_is_filled_to_its_target_plus_at_most_one_layers_experts(devices: str) -> None:
    spec = _spec()
    result = fit(spec, parse_launch_flags(["-c", "32768"]), parse_devices(devices))
    assert result.fits
    totals = result.plan.totals()
    layer_experts = max(sum(t.n_bytes for t in spec.tensors if t.role is Role.EXPERT and t.layer == il)
                        for il in range(spec.n_layer))
    for d in result.plan.devices:
        slack = result.budgets[d.name] - totals[d.name].total
        assert 0 <= slack <= layer_experts, (d.name, slack / MIB)
    assert len(result.config.tensor_split) == len(result.plan.devices)
    # each device holds experts of its own layers
    holders = {p.buft for p in result.plan.placements if p.tensor.role is Role.EXPERT}
    assert {d.name for d in result.plan.devices} <= holders


def test_more_lands_on_the_gpus_than_with_the_default_split_and_ncmoe() -> None:
    spec = _spec()
    devices = parse_devices("cuda:24576,12288")
    result = fit(spec, parse_launch_flags(["-c", "32768"]), devices)
    used = sum(result.plan.totals()[d.name].total for d in devices)
    # the GPU0-first placement: the default split (free memory) and the smallest -ncmoe that fits
    for n in range(spec.n_layer + 1):
        config = parse_launch_flags(["-c", "32768", "-ngl", "all"])
        plan = estimate(spec, config.__class__(**{**config.__dict__, "overrides": ncmoe_rules(n)}), devices)
        t = plan.totals()
        if all(t[d.name].total <= result.budgets[d.name] for d in devices):
            break
    assert used > sum(t[d.name].total for d in devices) + 4096 * MIB


def test_a_split_the_user_gives_is_kept() -> None:
    result = fit(_spec(), parse_launch_flags(["-c", "32768", "-ts", "30,7"]), parse_devices("cuda:24576,12288"))
    assert result.fits and result.config.tensor_split == (30.0, 7.0)
    assert result.plan.layer_devices.count("CUDA1") == 7
