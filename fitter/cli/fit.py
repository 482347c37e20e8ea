"""`fitter fit`: the placement that puts the most on the GPU(s) within free memory minus a target."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import replace
from typing import Any

from fitter.cli.common import (
    add_emulated_gpu,
    add_llama_cpp,
    add_projection,
    build_projector,
    cpu_here,
    devices_and_cpu,
    launch_args,
    load_model,
    model_path,
    warn,
)
from fitter.errors import LaunchConfigError
from fitter.flags import SERVER_DEFAULTS_HELP, add_launch_arguments, parse_launch_flags, pin, server_command
from fitter.memory.backends.devices import Device
from fitter.memory.fit.budgets import DEFAULT_FIT_CTX, DEFAULT_FIT_TARGET_MIB, parse_fit_targets


def cmd_fit(ns: argparse.Namespace) -> int:
    from fitter.memory.fit.fit import fit
    from fitter.memory.plan_render import fit_json, fit_table

    config, _ = launch_args(ns)
    targets = parse_fit_targets(ns.fit_target)
    if ns.models_preset or len(ns.model) > 1:  # several models loaded together: one fit for the set
        from fitter.cli.fit_set import fit_set

        return fit_set(ns, config, targets)
    model = model_path(ns.model[0] if ns.model else None)
    spec = load_model(model, config)
    with contextlib.ExitStack() as stack:
        gpu = None
        if ns.emulated_gpu is not None:
            from fitter.measure.runners import emulated_caps, emulated_gpus

            if ns.devices or config.rpc:
                raise LaunchConfigError("--emulated-gpu replaces --devices and --rpc: give one target")
            beside = _vulkan_server(ns) if ns.emulated_kind == "vulkan" else None
            gpu = stack.enter_context(emulated_gpus(ns.emulated_kind, emulated_caps(ns.emulated_gpu), beside))
            devices: tuple[Device, ...] = gpu.devices()
            cpu = cpu_here()
        else:
            devices, cpu = devices_and_cpu(ns, config)
        rpc = gpu.endpoints if gpu is not None else config.rpc
        projector = build_projector(ns, spec, rpc, devices)
        result = fit(spec, config, devices, targets, ns.fit_ctx, cpu, projector)
        launch = pin(replace(result.config, rpc=rpc), result.plan.context)
        verify = None
        if ns.verify:
            if gpu is None:
                raise LaunchConfigError("--verify needs --emulated-gpu: only an emulated device can be loaded here")
            verify = _verify(model, launch, gpu, config.consumer)
    for w in result.plan.warnings:
        warn(w)
    if projector is not None:
        print(f"fitter: {projector.summary()}", file=sys.stderr)
    if ns.json:
        out = fit_json(result, launch, server_command(model, launch), emulated=gpu is not None, verify=verify)
        print(json.dumps({"for": config.consumer, **out}, indent=1))
    else:
        print(fit_table(result, server_command(model, launch), emulated=gpu is not None, verify=verify))
    return 0 if result.fits else 1


def _verify(model: str, launch: list[str], gpu: Any, consumer: str) -> dict[str, Any]:
    """Load the chosen flags on the emulated device, as `consumer` would, and read what it really allocated."""
    from fitter.measure.loader import load_and_capture

    gpu.reset_peak()
    res = load_and_capture(model, parse_launch_flags(launch, consumer))
    peaks = gpu.peaks()
    caps = {d.name: d.total_bytes or 0 for d in gpu.devices()}
    return {
        "loaded": res.ok,
        "error": res.error,
        "device_peak_bytes": sum(peaks.values()),
        "device_cap_bytes": sum(caps.values()),
        "devices": {name: {"peak_bytes": peaks[name], "cap_bytes": cap} for name, cap in caps.items()},
        "buffers": [{"buft": b.buft, "kind": b.kind, "mib": b.mib} for b in res.buffers],
    }


def _vulkan_server(ns: argparse.Namespace) -> str | None:
    """The Vulkan build the emulated Vulkan GPU runs: --llama-cpp DIR's, else fitter's own (None)."""
    if not ns.llama_cpp:
        return None
    from fitter.measure.llamacpp.builds import find_build

    return str(find_build(ns.llama_cpp).llama_server)


def register(sub: Any) -> None:
    from fitter.cli.common import add_set_arguments

    fit_p = sub.add_parser(
        "fit",
        help="the placement that puts the most on the GPU(s) within free memory minus a target",
        description="Find the placement (-ngl, -ncmoe, -ot) that puts the most weights on the GPU(s) within free "
        "memory minus --fit-target, for the given context, batch and KV choices; with -c 0 also the largest "
        "context that placement allows. Judged by fitter's estimator; nothing is loaded unless --verify.",
        epilog=SERVER_DEFAULTS_HELP + "\n\nTargets: NVIDIA GPUs (NVML free memory), --devices cuda:MiB[,MiB...] "
        "(hypothetical GPUs; CUDA rules not yet validated against a CUDA build), or --emulated-gpu MiB (a capped "
        "llama.cpp RPC device fitter starts on 127.0.0.1: real placement and out-of-memory behaviour, CPU speed). "
        "Exit code 1 when nothing fits.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fit_p.add_argument("model", nargs="*", help="GGUF file or any shard (default: the demo model); several: models "
                       "loaded together (llama-server's router, a llama-swap group), fitted as one set")
    add_set_arguments(fit_p, "each with its own options, fitted as one set")
    fit_p.add_argument("--write-preset", metavar="FILE", help="with several models: write the fitted set as a router "
                           "preset (llama-server --models-preset FILE --models-max N)")
    fit_p.add_argument("--fit-target", default=str(DEFAULT_FIT_TARGET_MIB), metavar="MiB[,MiB...]",
                       help="memory to leave free per device (default 1024, as llama.cpp's --fit-target)")
    fit_p.add_argument("--fit-ctx", type=int, default=DEFAULT_FIT_CTX, metavar="N",
                       help="with -c 0: the context the placement is found at before it grows (default 4096)")
    fit_p.add_argument("--devices", default="", help="none | cuda:MiB[,MiB...] | rpc:HOST:PORT[,...]")
    add_llama_cpp(fit_p, "fit onto the devices that build sees (llama-server --list-devices)")
    add_emulated_gpu(fit_p, "fit onto", several=True)
    add_projection(fit_p)
    fit_p.add_argument("--verify", action="store_true", help="load the result on the emulated GPU and report it")
    fit_p.add_argument("--json", action="store_true")
    add_launch_arguments(fit_p)
    fit_p.set_defaults(func=cmd_fit)
