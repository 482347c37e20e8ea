"""What a tune checks before its study and guards during it: that something of the space fits at all (else by how
much it misses, and what would fit), the projection a model fitter guesses a kind for is screened with, and the
drift guard (a build's own projection beside fitter's estimate) when fitter's rules may not hold for the build."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from fitter.errors import FitterError
from fitter.flags import placement_flags
from fitter.flags.parse import searched_flags
from fitter.measure.llamacpp.builds import LlamaCppBuild
from fitter.measure.llamacpp.projection import Projector, guess_projector
from fitter.memory.fit.budgets import lowered_targets
from fitter.memory.fit.fit import fit
from fitter.memory.plan.projected import guess_warning, guessed_kinds
from fitter.search import split
from fitter.search.plan import Screener
from fitter.search.request import TuneRequest, candidate, combos
from fitter.tune.options import TuneOptions
from fitter.tune.targets import Target
from fitter.units import MIB


def check_something_fits(req: TuneRequest, targets: tuple[int, ...]) -> None:
    """A model that cannot fit even with every expert on the CPU: no trials; by how much, and what would fit."""
    screener = Screener(req)
    all_combos = combos(req)
    if any(screener.placement(c) is not None for c in all_combos):
        return
    lightest: tuple[float, str] | None = None
    lightest_over: dict[str, float] = {}
    for c in all_combos:
        params = screener._with_threads(c)
        if "n-cpu-moe" in req.distributions:
            params["n-cpu-moe"] = req.spec.n_layer
        if split.MODE in req.distributions:  # every expert on the CPU, llama.cpp's own split
            params.update({split.experts_key(i): req.spec.n_layer for i in range(len(req.devices))})
        if "n-gpu-layers" in req.distributions:
            params["n-gpu-layers"] = 0
        cand = candidate(req, params)
        s = screener(cand)
        if s.error is None and s.constraints:
            worst = max(s.constraints.items(), key=lambda kv: kv[1])
            if lightest is None or worst[1] < lightest[0]:
                searched = " ".join(searched_flags(list(cand.flags), req.fixed_flags))
                lightest = (worst[1], f"{worst[0]} by {worst[1]:.1f} MiB with {searched}")
                lightest_over = dict(s.constraints)
    detail = f" the lightest configuration is over budget on {lightest[1]};" if lightest else ""
    lower = targets_that_fit(lightest_over, req, targets)
    if lower is not None:
        detail += f" --fit-target {','.join(map(str, lower))} would fit it;"
    if req.devices:
        projector = req.projector if guessed_kinds(req.spec, req.devices) else None
        result = fit(req.spec, req.base, req.devices, targets, cpu=req.cpu, projects=projector)
        if result.fits:
            detail += f" fitter fit finds a placement outside the space: {' '.join(placement_flags(result.config))}"
        elif result.suggestions:
            detail += " would fit: " + "; ".join(result.suggestions)
    raise FitterError(f"{req.model}: no configuration of the search space fits ({req.spec.n_layer} layers; budgets "
                      + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in req.budgets.devices.items())
                      + f"; host RAM {(req.budgets.host or 0) / MIB:.0f} MiB);{detail}; nothing was launched")


def targets_that_fit(over: dict[str, float], req: TuneRequest, targets: tuple[int, ...]) -> tuple[int, ...] | None:
    """The largest fit target (MiB) per device under which a configuration over budget by `over` (MiB per
    constraint, fitter.search.screen) fits: each device's target less what it is over by, rounded up to a MiB; None
    where a constraint no fit target moves is over (host RAM) or no target can make room (a device over by more than
    its target)."""
    if not over or any(v > 0 and not k.startswith("vram:") for k, v in over.items()):
        return None
    return lowered_targets([over.get(f"vram:{d.name}", 0.0) for d in req.devices], targets)


def projected_before_start(o: TuneOptions, target: Target, planned: TuneRequest, tool: Path | None,
                           log: Callable[[str], None]) -> TuneRequest:
    """The request the checks before the study (and --dry-run) screen with, for a model fitter guesses a kind for:
    llama.cpp's projection where the build can see the devices (the CPU, real GPUs); a simulated GPU it never sees,
    so that is refused; an emulated GPU is started only by the run, so until then the guess, said aloud."""
    devices = target.planned_devices
    kinds = " and ".join(guessed_kinds(o.spec, devices))
    projector = guess_projector(o.spec, tool, "no llama-fit-params was found (--llama-fit-params PATH)",
                                devices=devices)
    if target.sim is not None and target.planned_devices:
        raise FitterError(f"{o.model}: fitter has no rules for the {kinds} memory of "
                          f"{o.spec.arch!r}, and llama.cpp cannot project a simulated machine's GPUs: take fitter's "
                          "guess with --projection never")
    if target.planned_rpc:  # as `fitter estimate` warns of a guess, then why this one is taken for now
        log(f"fitter: warning: {guess_warning(o.spec, devices)}")
        log(f"fitter: warning: {o.spec.arch}: before the emulated GPU starts, the feasible region is fitter's guess "
            f"of its {kinds} memory; every trial is screened by {projector.source}")
        return planned
    log(f"fitter: {o.spec.arch}: fitter has no rules for its {kinds} memory: every "
        f"config is screened by {projector.source}")
    return replace(planned, projector=projector)


def drift_guard(o: TuneOptions, users: LlamaCppBuild, commit: str, rpc: tuple[str, ...],
                log: Callable[[str], None]) -> Projector | None:
    """The build's own projection of each config before it is launched, when fitter's rules may not hold for it:
    another commit than the one they were matched against, a CUDA device (no golden from a CUDA build yet) or a
    backend fitter has no rules for (`--projection auto`); `always`/`never` force it. The screen then takes the
    larger of the two per device (fitter.search.screen.Screen.with_projection), and the trial records both."""
    from fitter import LLAMA_CPP_TARGET
    from fitter.measure.llamacpp.builds import list_devices

    tool, projection = users.llama_fit_params, o.measure.projection
    if projection == "never" or tool is None:
        if projection == "always":
            raise FitterError(f"--projection always: {users.folder} has no llama-fit-params to project with")
        return None
    why = None
    if projection == "always":
        why = "asked for"
    elif not commit.startswith(LLAMA_CPP_TARGET["commit"]):
        why = f"the build is {commit}, fitter's rules were matched against {LLAMA_CPP_TARGET['commit']}"
    else:
        unchecked = [d.name for d in list_devices(users, rpc) if not _checked_by_goldens(d.name, d.description)]
        if unchecked:
            why = f"{', '.join(unchecked)}: no golden data from that backend or device yet"
    if why is None:
        return None
    log(f"fitter: drift guard on ({why}): each config is projected by {tool} before it is launched, and screened "
        "with the larger of that and fitter's estimate")
    return Projector(tool, o.spec, rpc)


def _checked_by_goldens(name: str, description: str) -> bool:
    """Whether fitter's rules for a listed device were checked against real loads on such a device: RPC
    (tests/golden/rpc.json) and Vulkan on lavapipe (vulkan-emulated.json); a Vulkan card's driver, a CUDA build
    (its goldens are the emulated GPU's) and every other backend not yet."""
    from fitter.measure.emulator.emulated_vulkan import LAVAPIPE
    from fitter.memory.backends.registry import backend_of

    backend = backend_of(name).name
    return backend == "RPC" or (backend == "Vulkan" and description.startswith(LAVAPIPE))

