"""nemotron_h's graph (families/mamba2.py) covers files without routed experts; one whose layers route experts is
estimated as an architecture without a replay (the phase model, or llama.cpp's projection), never refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import Role, TensorSpec
from fitter.memory.backends.devices import CPU_AVX2
from fitter.memory.graph.graphs import replays
from fitter.memory.plan.estimator import estimate
from tests.memory.plan.test_arch_goldens import models, spec_of  # noqa: F401 (the fixture)


def test_a_nemotron_h_file_with_routed_experts_leaves_the_replay(models: Path) -> None:  # noqa: F811
    spec = spec_of(models, "nemotron_h-dense")
    assert replays(spec)
    router = TensorSpec("blk.1.ffn_gate_inp.weight", "F32", (spec.n_embd, 8), spec.n_embd * 8 * 4, 1, Role.ROUTER,
                        0, 0)
    routed = replace(spec, tensors=(*spec.tensors, router))
    assert not replays(routed)
    plan = estimate(routed, parse_launch_flags(["-c", "256"]), (), CPU_AVX2)
    assert any("no replay of nemotron_h's graph" in w for w in plan.warnings)
    assert next(b for b in plan.buffers if b.kind == "compute").bytes > 0
