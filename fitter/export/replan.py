"""A tuned configuration exported for another program than the one it was tuned for: re-planned, never silently.

The same flags reserve different memory in llama-server and in llama-cpp-python (fitter.flags.consumers): the C
API reserves logits for a whole ubatch where llama-server reserves one output per slot, and llama-bench fixes one
sequence and no full SWA cache. Before such an export is printed, the picked config is estimated for both programs
on the devices it was measured on, every device total that changed is named, and a plan over the budget the tune
screened with (recorded in pareto.json) is refused with the excess. Pure: the model spec comes from the caller.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from fitter.flags import LaunchConfig
from fitter.flags.consumers import retarget
from fitter.flags.overrides import with_bufts
from fitter.flags.parse import flag_value
from fitter.gguf.model_spec import ModelSpec
from fitter.memory.backends.devices import (
    CPU_AVX2,
    CUDA,
    DISCRETE_VULKAN,
    CpuProfile,
    Device,
    emulated_gpu_names,
    rpc_devices,
)
from fitter.memory.backends.registry import UNKNOWN, backend_of, device_profile
from fitter.memory.plan.estimator import estimate
from fitter.results.pareto import Entry, ParetoDoc
from fitter.units import MIB

# Which program each export format is read by; json keeps the result's own.
FORMAT_CONSUMER = {"server": "llama-server", "preset-ini": "llama-server", "llama-swap": "llama-server",
                   "launcher": "llama-server",
                   "python": "llama-cpp-python"}


@dataclass(frozen=True)
class Replan:
    tuned_for: str
    target: str
    config: LaunchConfig  # the pick as the target program runs it
    changes: tuple[str, ...]  # one line per device total (and context parameter) that differs
    over: dict[str, int]  # device → bytes the target's plan is over its recorded budget

    @property
    def fits(self) -> bool:
        return not self.over

    def note(self) -> str:
        head = f"re-planned for {self.target} (tuned for {self.tuned_for})"
        return head + (": " + "; ".join(self.changes) if self.changes else ": the same memory")


def measured_devices(entry: Entry, doc: ParetoDoc | None = None, named: tuple[str, ...] = ()) -> tuple[Device, ...]:
    """The devices the entry's confirm run allocated on, by the names llama.cpp logged (RPC0[host:port], CUDA0),
    and those -dev names (`named`: an export pins the build's devices the trials used), with the rules they were
    tuned under (the CUDA-shaped emulated GPU: CUDA's) and, for the layer split, their recorded budgets as their
    free memory."""
    names = [n for n in (entry.measurement.logged_devices if entry.measurement else {}) if n != "CPU"]
    names += [n for n in named if n not in names and n != "none"]
    budgets = recorded_budgets(doc) if doc is not None else {}
    cuda_shaped = doc is not None and doc.machine.get("emulated_gpu_kind") == "cuda"
    devices: list[Device] = []
    for name in names:
        free = budgets.get(name)
        rpc = re.fullmatch(r"RPC\d+\[(.+)\]", name)
        if rpc:
            (dev,) = rpc_devices([rpc.group(1)])
            devices.append(replace(dev, profile=CUDA if cuda_shaped else dev.profile, free_bytes=free))
        elif (backend := backend_of(name)) is not UNKNOWN and backend.name != "RPC" \
                and backend.device_type != "accel":
            # its backend's rules (a Vulkan card's limits are not recorded: a typical discrete card's stand in; the
            # re-plan is a difference between two programs on the same device, which they barely move)
            devices.append(Device(name, device_profile(backend, DISCRETE_VULKAN if backend.name == "Vulkan"
                                                       else None), free_bytes=free))
    return tuple(devices)


def recorded_budgets(doc: ParetoDoc) -> dict[str, int]:
    """Device → bytes the tune screened against: pareto.json's `budgets`, else (results written before it) the
    emulated GPU's cap less the fit target; {} when the result does not say."""
    recorded = doc.data.get("budgets")
    budgets = recorded.get("devices") if isinstance(recorded, dict) else None
    if isinstance(budgets, dict):
        return {k: int(v) for k, v in budgets.items() if isinstance(v, int)}
    cap = doc.machine.get("emulated_gpu_mib")
    entry_devices = measured_devices(doc.baseline) or (measured_devices(doc.pareto[0]) if doc.pareto else ())
    if isinstance(cap, int) and len(entry_devices) == 1:
        target = (doc.fit_targets() or (0,))[0]
        return {entry_devices[0].name: (cap - target) * MIB}
    return {}


def _on_measured_devices(config: LaunchConfig, entry: Entry) -> LaunchConfig:
    """A pick whose rules an export renamed from the i-th emulated GPU to CUDA<i> (fitter.export.launchers), with
    the emulated GPUs' names again, as it was measured: the i-th endpoint of the trial's --rpc."""
    endpoints = [e for e in (flag_value(list(entry.flags or []), "rpc") or "").split(",") if e]
    if not endpoints or config.rpc:
        return config
    as_measured = {cuda: rpc for rpc, cuda in emulated_gpu_names(endpoints).items()}
    return replace(config, overrides=with_bufts(config.overrides, as_measured))


def replan(doc: ParetoDoc, entry: Entry, config: LaunchConfig, target: str, spec: ModelSpec,
           cpu: CpuProfile = CPU_AVX2) -> Replan:
    """`config` (the pick, parsed as its program reads it, with the devices it ran on) for program `target`."""
    devices = measured_devices(entry, doc, config.device_names)
    config = _on_measured_devices(config, entry)
    before = estimate(spec, config, devices, cpu)
    moved = retarget(config, target)
    after = estimate(spec, moved, devices, cpu)
    changes: list[str] = []
    if config.draft_model and not moved.draft_model:
        changes.append(f"the draft model (-md {config.draft_model}) left out: {target} loads none")
    if config.mmproj and not moved.mmproj:
        changes.append(f"the projector (--mmproj {config.mmproj}) left out: {target} loads none with the model")
    b, a = before.context, after.context
    for label, old, new in (("n_seq_max", b.n_seq_max, a.n_seq_max), ("n_outputs_max", b.n_outputs_max,
                            a.n_outputs_max), ("swa_full", b.swa_full, a.swa_full)):
        if old != new:
            changes.append(f"{label} {old} → {new}")
    old_totals, new_totals = before.totals(), after.totals()
    for name, t in new_totals.items():
        o = old_totals.get(name)
        if o is not None and o.total != t.total:
            changes.append(f"{name} {o.total / MIB:.2f} → {t.total / MIB:.2f} MiB "
                           f"(compute {o.compute / MIB:.2f} → {t.compute / MIB:.2f})")
    budgets = recorded_budgets(doc)
    if not budgets and devices:
        changes.append("no recorded budget to check it against (a result written before fitter recorded them)")
    # what the confirm run logged, moved by the estimator's difference between the two programs
    logged = entry.measurement.logged_devices if entry.measurement else {}
    over = {}
    for name, budget in budgets.items():
        if name not in new_totals:
            continue
        base = logged.get(name, {}).get("total") if isinstance(logged.get(name), dict) else None
        need = (int(base) if isinstance(base, int) else old_totals[name].total) + new_totals[name].total \
            - old_totals[name].total
        if need > budget:
            over[name] = need - budget
    return Replan(doc.consumer, target, moved, tuple(changes), over)
