"""`fitter tune --models-preset FILE [--models-max N]`: models loaded together (llama-server's router) tuned as a set.
The set is fitted first (fitter.memory.fit.joint: every model's buffers and process on every device at once); each
model is then tuned within its share of that fit (its fit target is what the others and the fit target leave), so
any `--models-max` of the picks load together; the picks are written as one router preset."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fitter.cli.common import devices_and_cpu, load_model
from fitter.cli.fit_set import set_models
from fitter.errors import FitterError
from fitter.flags import LaunchConfig
from fitter.memory.backends.devices import Device
from fitter.memory.fit.budgets import DEFAULT_FIT_TARGET_MIB, parse_fit_targets
from fitter.memory.fit.joint import SetModel, joint_fit
from fitter.units import MIB

SET_PRESET = "set-preset.ini"  # the picks of a set, in the results root


def _devices(ns: argparse.Namespace, config: LaunchConfig) -> tuple[tuple[Device, ...], Any]:
    """The devices the set is fitted on, as its tunes will see them: the emulated GPUs (started for their listing,
    then stopped: each tune starts its own), else this machine's."""
    if ns.emulated_gpu is None:
        return devices_and_cpu(ns, config)
    from fitter.cli.common import cpu_here
    from fitter.measure.runners import emulated_caps, emulated_gpus

    with emulated_gpus(ns.emulated_kind, emulated_caps(ns.emulated_gpu)) as gpu:
        return tuple(gpu.devices()), cpu_here()


def share_targets(devices: tuple[Device, ...], share: dict[str, int]) -> tuple[int, ...]:
    """The fit target per device (MiB) that leaves one model its share: free memory less its process's overhead less
    the share, rounded up, so the tune's budget never exceeds the share."""
    out = []
    for d in devices:
        free = d.free_bytes if d.free_bytes is not None else d.total_bytes
        if free is None:
            raise FitterError(f"{d.name}: its free memory is unknown; give --emulated-gpu MiB or tune where the GPU is")
        overhead = d.overhead.bytes if d.overhead is not None else 0
        out.append(max(0, math.ceil((free - overhead - share.get(d.name, 0)) / MIB)))
    return tuple(out)


def tune_set(ns: argparse.Namespace, config: LaunchConfig, options_for: Callable[..., Any],
             run_one: Callable[[argparse.Namespace, Any], tuple[int, Any]]) -> int:
    from fitter.cli.fit_set import set_preset_text
    from fitter.export.launchers import pick

    members = set_models(ns, config)
    models = [SetModel(name, path, load_model(path, base), base) for name, path, base in members]
    devices, cpu = _devices(ns, config)
    targets = parse_fit_targets(ns.fit_target) if ns.fit_target else (DEFAULT_FIT_TARGET_MIB,)
    fitted = joint_fit(models, devices, targets, ns.models_max, cpu=cpu)
    if not fitted.fits:
        raise FitterError(f"--models-preset {ns.models_preset}: the set does not fit even with every model at its "
                          f"lightest placement ({(fitted.shortfall or 0) / MIB:.1f} MiB over on the worst device); "
                          "give a smaller --models-max, fewer models or a smaller context")
    picks = []
    for m, r in zip(models, fitted.results, strict=True):
        totals = r.plan.totals()
        share = {d.name: totals[d.name].total for d in devices if d.name in totals}
        mine = share_targets(devices, share)
        within = ", ".join(f"{d.name} {share.get(d.name, 0) / MIB:.1f} MiB" for d in devices)
        print(f"\n== [{m.name}] {m.path}: tuned within {within} (--fit-target {','.join(map(str, mine))})",
              file=sys.stderr, flush=True)
        code, outcome = run_one(ns, options_for(m.path, m.spec, m.base, mine))
        if outcome is None or outcome.result is None or not outcome.result.picks:
            return code or 1
        p = pick(outcome.result, "balanced")
        picks.append((m.name, p.model_path, list(p.flags)))
    path = Path(ns.results) / SET_PRESET
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(set_preset_text(picks, len(models), ns.models_max, list(fitted.budgets)), encoding="utf-8")
    print(f"\nthe set's balanced picks: {path} (llama-server --models-preset {path} --models-max "
          f"{ns.models_max or len(models)})")
    return 0
