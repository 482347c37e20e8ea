"""`fitter fit A.gguf B.gguf …` or `fitter fit --models-preset FILE [--models-max N]`: several models loaded
together (llama-server's router, a llama-swap group) fitted as one set (fitter.memory.fit.joint), and written back as
a router preset (`--write-preset FILE`) that `llama-server --models-preset FILE --models-max N` loads."""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import replace
from pathlib import Path

from fitter.cli.common import devices_and_cpu, load_model
from fitter.errors import FitterError, LaunchConfigError
from fitter.flags import LaunchConfig, parse_launch_flags, pin
from fitter.memory.backends.devices import Device
from fitter.memory.fit.joint import JointFit, SetModel


def set_models(ns: argparse.Namespace, config: LaunchConfig) -> list[tuple[str, str, LaunchConfig]]:
    """(name, path, flags) of every model of the set: the preset's sections (the command line's flags first, each
    section's over them, as the router cascades them), or the models given, each with the command line's flags."""
    from fitter.flags.models_preset import read_models_preset

    given = list(pin(config, given=True))
    if ns.models_preset:
        if ns.model:
            raise FitterError("--models-preset FILE names the set's models: give them there, not on the command line")
        try:
            return [(m.name, m.model, parse_launch_flags([*given, *m.flags], config.consumer))
                    for m in read_models_preset(ns.models_preset)]
        except LaunchConfigError as e:
            raise FitterError(f"--models-preset {ns.models_preset}: {e}") from None
    names = [Path(m).stem for m in ns.model]
    if len(set(names)) != len(names):
        raise FitterError(f"{' '.join(ns.model)}: two models of one name; a router preset names each model by its "
                          "file's stem: give them in a --models-preset file with names of their own")
    return [(n, m, config) for n, m in zip(names, ns.model, strict=True)]


def set_sections(models: list[SetModel], result: JointFit, rpc: tuple[str, ...]
                 ) -> list[tuple[str, str, list[str]]]:
    """(name, path, pinned flags) of each model as fitted, its devices' --rpc servers included."""
    return [(m.name, m.path, pin(replace(r.config, rpc=rpc), r.plan.context))
            for m, r in zip(models, result.results, strict=True)]


def set_preset(sections: list[tuple[str, str, list[str]]], result: JointFit) -> str:
    """The fitted set as a router preset: a section per model (fitter.export.launchers.preset_section)."""
    return set_preset_text(sections, len(sections), result.models_max, list(result.budgets))


def set_preset_text(sections: list[tuple[str, str, list[str]]], n: int, models_max: int, devices: list[str]) -> str:
    from fitter.export.launchers import preset_pairs, preset_section

    text = [f"; fitter: {n} models loaded together on {', '.join(devices)} "
            f"(llama-server --models-preset FILE --models-max {models_max or n})"]
    for name, path, flags in sections:
        text += ["", *preset_section(name, preset_pairs(path, flags))]
    return "\n".join(text) + "\n"


def fit_set(ns: argparse.Namespace, config: LaunchConfig, targets: tuple[int, ...]) -> int:
    from fitter.memory.fit.joint import joint_fit, joint_lines

    members = set_models(ns, config)
    models = [SetModel(name, path, load_model(path, base), base) for name, path, base in members]
    with contextlib.ExitStack() as stack:
        rpc: tuple[str, ...] = config.rpc
        if ns.emulated_gpu is not None:
            from fitter.measure.runners import emulated_caps, emulated_gpus

            if ns.devices or config.rpc:
                raise LaunchConfigError("--emulated-gpu replaces --devices and --rpc: give one target")
            gpu = stack.enter_context(emulated_gpus(ns.emulated_kind, emulated_caps(ns.emulated_gpu)))
            devices: tuple[Device, ...] = gpu.devices()
            rpc = gpu.endpoints
            from fitter.cli.common import cpu_here

            cpu = cpu_here()
        else:
            devices, cpu = devices_and_cpu(ns, config)
        result = joint_fit(models, devices, targets, ns.models_max, ns.fit_ctx, cpu)
    sections = set_sections(models, result, rpc)
    if ns.write_preset and result.fits:
        Path(ns.write_preset).write_text(set_preset(sections, result), encoding="utf-8")
    if ns.json:
        print(json.dumps({"fits": result.fits, "share": result.share, "models_max": result.models_max,
                          "budgets": result.budgets, "worst": result.worst, "shortfall": result.shortfall,
                          "models": [{"name": n, "model": p, "flags": f, "devices": {
                              d.name: t.total for d in r.plan.devices if (t := r.plan.totals().get(d.name))}}
                              for (n, p, f), r in zip(sections, result.results, strict=True)]}, indent=1))
    else:
        print("\n".join(joint_lines(models, result)))
        for name, _, flags in sections:
            print(f"  [{name}] {' '.join(flags)}")
        if ns.write_preset and result.fits:
            print(f"preset: {ns.write_preset} (llama-server --models-preset {ns.write_preset} --models-max "
                  f"{result.models_max or len(models)})")
    return 0 if result.fits else 1
