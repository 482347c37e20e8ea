"""The ggml-alloc replay on hand-made graphs whose peaks follow from ggml-alloc.c's rules by hand."""

from __future__ import annotations

from fitter.memory.graph import ggml_graph as g


def _chain(output_mid: bool) -> g.Graph:
    x = g.input_tensor("F32", 64, name="x")  # 256 bytes
    w1, w2 = g.data_tensor("F32", 64, 64), g.data_tensor("F32", 64, 64)
    bias = g.data_tensor("F32", 64)
    y = g.mul_mat(w1, x)  # 256 bytes
    y.is_output = output_mid
    z = g.dup_op("ADD", y, bias)
    out = g.mul_mat(w2, z)
    graph = g.Graph()
    graph.expand(out)
    return graph


def test_last_consumer_writes_in_place_and_freed_blocks_are_reused() -> None:
    # x at 0, y at 256; x is freed after y; z reuses y's memory; out takes x's freed block: peak 512.
    assert g.allocate(_chain(output_mid=False), alignment=32) == 512


def test_graph_outputs_are_neither_reused_nor_freed() -> None:
    # y is an output: z gets x's freed block at 0, out must go past y: peak 768.
    assert g.allocate(_chain(output_mid=True), alignment=32) == 768


def test_views_keep_their_source_alive() -> None:
    a = g.input_tensor("F32", 64)  # 256 bytes at 0
    b = g.dup_op("UNARY", a)  # a has one consumer: b reuses a's memory
    v = g.view(b, (32,), ())  # a view of b's first half
    c = g.cont(v)  # 128 bytes: b is still viewed, so c goes to 256
    graph = g.Graph()
    graph.expand(c)
    assert g.allocate(graph, alignment=32) == 384


def test_expand_orders_sources_first_and_collects_leafs() -> None:
    a = g.input_tensor("F32", 4, name="a")
    w = g.data_tensor("F32", 4, 4, name="w")
    m = g.mul_mat(w, a)
    graph = g.Graph()
    graph.expand(m)
    assert graph.leafs == [w, a] and graph.nodes == [m]
    assert m.nbytes == 16 and g.transpose(w).nb == (16, 4, 64, 64)  # ggml_transpose swaps strides 0 and 1


def test_a_buffer_type_with_a_maximum_size_splits_the_allocation_into_chunks() -> None:
    # ggml_dyn_tallocr with max_chunk_size 1000: two live 600-byte tensors cannot share one chunk
    a = g.input_tensor("F32", 150)  # 600 bytes
    b = g.input_tensor("F32", 150)
    out = g.dup_op("ADD", a, b)  # a is its last consumer's parent: written in place
    graph = g.Graph()
    graph.expand(out)
    chunks = g.allocate_buffers(graph, [g.BufferType(32, max_size=1000)], lambda t: 0)[0]
    assert chunks == (608, 608)  # 600 aligned to 32, one chunk each
    assert g.allocate_buffers(graph, [g.BufferType(32)], lambda t: 0)[0] == (1216,)
    # ggml-vulkan's pinned host type adds 32 bytes to every buffer it makes: one per chunk
    assert g.BufferType(64, 1000, extra=32).bytes((608, 608)) == 1216 + 64
    assert g.BufferType(64, 1000, extra=32).bytes(()) == 0  # nothing allocated: no buffer made
