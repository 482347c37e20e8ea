"""Where fitter's rules stop for a model, and a plan that takes what they do not cover from llama.cpp itself.

fitter's rules are exact where they were matched against llama.cpp (tests/memory/plan/test_arch_goldens.py): the model
buffers of every architecture (tensor sizes are the header's), the KV cache and recurrent state of the
architectures in fitter.gguf.archs, the compute buffers of those whose graph fitter rebuilds (GRAPH_ARCHS). Any
other kind is a guess: a plain KV cache over every layer, or the phase model's compute. `with_projection` replaces
exactly those kinds by llama.cpp's own projection of the same config (`llama-fit-params --fit-print on`, run at the
edge by fitter.measure.llamacpp.projection), so no command screens by a guess unless asked to (`--projection never`).
Pure: the projection comes in as data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from fitter.errors import FitterError
from fitter.gguf.archs import ARCHS
from fitter.gguf.model_spec import ModelSpec
from fitter.memory.graph.graphs import GRAPH_ARCHS
from fitter.memory.plan.buffers import CPU, Buffer
from fitter.units import MIB

if TYPE_CHECKING:
    from fitter.flags import LaunchConfig
    from fitter.memory.plan.estimator import MemoryPlan

class Projects(Protocol):
    """A build's projection of a config: device → {model, kv, compute} floored bytes (the I/O is the caller's:
    fitter.measure.llamacpp.projection.Projector), and the build as warnings name it."""

    source: str

    def __call__(self, config: LaunchConfig, /) -> dict[str, dict[str, int]]: ...


def guessed_kinds(spec: ModelSpec) -> tuple[str, ...]:
    """The kinds of memory fitter has no rules for on this model's architecture."""
    kinds = []
    if spec.arch not in ARCHS:
        kinds.append("kv")
    if spec.arch not in GRAPH_ARCHS:
        kinds.append("compute")
    return tuple(kinds)


def guess_warning(spec: ModelSpec) -> str | None:
    """What fitter does not understand about the model, and what it guessed instead; None when nothing."""
    parts = []
    if spec.arch not in ARCHS:
        parts.append(f"its KV cache as a plain cache over every layer (fitter.gguf.archs has no row for {spec.arch!r}: "
                     "a sliding window, recurrent state or NextN block in it is not known)")
    if spec.arch not in GRAPH_ARCHS:
        parts.append(f"its compute buffers by fitter's phase model (no replay of {spec.arch}'s graph; fitter rebuilds "
                     f"those of {', '.join(GRAPH_ARCHS)}), 95 % low to 60 % high where compared")
    if not parts:
        return None
    return (f"{spec.arch}: fitter guesses " + "; and ".join(parts)
            + ": pass --llama-cpp DIR or build the pinned tools to take them from llama.cpp's own projection")


def _round_up(floored: int) -> int:
    """llama-fit-params prints floored MiB: the largest byte count it could stand for."""
    return floored + MIB - 1


def with_projection(plan: MemoryPlan, projection: Mapping[str, Mapping[str, int]], source: str) -> MemoryPlan:
    """`plan` with the kinds fitter guesses on each device replaced by one buffer holding the projection's figure,
    rounded up to the MiB it floored (never below llama.cpp); fitter's exact kinds and its output buffer (in no kind
    the projection prints) stay. Raises when the projection lacks a device of the plan: that build cannot see it."""
    kinds = guessed_kinds(plan.model)
    if not kinds:
        return plan
    names = [CPU, *(d.name for d in plan.devices)]
    missing = [n for n in names if n not in projection]
    if missing:
        raise FitterError(f"llama.cpp's projection ({source}) has no {', '.join(missing)} (it sees "
                          f"{', '.join(projection) or 'nothing'}): project with a build of that backend "
                          "(--llama-cpp DIR), or take fitter's guess with --projection never")
    had = {(b.device, b.kind) for b in plan.buffers}
    buffers = [b for b in plan.buffers if b.kind not in kinds]
    for name in names:
        for kind in kinds:
            floored = projection[name].get(kind, 0)
            if floored or (name, kind) in had:
                buffers.append(Buffer(name, kind, name, _round_up(floored)))
    guess = guess_warning(plan.model)
    warnings = [w for w in plan.warnings if w != guess]
    warnings.append(f"{plan.model.arch}: {' and '.join(kinds)} from llama.cpp's own projection ({source}), its "
                    f"floored MiB rounded up: fitter has no rules for {'it' if len(kinds) == 1 else 'them'} on this "
                    "architecture")
    return replace(plan, buffers=tuple(buffers), warnings=tuple(warnings), projected=kinds)
