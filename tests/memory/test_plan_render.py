"""fitter.memory.plan_render: what the table says of each device's rules."""

from __future__ import annotations

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import CPU_AVX2
from fitter.memory.backends.registry import parse_devices
from fitter.memory.plan.estimator import estimate
from fitter.memory.plan.projected import with_projection
from fitter.memory.plan_render import plan_table
from fitter.units import MIB
from tests.models import model_file

LLAMA_CPP = {"commit": "0c1e570", "source": "test"}


def _notes(table: str) -> list[str]:
    return [line for line in table.splitlines() if line.startswith(("note:", "("))]


def test_a_device_without_rules_is_said_projected_when_projected_and_guessed_when_guessed() -> None:
    spec = load_model_spec(str(model_file("llama-tiny")))
    plan = estimate(spec, parse_launch_flags(["-c", "512", "-ngl", "all"]), parse_devices("metal:65536"), CPU_AVX2)
    assert _notes(plan_table(plan, LLAMA_CPP)) == [
        "note: MTL0: no rules for its backend in fitter: every buffer guessed with the CPU's (--projection never)"]
    tool = {"MTL0": {"model": 3 * MIB, "kv": 1 * MIB, "compute": 2 * MIB}, "CPU": {"model": 0, "kv": 0, "compute": MIB}}
    projected = with_projection(plan, tool, "llama-fit-params of a Metal build")
    assert _notes(plan_table(projected, LLAMA_CPP)) == [
        "(model and kv and compute: llama.cpp's own projection per device, rounded up to the MiB)",
        "note: MTL0: no rules for Metal in fitter: its buffers come from the build's own projection "
        "(llama-fit-params --fit-print on)"]


def test_a_vulkan_card_of_unknown_limits_says_whose_limits_it_has() -> None:
    spec = load_model_spec(str(model_file("llama-tiny")))
    plan = estimate(spec, parse_launch_flags(["-c", "512", "-ngl", "all"]), parse_devices("vulkan:8192"), CPU_AVX2)
    (note,) = _notes(plan_table(plan, LLAMA_CPP))
    assert note.startswith("note: Vulkan0: Vulkan's rules, validated on lavapipe") and "typical" in note
