"""`fitter estimate`: every buffer llama.cpp will allocate, from the GGUF header alone."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fitter import LLAMA_CPP_TARGET
from fitter.cli.common import add_llama_cpp, launch_args, load_model, model_path, target_devices, warn
from fitter.flags import SERVER_DEFAULTS_HELP, add_launch_arguments


def cmd_estimate(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.machine.snapshot import take_snapshot
    from fitter.memory.estimator import estimate
    from fitter.memory.render import plan_json, plan_table

    config, _ = launch_args(ns, flags)
    spec = load_model(model_path(ns.model))
    snapshot = take_snapshot()
    plan = estimate(spec, config, target_devices(ns, config, snapshot), snapshot.cpu_profile)
    for w in plan.warnings:
        warn(w)
    if ns.json:
        print(json.dumps(plan_json(plan, LLAMA_CPP_TARGET), indent=1, sort_keys=False))
    else:
        print(plan_table(plan, LLAMA_CPP_TARGET, per_tensor=ns.tensors))
    return 0


def register(sub: Any) -> None:
    est = sub.add_parser(
        "estimate",
        help="predict every buffer llama.cpp will allocate, from the GGUF header alone",
        description="Predict llama.cpp's memory per buffer and device for a model and a set of llama-server "
        "flags, from the GGUF header alone (no tensor data is read).",
        epilog=SERVER_DEFAULTS_HELP + "\n\nTargets: (none) NVIDIA GPUs seen by NVML, else CPU only; "
        "--devices none; --devices cuda:MiB[,MiB...] (hypothetical GPUs; the CUDA rules are not yet validated "
        "against a CUDA build); --rpc HOST:PORT or --devices rpc:HOST:PORT.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    est.add_argument("model", nargs="?", help="GGUF file or any shard of a split model (default: the demo model)")
    est.add_argument("--devices", default="", help="none | cuda:MiB[,MiB...] | rpc:HOST:PORT[,...]")
    add_llama_cpp(est, "estimate for the devices that build sees (llama-server --list-devices)")
    est.add_argument("--json", action="store_true", help="machine-readable output (CONTRACTS.md)")
    est.add_argument("--tensors", action="store_true", help="also list every tensor's buffer type")
    add_launch_arguments(est)
    est.set_defaults(func=cmd_estimate)
