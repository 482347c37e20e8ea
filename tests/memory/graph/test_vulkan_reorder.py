"""fitter.memory.graph.vulkan_reorder: ggml-vulkan's graph_optimize on small hand-made splits, by its rules."""

from __future__ import annotations

from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.vulkan_reorder import reorder


def _uses(nodes: list[g.Tensor]) -> dict[g.Tensor, int]:
    out: dict[g.Tensor, int] = {}
    for n in nodes:
        for s in n.src:
            if s is not None:
                out[s] = out.get(s, 0) + 1
    return out


def test_an_independent_node_moves_up_to_run_beside_the_first() -> None:
    x = g.input_tensor("F32", 64, 8)
    a = g.mul_mat(g.data_tensor("F32", 64, 64), x)
    act = g.dup_op("UNARY", a)  # reads a: waits
    b = g.mul_mat(g.data_tensor("F32", 64, 64), x)  # reads nothing of the set: pulled forward
    nodes = [a, act, b]
    order, deps = reorder(nodes, _uses(nodes).get)
    assert order == [a, b, act] and deps == {}


def test_a_matmul_and_the_add_it_feeds_stay_together() -> None:
    x = g.input_tensor("F32", 64, 8)
    a = g.mul_mat(g.data_tensor("F32", 64, 64), x)
    bias = g.dup_op("ADD", a, g.data_tensor("F32", 64))  # MUL_MAT + ADD: a fusion pair, kept next to it
    b = g.mul_mat(g.data_tensor("F32", 64, 64), x)
    nodes = [a, bias, b]
    assert reorder(nodes, _uses(nodes).get)[0] == [a, bias, b]


def test_a_top_k_moe_run_is_kept_and_its_inputs_live_until_its_last_node() -> None:
    logits = g.input_tensor("F32", 8, 16)  # 8 experts, 16 tokens
    probs = g.reshape(logits, 1, 8, 16)  # made before the run
    selected = g.argsort_top_k(logits, 2)  # ARGSORT, VIEW
    weights = g.get_rows(probs, selected)
    sm = g.dup_op("SOFT_MAX", g.reshape(weights, 2, 16))
    out = g.reshape(sm, 1, 2, 16)
    graph = g.Graph()
    graph.expand(out)
    run = graph.nodes[1:]  # gpt-oss's topk_moe_late_softmax: ARGSORT, VIEW, GET_ROWS, RESHAPE, SOFT_MAX, RESHAPE
    assert [n.op for n in run] == ["ARGSORT", "VIEW", "GET_ROWS", "RESHAPE", "SOFT_MAX", "RESHAPE"]
    order, deps = reorder(run, _uses(graph.nodes).get)
    assert order == run
    assert deps == {out: [logits, probs]}  # the argsort's and the get_rows' inputs from outside the run
