"""What every command's edge shares: the model argument (the demo model by default) and its warnings, the target
devices, the llama.cpp flags as the user gave them, notes on stderr."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from fitter.errors import LaunchConfigError
from fitter.flags import LaunchConfig, ProcessFlags, launch_config_from_args
from fitter.flags.parse import process_flags_from_args

if TYPE_CHECKING:
    from fitter.gguf.model_spec import ModelSpec
    from fitter.machine.snapshot import MachineSnapshot
    from fitter.memory.devices import Device


def log(message: str) -> None:
    """A note or progress line: stderr, so stdout stays the command's result."""
    print(message, file=sys.stderr, flush=True)


def warn(message: str) -> None:
    log(f"fitter: warning: {message}")


def model_path(arg: str | None) -> str:
    """The model the user named, else the demo model (written into fitter's home on first use)."""
    if arg:
        return arg
    from fitter.gguf.demo_models import demo_model_path

    return str(demo_model_path())


def load_model(path: str) -> ModelSpec:
    """The model's spec, its warnings (an architecture fitter has not matched, …) printed once."""
    from fitter.gguf.model_spec import load_model_spec

    spec = load_model_spec(path)
    for w in spec.warnings:
        warn(w)
    return spec


def launch_args(ns: argparse.Namespace, flags: list[str]) -> tuple[LaunchConfig, ProcessFlags]:
    """The llama.cpp flags parsed once, at the edge: the launch config and the process-level flags."""
    return launch_config_from_args(ns, flags), process_flags_from_args(ns)


def target_devices(ns: argparse.Namespace, config: LaunchConfig, snapshot: MachineSnapshot) -> tuple[Device, ...]:
    """`--devices`, else the config's `--rpc` servers, else this machine's NVIDIA GPUs."""
    from fitter.memory.devices import parse_devices, rpc_devices

    devices_arg = getattr(ns, "devices", "")
    if devices_arg and config.rpc:
        raise LaunchConfigError(f"--devices {devices_arg} and --rpc {','.join(config.rpc)}: give one target, not both")
    if devices_arg:
        return parse_devices(devices_arg)
    if config.rpc:
        return rpc_devices(list(config.rpc))
    return snapshot.devices()


def own_options(parser: argparse.ArgumentParser, launch: set[str]) -> dict[str, int]:
    """fitter's own options of a command (every option it registered that is not a llama.cpp launch flag), with
    how many values each takes: what `llama_flags` leaves out."""
    out: dict[str, int] = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option not in launch:
                out[option] = 0 if action.nargs == 0 else 1
    return out


def llama_flags(argv: list[str], model: str | None, own: dict[str, int]) -> list[str]:
    """The llama.cpp flags as given: the command, the model path and fitter's own options dropped."""
    out, i = [], 1  # argv[0] is the command
    while i < len(argv):
        a = argv[i]
        if a in own:
            i += 1 + own[a]
            continue
        if a == model:
            model = None  # drop its first occurrence only
        else:
            out.append(a)
        i += 1
    return out
