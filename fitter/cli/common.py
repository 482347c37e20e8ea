"""What every command's edge shares: the model argument (the demo model by default) and its warnings, the target
devices, the llama.cpp flags as the user gave them, notes on stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fitter.errors import LaunchConfigError
from fitter.flags import LaunchConfig, ProcessFlags, launch_config_from_args
from fitter.flags.parse import process_flags_from_args

if TYPE_CHECKING:
    from fitter.gguf.model_spec import ModelSpec
    from fitter.machine.snapshot import MachineSnapshot
    from fitter.memory.backends.devices import CpuProfile, Device


class _EmulatedGpuAction(argparse.Action):
    """`--emulated-gpu [KIND:]MiB[,MiB...]`: capped RPC devices (no kind), CUDA-shaped ones (`cuda:`) or Vulkan
    devices on Mesa's lavapipe (`vulkan:`; fitter.measure.emulator), one per value: ns.emulated_gpu = MiB for one
    device, a tuple of MiB for several; ns.emulated_kind = "rpc", "cuda" or "vulkan"."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        value = str(values)
        kind, sep, rest = value.rpartition(":")
        if sep and kind not in EMULATED_KINDS[1:]:
            parser.error(f"{option_string} {value!r}: {kind!r} is not a kind of emulated GPU; expected MiB[,MiB...], "
                         "cuda:MiB[,MiB...] or vulkan:MiB[,MiB...]")
        caps = rest.split(",")
        if not all(c.isdigit() and int(c) >= 1 for c in caps):
            parser.error(f"{option_string} {value!r}: expected MiB[,MiB...], cuda:MiB[,MiB...] or vulkan:MiB[,MiB...], "
                         "e.g. 4096, cuda:4096, vulkan:96 or 96,48 (one emulated GPU per value)")
        mib = tuple(int(c) for c in caps)
        ns.emulated_gpu, ns.emulated_kind = mib[0] if len(mib) == 1 else mib, kind or "rpc"


EMULATED_KINDS = ("rpc", "cuda", "vulkan")  # fitter.measure.runners.emulated_gpus


def add_emulated_gpu(parser: argparse.ArgumentParser, what: str, several: bool = False) -> None:
    """`several`: the command takes a list, one emulated GPU per value."""
    metavar = "[cuda:|vulkan:]MiB[,MiB...]" if several else "[cuda:|vulkan:]MiB"
    parser.add_argument("--emulated-gpu", action=_EmulatedGpuAction, metavar=metavar,
                        help=f"{what} a capped emulated GPU: MiB for llama.cpp's RPC device, cuda:MiB for the "
                        "CUDA-shaped one (CUDA's buffers, op offload and CUDA_Host), vulkan:MiB for llama.cpp's "
                        "Vulkan backend on Mesa's lavapipe (needs the Vulkan build: .ci/setup --vulkan)"
                        + ("; a list (96,48) starts one per value" if several else ""))
    parser.set_defaults(emulated_gpu=None, emulated_kind="rpc")


def single_emulated_gpu(ns: argparse.Namespace, command: str) -> int | None:
    """The one emulated GPU's cap of a command that runs on one device; a list is refused naming the command."""
    if isinstance(ns.emulated_gpu, tuple):
        raise LaunchConfigError(f"--emulated-gpu {','.join(map(str, ns.emulated_gpu))}: fitter {command} runs on one "
                                "emulated GPU for now (fit, bench and tune take several)")
    return ns.emulated_gpu  # type: ignore[no-any-return]


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


def load_model(path: str, config: LaunchConfig | None = None) -> ModelSpec:
    """The model's spec, its warnings (an architecture fitter has not matched, …) printed once; with a config that
    names a draft model (-md), the draft's spec with it, and what llama-server will make of the pair; with a
    projector (--mmproj), the projector's spec."""
    from fitter.flags.draft import draft_notes
    from fitter.gguf.model_spec import load_model_spec

    draft = config.draft_model if config is not None else ""
    spec = load_model_spec(path, draft, config.mmproj if config is not None else "")
    drafts = spec.draft.warnings if spec.draft is not None else ()
    projector = spec.projector.warnings if spec.projector is not None else ()
    for w in (*spec.warnings, *(f"the draft model {draft}: {w}" for w in drafts), *projector):
        warn(w)
    if config is not None and spec.draft is not None:
        inferred = "draft-mtp" if spec.draft.n_layer_nextn else "draft-dflash" if spec.draft.arch == "dflash" else None
        for w in draft_notes(config, spec.n_vocab, spec.draft.n_vocab, inferred):
            warn(w)
    return spec


