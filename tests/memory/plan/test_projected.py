"""fitter.memory.plan.projected: which kinds fitter guesses for a model, and the plan that takes them from llama.cpp."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from fitter.errors import FitterError
from fitter.flags import parse_launch_flags
from fitter.gguf.archs import ARCHS
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import CPU_AVX2
from fitter.memory.backends.registry import parse_devices
from fitter.memory.graph.graphs import GRAPH_ARCHS
from fitter.memory.plan.estimator import estimate
from fitter.memory.plan.projected import guess_warning, guessed_kinds, with_projection
from fitter.units import MIB
from tests.models import model_file, unknown_arch_model


def test_the_kinds_fitter_guesses_follow_its_rows_and_graphs() -> None:
    spec = load_model_spec(str(model_file("llama-tiny")))
    assert guessed_kinds(spec) == () and guess_warning(spec) is None
    ruled = sorted(set(ARCHS) - set(GRAPH_ARCHS))[0]  # a row in archs, no graph replay
    assert guessed_kinds(replace(spec, arch=ruled)) == ("compute",)
    assert guessed_kinds(replace(spec, arch="gemma3")) == ()  # both
    assert guessed_kinds(replace(spec, arch="qwen4exp")) == ("kv", "compute")  # neither


def test_a_projection_replaces_only_what_fitter_guesses(tmp_path: Path) -> None:
    spec = load_model_spec(str(unknown_arch_model(tmp_path)))
    plan = estimate(spec, parse_launch_flags(["-c", "512"]), (), CPU_AVX2)
    assert guess_warning(spec) in plan.warnings
    projected = with_projection(plan, {"CPU": {"model": 1 * MIB, "kv": 3 * MIB, "compute": 0}}, "the tool")
    kept = [b for b in plan.buffers if b.kind in ("model", "output")]
    assert [b for b in projected.buffers if b.kind in ("model", "output")] == kept  # the exact kinds stay
    # the floored MiB rounded up; a kind the build prints as 0 keeps a buffer where fitter had one
    assert [(b.buft, b.kind, b.bytes) for b in projected.buffers if b.kind in ("kv", "compute")] == [
        ("CPU", "kv", 4 * MIB - 1), ("CPU", "compute", MIB - 1)]
    assert projected.projected == ("kv", "compute")
    assert guess_warning(spec) not in projected.warnings
    # llama-server's 4 slots reserve logits for 4 outputs, the tool for 512 (its ubatch): 512 tokens × 508 × 4 B
    assert projected.warnings[-1] == ("llamb: kv and compute from llama.cpp's own projection (the tool), its floored "
                                      "MiB rounded up: fitter has no rules for them on this architecture; its compute "
                                      "reserves logits for 512 outputs where llama-server reserves 4, so the output "
                                      "layer's device is up to 0.99 MiB high")
    assert projected.totals()["CPU"].kv == 4 * MIB - 1


def test_a_projection_that_lacks_a_device_of_the_plan_is_refused(tmp_path: Path) -> None:
    spec = load_model_spec(str(unknown_arch_model(tmp_path)))
    plan = estimate(spec, parse_launch_flags(["-c", "512", "-ngl", "99"]), parse_devices("cuda:8192"), CPU_AVX2)
    with pytest.raises(FitterError) as e:
        with_projection(plan, {"CPU": {"model": 0, "kv": 0, "compute": 0}}, "llama-fit-params of bin")
    assert str(e.value) == ("llama.cpp's projection (llama-fit-params of bin) has no CUDA0 (it sees CPU): project "
                            "with a build of that backend (--llama-cpp DIR), or take fitter's guess with "
                            "--projection never")


def test_a_plan_fitter_guesses_nothing_for_is_left_as_it_is() -> None:
    plan = estimate(load_model_spec(str(model_file("llama-tiny"))), parse_launch_flags(["-c", "512"]), (), CPU_AVX2)
    assert with_projection(plan, {}, "unused") is plan


def test_a_device_of_a_backend_without_rules_takes_every_kind_from_the_projection() -> None:
    spec = load_model_spec(str(model_file("llama-tiny")))
    devices = parse_devices("metal:65536")
    assert [(d.name, d.profile.kind, d.profile.projected, d.profile.unified) for d in devices] == [
        ("MTL0", "metal", True, True)]
    assert guessed_kinds(spec, devices) == ("model", "kv", "compute")
    plan = estimate(spec, parse_launch_flags(["-c", "512", "-ngl", "all"]), devices, CPU_AVX2)
    assert guess_warning(spec, devices) in plan.warnings  # said, never silent
    tool = {"MTL0": {"model": 3 * MIB, "kv": 1 * MIB, "compute": 2 * MIB},
            "CPU": {"model": 0, "kv": 0, "compute": 1 * MIB}}
    projected = with_projection(plan, tool, "llama-fit-params of a Metal build")
    host_model = [b for b in plan.buffers if b.device == "CPU" and b.kind == "model"]
    # the host's weights stay the CPU backend's (fitter's); its compute, and every kind on MTL0, the projection's
    assert [b for b in projected.buffers if b.device == "CPU" and b.kind == "model"] == host_model
    assert [(b.buft, b.kind, b.bytes) for b in projected.buffers if b.kind != "output" and b not in host_model] == [
        ("CPU", "compute", 2 * MIB - 1),
        ("MTL0", "model", 4 * MIB - 1), ("MTL0", "kv", 2 * MIB - 1), ("MTL0", "compute", 3 * MIB - 1)]
    assert projected.warnings[-1] == ("MTL0: every buffer from llama.cpp's own projection (llama-fit-params of a "
                                      "Metal build), its floored MiB rounded up: fitter has no rules for this "
                                      "backend")
    assert guess_warning(spec, devices) not in projected.warnings
