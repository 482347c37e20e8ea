"""fitter.memory.graph.families.delta_net: qwen3next, qwen35 and qwen35moe against llama.cpp's own tiny models
(tests/golden/archs.json) and its graphs: every compute buffer to the logged 0.01 MiB, every graph node for node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import CPU_AVX2
from fitter.memory.graph.builder import BackendMap, Builder, GraphParams
from fitter.memory.graph.graphs import build, build_graph
from fitter.memory.plan.estimator import estimate
from fitter.units import MIB
from tests.memory.plan.test_arch_goldens import GOLDEN, models, spec_of  # noqa: F401 (the fixture)
from tests.models import model_file

ARCHS = ("qwen3next", "qwen35", "qwen35moe")
CASES = [c for c in GOLDEN["cases"] if c["outcome"] == "ok" and GOLDEN["models"][c["model"]]["arch"] in ARCHS]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["id"])
def test_the_compute_buffer_is_the_one_llama_cpp_logged(models: Path, case: dict[str, Any]) -> None:  # noqa: F811
    plan = estimate(spec_of(models, case["model"]), parse_launch_flags(case["flags"]), (), CPU_AVX2)
    (logged,) = [b["mib"] for b in case["buffers"] if b["kind"] == "compute"]
    (ours,) = [b.bytes / MIB for b in plan.buffers if b.kind == "compute"]
    assert round(ours, 2) == logged


# `sched_reserve: graph: nodes = N` as llama-fit-params -v logs it for the prompt graph of -c 1024 (0c1e570): one
# sequence of 256 tokens with flash attention, two of 64 without
@pytest.mark.parametrize(("model", "nodes"), [("qwen35-dense", (129, 135)), ("qwen3next-moe", (186, 192)),
                                              ("qwen35moe-moe", (187, 193))])
def test_the_graph_has_llama_cpps_nodes(models: Path, model: str, nodes: tuple[int, int]) -> None:  # noqa: F811
    spec = spec_of(models, model)
    one = build_graph(spec, GraphParams(256, 256, (1024, 0), 1, True, "f16", "f16", n_seqs=1))
    two = build_graph(spec, GraphParams(128, 128, (512, 0), 2, False, "f16", "f16", n_seqs=2))
    assert (len(one.nodes), len(two.nodes)) == nodes
    # one gated delta rule and one short convolution per recurrent layer, copied back into its state caches
    n_recurrent = sum(spec.recurrent_layers)
    assert n_recurrent == 1
    assert [sum(n.op == op for n in one.nodes) for op in ("GATED_DELTA_NET", "SSM_CONV", "CPY")] == [1, 1, 4]


def test_the_recurrent_states_are_cached_per_layer_where_the_layer_runs(models: Path) -> None:  # noqa: F811
    spec = spec_of(models, "qwen3next-moe+interval2")  # layer 0 recurrent, layer 1 attention
    b = Builder(spec, GraphParams(66, 3, (768, 0), 3, True, "f16", "f16", n_seqs=3))
    build(b)
    caches = [(t.ne[:2], il) for t, il in b.kv]
    # conv state (d_conv - 1) × channels and SSM state d_state × d_inner, one row per sequence; then K and V
    assert caches == [((3 * 768, 3), 0), ((128 * 256, 3), 0), ((256, 768), 1), ((256, 768), 1)]
    b.bind(BackendMap(n_backends=2, layer_backend=(0, 1, 1)))
    assert [t.backend for t, _ in b.kv] == [0, 0, 1, 1]
    b.bind(BackendMap(n_backends=2, layer_backend=(0, 1, 1), kv_on_cpu=True))  # -nkvo: every cache on the host
    assert [t.backend for t, _ in b.kv] == [1, 1, 1, 1]


def test_qwen3_next_repeats_its_key_heads_for_the_value_heads() -> None:
    # Qwen3-Next-80B-A3B: 16 key heads, 32 value heads of 128; 36 of 48 layers recurrent. qwen3next.cpp repeats q and
    # k to the value heads even for the fused op; qwen35 and qwen35moe leave that to the op
    spec = load_model_spec(str(model_file("qwen3-next-80b-a3b", sparse=True)))
    graph = build_graph(spec, GraphParams(512, 4, (4096, 0), 1, True, "f16", "f16", n_seqs=4))
    repeats = [n for n in graph.nodes if n.op == "REPEAT"]
    assert len(repeats) == 2 * 36 and {n.ne for n in repeats} == {(128, 2, 16, 512)}
    gdn = [n for n in graph.nodes if n.op == "GATED_DELTA_NET"]
    assert len(gdn) == 36 and {n.ne for n in gdn} == {(128 * 32, 512 + 128 * 4, 1, 1)}