def launch_args(ns: argparse.Namespace) -> tuple[LaunchConfig, ProcessFlags]:
    """The llama.cpp flags parsed once, at the edge: the launch config and the process-level flags. A draft model's
    and a projector's paths are made absolute, as the model's is, so results and exports name the same file from
    anywhere."""
    config = launch_config_from_args(ns)
    if config.draft_model and not Path(config.draft_model).is_absolute():
        config = config.with_given(draft_model=str(Path(config.draft_model).resolve()))
    if config.mmproj and not Path(config.mmproj).is_absolute():
        config = config.with_given(mmproj=str(Path(config.mmproj).resolve()))
    return config, process_flags_from_args(ns)


def devices_and_cpu(ns: argparse.Namespace, config: LaunchConfig) -> tuple[tuple[Device, ...], CpuProfile]:
    """`target_devices` and this machine's CPU profile; NVML, psutil and llama-cpp-python's libraries are only read
    (take_snapshot) when the devices are this machine's GPUs, else the CPU's flags come from /proc/cpuinfo alone."""
    if getattr(ns, "llama_cpp", None) or getattr(ns, "devices", "") or config.rpc:
        return target_devices(ns, config, None), cpu_here()
    from fitter.machine.snapshot import take_snapshot

    snapshot = take_snapshot()
    return target_devices(ns, config, snapshot), snapshot.cpu_profile


def cpu_here() -> CpuProfile:
    """This machine's CPU profile (MachineSnapshot.cpu_profile), from /proc/cpuinfo alone."""
    from fitter.machine.cpu import cpu_profile_here

    return cpu_profile_here()


def target_devices(ns: argparse.Namespace, config: LaunchConfig, snapshot: MachineSnapshot | None
                   ) -> tuple[Device, ...]:
    """`--llama-cpp DIR`'s devices, else `--devices`, else the config's `--rpc` servers, else this machine's NVIDIA
    GPUs (already read as the llama.cpp fitter starts will see them); each as that llama.cpp will see it
    (fitter.machine.environment.with_environment)."""
    from fitter.machine.environment import with_environment
    from fitter.memory.backends.devices import rpc_devices
    from fitter.memory.backends.registry import parse_devices

    if getattr(ns, "llama_cpp", None) and not getattr(ns, "devices", ""):
        return with_environment(llama_cpp_devices(ns.llama_cpp, config))

    devices_arg = getattr(ns, "devices", "")
    if devices_arg and config.rpc:
        raise LaunchConfigError(f"--devices {devices_arg} and --rpc {','.join(config.rpc)}: give one target, not both")
    if devices_arg:
        return with_environment(parse_devices(devices_arg))
    if config.rpc:
        return rpc_devices(list(config.rpc))
    if snapshot is None:
        from fitter.machine.snapshot import take_snapshot

        snapshot = take_snapshot()
    return snapshot.devices()


def llama_cpp_devices(folder: str, config: LaunchConfig) -> tuple[Device, ...]:
    """The devices a user's llama.cpp build sees (`llama-server --list-devices`, with the config's --rpc), whatever
    its backend: each with its backend's rules, a Vulkan device with its driver's limits, a CUDA device with what
    NVML measured of it (its overhead) where NVML names it alike; a note for each one not planned by exact rules."""
    from fitter.measure.llamacpp.builds import devices_of_build, find_build

    devices, notes = devices_of_build(find_build(folder), config.rpc)
    for note in notes:
        warn(note)
    return devices


def add_llama_cpp(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--llama-cpp", metavar="DIR", help=f"a llama.cpp build's bin/ folder: {what}")


def build_projector(ns: argparse.Namespace, spec: ModelSpec, rpc: tuple[str, ...] = (),
                    devices: tuple[Device, ...] = ()) -> Any:
    """The build's projector where fitter guesses a kind for the model
    (fitter.measure.llamacpp.projection.projector_for), else None; fitter.measure is imported only then (it is most of
    a CLI's start-up)."""
    from fitter.memory.plan.projected import guessed_kinds

    if ns.projection == "never" or not guessed_kinds(spec, devices):
        return None
    from fitter.measure.llamacpp.projection import projector_for

    return projector_for(spec, ns.llama_cpp, rpc=rpc, devices=devices)


def add_projection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--projection", choices=("auto", "never"), default="auto",
                        help="auto: the memory fitter has no rules for on the model's architecture (its KV cache, "
                        "compute buffers) comes from llama.cpp's own projection of each config (llama-fit-params "
                        "of --llama-cpp DIR or of the pinned tools); never: take fitter's guess")


def add_set_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """--models-preset and --models-max, as llama-server's router takes them; `what` says what the command does
    with the set."""
    parser.add_argument("--models-preset", metavar="FILE", help=f"a llama-server router preset (--models-preset): "
                        f"its models, loaded together, {what}")
    parser.add_argument("--models-max", type=int, default=0, metavar="N",
                        help="with several models: at most N loaded at once, as the router's --models-max (default "
                        "0: every model)")
