"""The compute-graph replay: the worst-case graph of fitter.memory.graph.graphs, scheduled onto backends
(fitter.memory.graph.sched) and allocated (fitter.memory.graph.ggml_graph), with the built graphs kept for reuse.

`fitter fit` replays the same graph shapes for ~100 placements that only move weights between backends; building
the graph is a third of a replay, so each shape is built once per model spec and bound to each placement.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from fitter.gguf.model_spec import ModelSpec
from fitter.memory.graph.builder import Builder, GraphParams
from fitter.memory.graph.ggml_graph import BufferType, Graph, Tensor, allocate_buffers
from fitter.memory.graph.graphs import build
from fitter.memory.graph.sched import schedule

# Built graphs by (model spec, shape): a graph's structure depends on the spec and the GraphParams but for
# `backends`, which `Builder.bind` sets afresh on every use, and the scheduler's only change to it (sources
# redirected to copies) is undone after each use; so a cached graph gives exactly what a fresh one would.
_GRAPHS: dict[tuple[object, ...], tuple[ModelSpec, Builder]] = {}
_GRAPHS_KEPT = 8


def clear_graph_cache() -> None:
    _GRAPHS.clear()


@contextmanager
def _graph(spec: ModelSpec, p: GraphParams) -> Iterator[Graph]:
    """build_graph(spec, p), from the cache when that shape was built for this very spec object."""
    key = (id(spec), p.n_tokens, p.n_outputs, p.n_kv, p.n_stream, p.flash_attn, p.type_k, p.type_v, p.v_trans,
           p.n_seqs)
    entry = _GRAPHS.pop(key, None)  # taken out while in use: a concurrent caller builds its own
    if entry is not None and entry[0] is spec:
        b = entry[1]
    else:
        b = Builder(spec, p)
        build(b)
    b.bind(p.backends)
    sources = [node.src for node in b.gf.nodes]
    try:
        yield b.gf
    finally:
        for node, src in zip(b.gf.nodes, sources, strict=True):
            node.src = src
        _GRAPHS[key] = (spec, b)  # the entry holds the spec, so its id cannot be reused while cached
        while len(_GRAPHS) > _GRAPHS_KEPT:
            del _GRAPHS[next(iter(_GRAPHS))]


class Replayed:
    """The compute bytes of graphs one estimate has replayed already. The `-fa auto` probe schedules the very graph
    the compute buffers are then sized with (one token per sequence, flash attention on) unless it turns flash
    attention off; sizing it while it is scheduled saves building and scheduling it again."""

    def __init__(self) -> None:
        self._sizes: list[tuple[GraphParams, tuple[BufferType, ...], list[tuple[int, ...]]]] = []

    def get(self, p: GraphParams, bufts: tuple[BufferType, ...]) -> list[tuple[int, ...]] | None:
        return next((list(sizes) for q, b, sizes in self._sizes if q == p and b == bufts), None)

    def put(self, p: GraphParams, bufts: tuple[BufferType, ...], sizes: list[tuple[int, ...]]) -> None:
        self._sizes.append((p, bufts, list(sizes)))


def flash_attn_devices_match(spec: ModelSpec, p: GraphParams, bufts: tuple[BufferType, ...] = (),
                             replayed: Replayed | None = None) -> int | None:
    """llama_context::resolve_fused_ops for `-fa auto`: schedule the one-token-per-sequence graph with flash
    attention and check every layer's FA op runs on the layer's device. Returns the first layer that does not;
    when every one does and `replayed` is given, the graph's compute chunks for `bufts` go there too."""
    if p.backends.n_backends == 1:
        return None
    with _graph(spec, p) as graph:
        copy, backend_of = schedule(graph, p.backends.n_backends, p.backends.offload_min_batch, p.backends.ops,
                                    p.backends.n_copies)
        for node in graph.nodes:
            if node.op == "FLASH_ATTN_EXT" and node.name.startswith("fa-"):
                il = int(node.name[3:])
                if backend_of(node) != p.backends.layer(il):
                    return il
        if replayed is not None:
            replayed.put(p, bufts, _allocate(copy, p, bufts, backend_of))
    return None


def _allocate(copy: Graph, p: GraphParams, bufts: tuple[BufferType, ...], backend_of: Callable[[Tensor], int]
              ) -> list[tuple[int, ...]]:
    ops = p.backends.ops
    sizes = [ops[i].alloc_size() if i < len(ops) else None for i in range(p.backends.n_backends)]
    return allocate_buffers(copy, list(bufts), backend_of, sizes)


def graph_compute_bytes(spec: ModelSpec, p: GraphParams, bufts: tuple[BufferType, ...] = (BufferType(32),),
                        replayed: Replayed | None = None) -> list[tuple[int, ...]]:
    """The chunks of the compute buffer llama.cpp reserves on each backend (devices first, the CPU last) for this
    graph (fitter.memory.graph.ggml_graph.BufferType.bytes gives the size it logs)."""
    known = replayed.get(p, bufts) if replayed is not None else None
    if known is not None:
        return known
    with _graph(spec, p) as graph:
        if p.backends.n_backends == 1:
            return allocate_buffers(graph, [bufts[0]], lambda t: 0)
        copy, backend_of = schedule(graph, p.backends.n_backends, p.backends.offload_min_batch, p.backends.ops,
                                    p.backends.n_copies)
        return _allocate(copy, p, bufts, backend_of)
