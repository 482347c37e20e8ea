"""Several models loaded together on one machine (llama-server's router: `--models-preset FILE --models-max N`, or a
llama-swap group): one fit for the set, where each model's buffers share every device's budget.

llama-server's router starts one child llama-server per loaded model (tools/server/server-models.cpp: each preset
rendered to its own argv), so the models' buffers add up on each device: at most `--models-max` of them at once (0:
every model). The set fits when, on every device, the `models_max` largest of the models' totals fit its budget
(free memory less the fit target, as one model's fit); the router may load any of them together.

How the budget is shared: each model alone has a lightest placement (every expert and, unless -ngl was given, every
layer on the CPU: what it holds on the GPU whatever is chosen) and its best placement (its own fit with the device to
itself). Every model gets the same share α of the room between the two, on each device; α is the largest (to 1/2^12)
at which every model's own fit within its share leaves the set within the budget. The same α for every model is a
choice: no model's decode is traded away for another's, and the set's result does not depend on the order the
models are given in."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fitter.errors import FitterError
from fitter.flags import LaunchConfig
from fitter.gguf.model_spec import ModelSpec
from fitter.memory.backends.devices import CPU_AVX2, CpuProfile, Device
from fitter.memory.fit.budgets import DEFAULT_FIT_CTX, device_budgets
from fitter.memory.fit.fit import FitResult, fit
from fitter.units import MIB

_STEPS = 12  # the bisection of α: a share to 1/4096 of each model's room


@dataclass(frozen=True)
class SetModel:
    name: str  # the preset's section name (llama-server's router calls the model by it)
    path: str
    spec: ModelSpec
    base: LaunchConfig  # the flags the preset gives it (its fixed context, KV types, ...)


@dataclass(frozen=True)
class JointFit:
    fits: bool
    share: float  # α: each model's share of the room between its lightest and its best placement
    results: tuple[FitResult, ...]  # per model, in the order given
    budgets: dict[str, int]  # device → free memory less the fit target (the processes' overheads are in `worst`)
    worst: dict[str, int]  # device → the `models_max` largest totals together: what the router can load at once
    models_max: int
    shortfall: int | None = None  # bytes over budget on the worst device when not even the lightest set fits


def _totals(result: FitResult) -> dict[str, int]:
    totals = result.plan.totals()
    return {d.name: totals[d.name].total for d in result.plan.devices if d.name in totals}


def together(per_model: list[dict[str, int]], devices: tuple[Device, ...], models_max: int) -> dict[str, int]:
    """Per device, the sum of the `models_max` largest totals (0: all), each with its process's overhead (the
    router's children are one llama-server each): the most the router can hold there."""
    n = models_max or len(per_model)
    return {d.name: sum(sorted((t.get(d.name, 0) + _overhead(d) for t in per_model), reverse=True)[:n])
            for d in devices}


def _overhead(d: Device) -> int:
    return d.overhead.bytes if d.overhead is not None else 0


def _within(devices: tuple[Device, ...], share: dict[str, int]) -> tuple[Device, ...]:
    """The devices as one model's process sees them within its share: its own context's overhead (a CUDA context per
    llama-server the router starts) and its share of the buffers; fitted with no target (the set's is out)."""
    return tuple(replace(d, free_bytes=max(share[d.name], 0) + _overhead(d)) for d in devices)


def joint_fit(models: list[SetModel], devices: tuple[Device, ...], targets_mib: tuple[int, ...],
              models_max: int = 0, fit_ctx: int = DEFAULT_FIT_CTX, cpu: CpuProfile = CPU_AVX2) -> JointFit:
    """The placements of a set of models loaded together (see the module docstring)."""
    if not models:
        raise FitterError("fitter fit: no models in the set")
    if models_max < 0:
        raise FitterError(f"--models-max {models_max}: give 0 (every model at once) or more")
    budgets: dict[str, int] = {}
    for name, budget in device_budgets(devices, targets_mib).items():
        if budget is None:
            raise FitterError(f"{name}: its free memory is unknown; give --devices cuda:MiB or --emulated-gpu MiB")
        budgets[name] = budget
    for d in devices:  # free less the target: each model's process brings its own overhead (together)
        budgets[d.name] += _overhead(d)
    none = (0,) * len(devices)
    alone = [fit(m.spec, m.base, devices, targets_mib, fit_ctx, cpu) for m in models]
    nothing = dict.fromkeys(budgets, 0)
    lightest = [fit(m.spec, m.base, _within(devices, nothing), none, fit_ctx, cpu) for m in models]
    light = [_totals(r) for r in lightest]
    best = [_totals(r) for r in alone]

    def placed(alpha: float) -> list[FitResult] | None:
        out = []
        for m, lo, hi in zip(models, light, best, strict=True):
            share = {d: lo.get(d, 0) + int(alpha * max(hi.get(d, 0) - lo.get(d, 0), 0)) for d in budgets}
            r = fit(m.spec, m.base, _within(devices, share), none, fit_ctx, cpu)
            if not r.fits:
                return None
            out.append(r)
        used = together([_totals(r) for r in out], devices, models_max)
        return out if all(used[d] <= budgets[d] for d in budgets) else None

    found = placed(1.0)
    alpha = 1.0
    if found is None:
        lo_a, hi_a = 0.0, 1.0
        found = placed(0.0)
        alpha = 0.0
        if found is None:  # not even every model at its lightest
            used = together(light, devices, models_max)
            over = max(used[d] - budgets[d] for d in budgets)
            return JointFit(False, 0.0, tuple(lightest), budgets, used, models_max, over)
        for _ in range(_STEPS):
            mid = (lo_a + hi_a) / 2
            trial = placed(mid)
            if trial is None:
                hi_a = mid
            else:
                lo_a, found, alpha = mid, trial, mid
    worst = together([_totals(r) for r in found], devices, models_max)
    return JointFit(True, alpha, tuple(found), budgets, worst, models_max)


def joint_lines(models: list[SetModel], result: JointFit) -> list[str]:
    """The set's fit as `fitter fit` prints it: per model its placement and bytes per device, then the devices."""
    names = list(result.budgets)
    head = (f"{len(models)} models loaded together (--models-max {result.models_max or 'all'}): "
            + ("fits" if result.fits else f"does not fit: {result.shortfall / MIB:.1f} MiB over even with every "
               "model at its lightest placement" if result.shortfall is not None else "does not fit"))
    lines = [head]
    if result.fits:
        lines.append(f"each model has {result.share:.0%} of the room between its lightest placement and its own "
                     "best fit")
    for m, r in zip(models, result.results, strict=True):
        totals = _totals(r)
        per = ", ".join(f"{d} {totals.get(d, 0) / MIB:.1f} MiB" for d in names)
        lines.append(f"  [{m.name}] {m.path}: {r.expert_layers_on_device} expert layers on the GPU; {per}")
    for d in names:
        lines.append(f"{d}: {result.worst[d] / MIB:.1f} MiB of {result.budgets[d] / MIB:.1f} MiB budget")
    return lines
