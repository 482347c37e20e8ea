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

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from fitter.errors import FitterError
from fitter.gguf.archs import ARCHS
from fitter.gguf.model_spec import ModelSpec
from fitter.memory.backends.devices import Device
from fitter.memory.graph.graphs import GRAPH_ARCHS, replays
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


def guessed_kinds(spec: ModelSpec, devices: Sequence[Device] = ()) -> tuple[str, ...]:
    """The kinds of memory fitter has no rules for: on this model's architecture, and every kind where a device's
    backend has none (fitter.memory.backends.registry: Metal, SYCL, …: which weights it takes, its alignment, its
    compute graph are all its own)."""
    if unruled(devices):
        return ("model", "kv", "compute")
    kinds = []
    if spec.arch not in ARCHS:
        kinds.append("kv")
    if not replays(spec):
        kinds.append("compute")
    return tuple(kinds)


def unruled(devices: Sequence[Device]) -> tuple[Device, ...]:
    """The devices whose backend fitter has no rules for."""
    return tuple(d for d in devices if d.profile.projected)


def guess_warning(spec: ModelSpec, devices: Sequence[Device] = ()) -> str | None:
    """What fitter does not understand about the model or the devices, and what it guessed instead; None when
    nothing."""
    if (none := unruled(devices)):
        names = ", ".join(f"{d.name} ({d.profile.kind})" for d in none)
        return (f"{names}: fitter has no rules for this backend and guesses every buffer with the CPU's (alignment 32, "
                "no op offload): pass --llama-cpp DIR with a build of that backend to take them from its own "
                "projection")
    parts = []
    if spec.arch not in ARCHS:
        parts.append(f"its KV cache as a plain cache over every layer (fitter.gguf.archs has no row for {spec.arch!r}: "
                     "a sliding window, recurrent state or NextN block in it is not known)")
    if not replays(spec):
        parts.append(f"its compute buffers by fitter's phase model (no replay of {spec.arch}'s graph; fitter rebuilds "
                     f"those of {', '.join(GRAPH_ARCHS)}), 95 % low to 60 % high where compared")
    if not parts:
        return None
    return (f"{spec.arch}: fitter guesses " + "; and ".join(parts)
            + ": pass --llama-cpp DIR or build the pinned tools to take them from llama.cpp's own projection")


def _round_up(floored: int) -> int:
    """llama-fit-params prints floored MiB: the largest byte count it could stand for."""
    return floored + MIB - 1


def projected_on(spec: ModelSpec, devices: Sequence[Device]) -> dict[str, tuple[str, ...]]:
    """The kinds fitter takes from a projection on each device (and the CPU): those it has no rules for on the
    architecture, on every one; every kind on a device whose backend it has no rules for, and the host's compute,
    which that backend's share of the graph decides. The host's weights and cache stay fitter's: the CPU backend's
    buffers are its own (and llama-fit-params leaves CPU_REPACK out of what it prints)."""
    arch = guessed_kinds(spec)
    out = {CPU: arch, **{d.name: arch for d in devices}}
    none = unruled(devices)
    if none:
        out[CPU] = tuple(k for k in ("kv", "compute") if k in arch or k == "compute")
        out.update({d.name: ("model", "kv", "compute") for d in none})
    return {name: kinds for name, kinds in out.items() if kinds}


def with_projection(plan: MemoryPlan, projection: Mapping[str, Mapping[str, int]], source: str) -> MemoryPlan:
    """`plan` with the kinds fitter guesses on each device (`projected_on`) replaced by one buffer holding the
    projection's figure, rounded up to the MiB it floored (never below llama.cpp); fitter's exact kinds and its
    output buffer (in no kind the projection prints) stay. Raises when the projection lacks a device of the plan:
    that build cannot see it."""
    kinds = guessed_kinds(plan.model, plan.devices)
    if not kinds:
        return plan
    on = projected_on(plan.model, plan.devices)
    names = [CPU, *(d.name for d in plan.devices)]
    missing = [n for n in names if n not in projection]
    if missing:
        raise FitterError(f"llama.cpp's projection ({source}) has no {', '.join(missing)} (it sees "
                          f"{', '.join(projection) or 'nothing'}): project with a build of that backend "
                          "(--llama-cpp DIR), or take fitter's guess with --projection never")
    had = {(b.device, b.kind) for b in plan.buffers}
    buffers = [b for b in plan.buffers if b.kind not in on.get(b.device, ())]
    for name in names:
        for kind in on.get(name, ()):
            floored = projection[name].get(kind, 0)
            if floored or (name, kind) in had:
                buffers.append(Buffer(name, kind, name, _round_up(floored)))
    guess = guess_warning(plan.model, plan.devices)
    warnings = [w for w in plan.warnings if w != guess]
    note = projection_warning(plan.model, plan.devices, source)
    warnings.append(note if unruled(plan.devices) else note + _logits_note(plan, kinds))
    return replace(plan, buffers=tuple(buffers), warnings=tuple(warnings), projected=kinds)


def projection_warning(spec: ModelSpec, devices: Sequence[Device], source: str) -> str:
    """What a plan says once the kinds fitter guesses come from llama.cpp's projection by `source` (a command that
    projects every config says it once, as `fitter estimate` does for its one)."""
    if (none := unruled(devices)):
        return (f"{', '.join(d.name for d in none)}: every buffer from llama.cpp's own projection ({source}), its "
                "floored MiB rounded up: fitter has no rules for this backend")
    kinds = guessed_kinds(spec, devices)
    return (f"{spec.arch}: {' and '.join(kinds)} from llama.cpp's own projection ({source}), its floored MiB rounded "
            f"up: fitter has no rules for {'it' if len(kinds) == 1 else 'them'} on this architecture")


def _logits_note(plan: MemoryPlan, kinds: tuple[str, ...]) -> str:
    """What the projection's compute reserves beyond the program's: llama-fit-params reserves logits for a whole
    ubatch (the C API's n_outputs_max 0 = n_batch), a server one per slot. The projection cannot say whether that
    tensor is a device's peak (the last layer's may be larger), so the figure stays the tool's, an upper bound."""
    ctx = plan.context
    outputs = min(ctx.n_ubatch, ctx.n_batch)
    if "compute" not in kinds or ctx.n_outputs_max >= outputs:
        return ""
    extra = plan.model.n_vocab * (outputs - ctx.n_outputs_max) * 4
    return (f"; its compute reserves logits for {outputs} outputs where {plan.config.consumer} reserves "
            f"{ctx.n_outputs_max}, so the output layer's device is up to {extra / MIB:.2f} MiB high")

