"""The worst-case prompt graph llama.cpp reserves its compute buffers with, rebuilt from shapes for each architecture
whose graph fitter replays: one builder per family of llama.cpp's src/models/*.cpp (fitter.memory.graph.families),
from the shared blocks of fitter.memory.graph.builder.
"""

from __future__ import annotations

from collections.abc import Callable

from fitter.gguf.model_spec import ModelSpec
from fitter.memory.graph.builder import Builder, GraphParams
from fitter.memory.graph.families import (
    classic,
    delta_net,
    gemma,
    llama4,
    llama_like,
    mamba2,
    shortconv,
    transformer,
)
from fitter.memory.graph.ggml_graph import Graph

# architecture → its family's builder; others get compute estimates from fitter.memory.graph.compute's phase model
BUILDERS: dict[str, Callable[[Builder], None]] = {
    **{arch: transformer.build_transformer for arch in transformer.ARCHS},
    **{arch: gemma.build_gemma for arch in gemma.ARCHS},
    **{arch: delta_net.build_delta_net for arch in delta_net.ARCHS},
    **{arch: llama_like.build_llama_like for arch in llama_like.ARCHS},
    **{arch: llama4.build_llama4 for arch in llama4.ARCHS},
    **classic.BUILDERS,
    **{arch: shortconv.build_lfm2 for arch in shortconv.ARCHS},
    **{arch: mamba2.build_nemotron_h for arch in mamba2.ARCHS},
}
GRAPH_ARCHS = tuple(BUILDERS)
# architectures whose files a builder covers only in part: the rest go the way of an architecture without one
_PARTIAL: dict[str, Callable[[ModelSpec], bool]] = {arch: mamba2.rebuilt for arch in mamba2.ARCHS}


def replays(spec: ModelSpec) -> bool:
    """fitter rebuilds this model's compute graph (its architecture's builder covers the file)."""
    covers = _PARTIAL.get(spec.arch)
    return spec.arch in BUILDERS and (covers is None or covers(spec))


def build(b: Builder) -> None:
    BUILDERS[b.spec.arch](b)


def build_graph(spec: ModelSpec, p: GraphParams) -> Graph:
    b = Builder(spec, p)
    build(b)
    b.bind(p.backends)
    return b.gf
