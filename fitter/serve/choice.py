"""`fitter serve`'s choice: a tuning result's configs as this machine would run them now, and the one that fits.

The result is refused in one line where serving it would not run what was measured: its model file changed (header
identity), the machine's GPUs changed (fitter.check.run.gpu_change), the build's devices changed
(fitter.measure.llamacpp.builds.build_change), or it was measured on an emulated GPU that llama-server cannot be
(the CUDA-shaped one lives in fitter's own client; the Vulkan one in its Vulkan build). Extra llama-server flags that
change what a config allocates are refused too: the choice is made for the configs as measured.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fitter.errors import FitterError, LaunchConfigError
from fitter.export.candidates import (
    Choice,
    LaunchLine,
    Option,
    Room,
    choose,
    measured_line,
    policy_order,
    replans,
    rooms,
)
from fitter.flags import parse_launch_flags, split_process_flags
from fitter.flags.parse import flag_value, process_flags_of, with_endpoints
from fitter.flags.vocabulary import BY_NAME
from fitter.gguf.model_spec import ModelSpec, with_draft
from fitter.gguf.projector import with_projector
from fitter.memory.backends.devices import CPU_AVX2, CpuProfile, Device
from fitter.memory.fit.budgets import DEFAULT_FIT_CTX, DEFAULT_FIT_TARGET_MIB
from fitter.results.pareto import ParetoDoc, recorded_model


@dataclass(frozen=True)
class Plan:
    """What `fitter serve` starts: the llama-server line, and why."""

    argv: tuple[str, ...]  # empty when nothing fits
    choice: Choice
    candidates: tuple[LaunchLine, ...]  # the measured ones, in the policy's order (with their needs now)
    room: dict[str, Room]


def tuned_model(doc: ParetoDoc, override: str | None = None) -> tuple[str, ModelSpec]:
    """The model the result was tuned on (its header; --model gives it at another path): refused when its header
    identity is not the one recorded."""
    return recorded_model(doc, override, ": its configs were measured on another file; tune it again")


def recorded_caps(doc: ParetoDoc) -> tuple[int, ...] | None:
    """The caps (MiB) of the emulated GPUs the result was measured on, None when it was not; refused for the
    emulated GPUs llama-server cannot be."""
    if not doc.emulated and not any(e.measurement is not None and e.measurement.emulated for e in doc.pareto):
        return None
    kind = doc.machine.get("emulated_gpu_kind", "rpc")
    if kind != "rpc":
        raise FitterError(f"{doc.source}: measured on fitter's {kind}-shaped emulated GPU, which llama-server cannot "
                          "be (its rules live in fitter's own client or its Vulkan build): export it with `fitter "
                          "export`, or tune with --emulated-gpu MiB to serve it")
    cap = doc.machine.get("emulated_gpu_mib")
    caps = cap if isinstance(cap, list) else [cap]
    if not caps or not all(type(c) is int and c >= 1 for c in caps):
        raise FitterError(f"{doc.source}: measured on the emulated GPU but machine.emulated_gpu_mib is {cap!r}: "
                          "cannot start one of the same cap")
    return tuple(caps)


def passed_through(extra: Sequence[str]) -> list[str]:
    """The flags after `--`, refused when one is a flag fitter models (it changes what a config allocates, where,
    or with how many threads): the configs are served as measured."""
    for token in extra:
        name = token.split("=", 1)[0] if token.startswith("--") else token
        if name in BY_NAME:
            raise FitterError(f"-- {token}: a flag the served configs pin (it changes what they allocate, where, or "
                              "how they run); after -- give what the result does not decide (--host, --port, "
                              "--api-key, --alias, --jinja, ...), or tune with it")
    return list(extra)


def options(doc: ParetoDoc, policy: str, endpoints: tuple[str, ...] = ()) -> list[Option]:
    """The result's configs in the policy's order, parsed as llama-server reads them, the emulated GPUs' recorded
    endpoints moved to `endpoints` (the fresh ones'). A config that does not pin what llama-server would decide at
    launch (-fa auto, -ngl auto) is left out, and refused when it is the pick."""
    out = []
    for i, entry in enumerate(policy_order(doc, policy)):
        where = f"{doc.source}: trial {entry.trial}"
        try:
            flags = list(entry.flags or ())
            old = [x for x in (flag_value(flags, "rpc") or "").split(",") if x]
            if old and len(old) != len(endpoints):
                raise FitterError(f"--rpc {','.join(old)}: {len(old)} emulated GPUs, {len(endpoints)} started")
            flags = with_endpoints(flags, old, endpoints) if old else flags
            launch, _ = split_process_flags(flags, where)
            config = parse_launch_flags(launch, doc.consumer)
            process = process_flags_of(flags)
            if config.flash_attn == "auto" or config.n_gpu_layers == -1 or process.threads is None:
                raise FitterError("-fa auto, -ngl auto or no -t: llama-server would decide them at launch")
        except (FitterError, LaunchConfigError) as e:
            if i == 0:
                raise FitterError(f"{where} (the {policy} pick): {e}; serve runs pinned configs: tune with them "
                                  "pinned") from None
            continue
        assert entry.trial is not None
        speeds = {k: v for k in ("tg", "pp") if (v := entry.speed(k)) is not None}
        out.append(Option(entry.trial, config, process, speeds))
    return out


def with_extras(spec: ModelSpec, option: Option) -> ModelSpec:
    """The model with the draft's and the projector's memory where the config loads them."""
    if option.config.draft_model:
        spec = with_draft(spec, option.config.draft_model)
    if option.config.mmproj:
        spec = with_projector(spec, option.config.mmproj)
    return spec


def plan_serve(doc: ParetoDoc, policy: str, spec: ModelSpec, binary: str, model_path: str,
               devices: Sequence[Device], endpoints: tuple[str, ...] = (), extra: Sequence[str] = (),
               cpu: CpuProfile = CPU_AVX2, min_ctx: int = DEFAULT_FIT_CTX) -> Plan:
    """The choice for `devices` as they are now (their free memory): pure once the devices are read."""
    opts = options(doc, policy, endpoints)
    targets = doc.fit_targets() or (DEFAULT_FIT_TARGET_MIB,)
    room = rooms(devices, targets if len(targets) in (1, len(devices)) else targets[:1])
    measured = [c for o in opts if (c := measured_line(o, with_extras(spec, o), devices, cpu)) is not None]

    def replanned() -> Iterator[LaunchLine]:
        if opts and measured and measured[0].trial == opts[0].trial:
            yield from replans(opts[0], with_extras(spec, opts[0]), devices, cpu, min_ctx)

    choice = choose(policy, measured, replanned(), room, doc.source)
    c = choice.candidate
    argv = (binary, "-m", model_path, *c.flags, *extra) if c is not None else ()
    return Plan(argv, choice, tuple(measured), room)


def server_binary(doc: ParetoDoc, build_dir: str | None) -> str:
    """The llama-server to run: --llama-cpp DIR's, else the one the result was measured with, else fitter's pinned
    build's (the llama.cpp llama-cpp-python vendors), else the one on PATH."""
    from fitter.measure.llamacpp.builds import find_build
    from fitter.measure.llamacpp.tools import built_tools

    if build_dir is not None:
        return str(find_build(build_dir).llama_server)
    recorded = doc.llama_cpp.get("llama_server")
    if isinstance(recorded, str) and recorded:
        if not Path(recorded).is_file():
            raise FitterError(f"{doc.source}: tuned with {recorded}, which is gone; rebuild it there, or give "
                              "another build with --llama-cpp DIR")
        return recorded
    pinned = built_tools()
    if pinned is not None:
        return str(pinned / "llama-server")
    found = shutil.which("llama-server")
    if found is None:
        raise FitterError("no llama-server: give a llama.cpp build with --llama-cpp DIR, or build fitter's pinned one "
                          "(python -m fitter.measure.llamacpp.tools)")
    return found
