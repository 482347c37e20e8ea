"""Screening a configuration before anything is launched: the estimator's memory plan against the budgets.

A trial's constraints (Optuna's `trial.set_constraint`, feasible when ≤ 0) are MiB over budget: one per device
(predicted device total plus the margin learned from measured OOMs, minus free memory less the fit target) and one
for host RAM (what RAM holds while serving, fitter.memory.plan.host: the mapped weights the CPU reads, every host
buffer, pinned ones included, llama-server's prompt cache at its --cache-ram limit, and the buffers of a device that
shares the host's memory, an integrated GPU or Apple silicon, so no byte is promised twice; minus available RAM).
Pure: no files, no processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fitter.errors import FitterError
from fitter.gguf.model_spec import ModelSpec, Role
from fitter.memory.backends.devices import CpuProfile, Device
from fitter.memory.plan.estimator import MemoryPlan, estimate
from fitter.memory.plan.host import host_memory
from fitter.memory.plan.projected import with_projection
from fitter.memory.plan.tensor_split import meta_buft_name
from fitter.units import MIB


@dataclass(frozen=True)
class Budgets:
    devices: dict[str, int]  # device name → bytes the plan may use (free memory minus the fit target)
    host: int | None  # bytes of RAM the model mapping and host buffers may use; None: not checked
    margins: dict[str, int]  # device name → bytes added to every prediction (learned from measured OOMs)

    def with_margin(self, device: str, margin: int) -> Budgets:
        margins = dict(self.margins)
        margins[device] = max(margins.get(device, 0), margin)
        return replace(self, margins=margins)


@dataclass(frozen=True)
class Screen:
    plan: MemoryPlan | None
    constraints: dict[str, float]  # "vram:CUDA0" / "ram" → MiB over budget (≤ 0 feasible)
    error: str | None = None  # llama.cpp would refuse the config (e.g. quantized V without flash attention)
    projection: dict[str, dict[str, int]] | None = None  # the build's own projection, when the drift guard asked

    def with_projection(self, projection: dict[str, dict[str, int]], budgets: Budgets) -> Screen:
        """Screened with the larger of fitter's estimate and the build's projection on each device."""
        constraints = dict(self.constraints)
        for name, budget in budgets.devices.items():
            if name in projection:
                theirs = sum(projection[name].values()) + budgets.margins.get(name, 0)
                constraints[f"vram:{name}"] = max(constraints.get(f"vram:{name}", float("-inf")),
                                                  (theirs - budget) / MIB)
        return replace(self, constraints=constraints, projection=projection)

    @property
    def feasible(self) -> bool:
        return self.error is None and all(v <= 0 for v in self.constraints.values())

    def reason(self) -> str:
        if self.error:
            return self.error
        over = {k: v for k, v in self.constraints.items() if v > 0}
        return "predicted over budget: " + ", ".join(f"{k} by {v:.1f} MiB" for k, v in sorted(over.items()))


def device_totals(plan: MemoryPlan) -> dict[str, int]:
    totals = plan.totals()
    return {name: t.total for name, t in totals.items()}


def screen(spec: ModelSpec, config: Any, devices: tuple[Device, ...], cpu: CpuProfile, budgets: Budgets,
           projected: tuple[Mapping[str, Mapping[str, int]], str] | None = None) -> Screen:
    """The config's verdict; `projected` (llama.cpp's projection of it, and where from) replaces the memory fitter
    only guesses for the model (fitter.memory.plan.projected). A projection that lacks a device raises: no config can
    be screened then."""
    try:
        plan = estimate(spec, config, devices, cpu)
    except FitterError as e:
        return Screen(None, {}, str(e))
    if projected is not None:
        plan = with_projection(plan, *projected)
    totals = device_totals(plan)
    constraints: dict[str, float] = {}
    for name, budget in budgets.devices.items():
        used = totals.get(name, 0) + budgets.margins.get(name, 0)
        constraints[f"vram:{name}"] = (used - budget) / MIB
    if budgets.host is not None:  # what RAM holds while serving, a device sharing it included: one pool
        constraints["ram"] = (host_memory(plan).total - budgets.host) / MIB
    return Screen(plan, constraints)


def cpu_bytes_per_token(plan: MemoryPlan) -> float:
    """Weight bytes the CPU reads to decode one token: every CPU-resident tensor once, experts only for the
    `n_expert_used` of `n_expert` the router picks, the token embedding one row. Decode is memory-bound, so fewer
    bytes read from RAM is the physical prior for a faster decode (what puts experts on the GPU first)."""
    spec = plan.model
    share = spec.n_expert_used / spec.n_expert if spec.n_expert else 1.0
    total = 0.0
    device_names = {d.name for d in plan.devices} | {meta_buft_name(plan.devices)}  # -sm tensor: the Meta device
    for p in plan.placements:
        if p.buft in device_names:
            continue
        t = p.tensor
        if t.role == Role.EMBEDDING:
            total += t.n_bytes / max(1, t.ne[-1])
        elif t.role == Role.EXPERT:
            total += t.n_bytes * share
        else:
            total += t.n_bytes
    return total
