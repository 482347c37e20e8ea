"""The estimator with a draft model (-md): the draft's plan beside the model's, on what the devices have left, and
fit counting it (tests/memory/plan/test_draft_golden.py holds the buffers against llama-server's own)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fitter.errors import LaunchConfigError
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import ModelSpec, load_model_spec
from fitter.memory.backends.devices import CUDA, Device
from fitter.memory.fit.fit import fit
from fitter.memory.plan.estimator import estimate, first_failure
from tests.models import model_file

MIB = 1024 * 1024


def _pair(model: str = "demo", draft: str = "llama-tiny") -> tuple[ModelSpec, ModelSpec, ModelSpec]:
    """The model's spec, the draft's, and the model's with the draft riding along (what `-md` loads)."""
    target, d = load_model_spec(str(model_file(model))), load_model_spec(str(model_file(draft)))
    return target, d, replace(target, draft=d)


def _gpus(*free_mib: int) -> tuple[Device, ...]:
    return tuple(Device(f"CUDA{i}", CUDA, f * MIB, f * MIB) for i, f in enumerate(free_mib))


def test_a_plan_with_a_draft_is_the_models_plus_the_drafts_own() -> None:
    target, draft, both = _pair()
    flags = ["-c", "4096", "-ngl", "all", "-ncmoe", "4", "-fa", "on"]
    config = parse_launch_flags([*flags, "-md", "d.gguf", "-ngld", "all", "-ctkd", "q8_0", "-ctvd", "q8_0"])
    devices = _gpus(400)
    plan = estimate(both, config, devices)
    alone = estimate(target, parse_launch_flags(flags), devices)
    assert [b for b in plan.buffers if not b.model] == list(alone.buffers)
    assert plan.draft is not None
    # the draft alone as llama-server would run it with the model's flags and the draft's own: its context is the
    # model's 4096 cells for the 4 slots, its layers, rules and cache the draft's
    free = 400 * MIB - sum(b.bytes for b in alone.buffers if b.device == "CUDA0")
    own = estimate(draft, parse_launch_flags(["-c", "4096", "-fa", "on", "-ngl", "all", "-ctk", "q8_0", "-ctv", "q8_0",
                                              "-fit", "off"]), (replace(devices[0], free_bytes=free),))
    assert [replace(b, model="") for b in plan.buffers if b.model == "draft"] == list(own.buffers)
    for name, t in plan.totals().items():
        assert t.total == alone.totals()[name].total + own.totals()[name].total, name


def test_the_draft_splits_its_layers_over_what_the_model_left_free() -> None:
    # llama_model_load reads each device's free memory when the draft loads, after the model and its context
    _, _, both = _pair()
    config = parse_launch_flags(["-c", "4096", "-ngl", "all", "-md", "d.gguf", "-ngld", "all"])
    devices = _gpus(300, 200)
    plan = estimate(both, config, devices)
    assert plan.draft is not None
    used = {d.name: 0 for d in devices}
    for b in plan.buffers:
        if not b.model and b.device in used:
            used[b.device] += b.bytes
    assert [d.free_bytes for d in plan.draft.devices] == [
        (d.free_bytes or 0) - used[d.name] for d in devices]


def test_a_device_short_by_the_draft_fails_at_the_drafts_model_buffers() -> None:
    _, _, both = _pair()
    config = parse_launch_flags(["-c", "4096", "-ngl", "all", "-md", "d.gguf", "-ngld", "all"])
    plan = estimate(both, config, _gpus(4000))
    own = sum(b.bytes for b in plan.buffers if b.device == "CUDA0" and not b.model)
    assert first_failure(plan, "CUDA0", own) == "model"  # the model's buffers fit; the draft's first one does not
    assert first_failure(plan, "CUDA0", plan.totals()["CUDA0"].total) is None


def test_a_config_with_a_draft_needs_the_drafts_header() -> None:
    target, _, _ = _pair()
    with pytest.raises(LaunchConfigError, match=r"^-md d\.gguf: the draft model's header was not read, so its memory "
                                                r"cannot be estimated$"):
        estimate(target, parse_launch_flags(["-md", "d.gguf"]))


def test_fit_leaves_room_for_the_draft() -> None:
    target, _, both = _pair("demo", "qwen3moe-tiny")
    flags = ["-c", "4096", "-fa", "on"]
    devices = _gpus(1120)  # 96 MiB after the 1024 MiB target: the model alone keeps 5 of its 8 layers' experts there
    alone = fit(target, parse_launch_flags(flags), devices, (1024,))
    with_draft = fit(both, parse_launch_flags([*flags, "-md", "d.gguf", "-ngld", "all"]), devices, (1024,))
    assert alone.fits and with_draft.fits
    draft_bytes = sum(b.bytes for b in with_draft.plan.buffers if b.model == "draft" and b.device == "CUDA0")
    assert draft_bytes > 0
    assert with_draft.plan.totals()["CUDA0"].total <= with_draft.budgets["CUDA0"]
    assert (alone.expert_layers_on_device, with_draft.expert_layers_on_device) == (5, 4)  # the draft took a layer's
