"""fitter.memory.graph.recurrent_ops: the shapes ggml/src/ggml.c (0c1e570) gives the recurrent layers' ops, and the
ops whose result is their destination's memory."""

from __future__ import annotations

from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.recurrent_ops import cpy, gated_delta_net, repeat, scale_inplace, ssm_conv


def test_the_short_convolution_slides_the_kernel_over_the_stored_and_new_columns() -> None:
    # ggml_ssm_conv: sx [d_conv - 1 + n_t, d_inner, n_s], c [d_conv, d_inner] → [d_inner, n_t, n_s]
    out = ssm_conv(g.new("F32", 3 + 64, 768, 4), g.data_tensor("F32", 4, 768))
    assert (out.type, out.ne, out.nbytes) == ("F32", (768, 64, 4, 1), 768 * 64 * 4 * 4)


def test_the_gated_delta_rule_returns_the_output_and_the_new_state_in_one_tensor() -> None:
    # ggml_gated_delta_net: [S_v * H, n_tokens * n_seqs + K * S_v * n_seqs]; q and k may have fewer heads than v
    q = g.new("F32", 128, 16, 64, 4)
    v = g.new("F32", 128, 32, 64, 4)
    gate, beta = g.new("F32", 1, 32, 64, 4), g.new("F32", 1, 32, 64, 4)
    state = g.new("F32", 128, 128, 32, 4)
    out = gated_delta_net(q, q, v, gate, beta, state)
    assert out.ne == (128 * 32, 64 * 4 + 128 * 4, 1, 1)
    assert out.src == (q, q, v, gate, beta, state)
    assert gated_delta_net(q, q, v, gate, beta, state, snapshots=3).ne == (128 * 32, 64 * 4 + 3 * 128 * 4, 1, 1)


def test_a_copy_into_a_state_cache_and_an_in_place_scale_allocate_nothing() -> None:
    cache = g.data_tensor("F32", 1024, 4, weight=False)
    rows = g.dup_op("UNARY", g.data_tensor("F32", 1024, 4))  # 16 KiB, the only tensor the buffer holds
    graph = g.Graph()
    graph.expand(cpy(rows, g.view(cache, (1024, 4), (cache.nb[1],))))
    graph.expand(scale_inplace(g.view(cache, (1024,), ())))
    assert g.allocate(graph, alignment=32) == rows.nbytes == 16384
    copied = graph.nodes[2]
    assert copied.op == "CPY" and copied.view_src is cache and copied.src[0] is rows


def test_repeat_makes_a_new_tensor_of_the_repeated_shape() -> None:
    out = repeat(g.new("F32", 128, 1, 16, 256), 128, 2, 16, 256)
    assert (out.op, out.ne, out.nbytes) == ("REPEAT", (128, 2, 16, 256), 128 * 2 * 16 * 256 * 4)
