"""`fitter estimate`: every buffer llama.cpp will allocate, from the GGUF header alone."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fitter import LLAMA_CPP_TARGET
from fitter.cli.common import (
    add_llama_cpp,
    add_projection,
    build_projector,
    devices_and_cpu,
    launch_args,
    load_model,
    model_path,
    warn,
)
from fitter.flags import SERVER_DEFAULTS_HELP, add_launch_arguments


def cmd_estimate(ns: argparse.Namespace) -> int:
    from fitter.memory.plan.estimator import estimate
    from fitter.memory.plan_render import plan_json, plan_table

    config, _ = launch_args(ns)
    spec = load_model(model_path(ns.model), config)
    devices, cpu = devices_and_cpu(ns, config)
    plan = estimate(spec, config, devices, cpu)
    projector = build_projector(ns, spec, config.rpc, devices)
    if projector is not None:
        plan = projector.plan(plan)
    for w in plan.warnings:
        warn(w)
    if projector is not None:
        print(f"fitter: {projector.summary()}", file=sys.stderr)
    projection = _projection(ns, spec, config, plan.devices, cpu) if ns.llama_cpp else None
    if ns.json:
        out = plan_json(plan, LLAMA_CPP_TARGET)
        if projection is not None:
            out["projection"] = projection[0]
        print(json.dumps(out, indent=1, sort_keys=False))
    else:
        print(plan_table(plan, LLAMA_CPP_TARGET, per_tensor=ns.tensors))
        if projection is not None:
            print("\n" + "\n".join(projection[1]))
    return 0


def _projection(ns: argparse.Namespace, spec: Any, config: Any, devices: Any, cpu: Any) -> tuple[dict[str, Any],
                                                                                                  list[str]]:
    """The build's own projection (`llama-fit-params --fit-print on`) beside fitter's estimate of the same reading
    of the flags (fitter.measure.llamacpp.projection): JSON and the table's lines."""
    from fitter.flags import pin
    from fitter.measure.llamacpp.builds import find_build
    from fitter.measure.llamacpp.projection import compare, project, tool_estimate

    build = find_build(ns.llama_cpp)
    if build.llama_fit_params is None:
        warn(f"{build.folder}: no llama-fit-params, so no projection of the build's own to compare with")
        return {"source": None, "llama_cpp": build.build(), "devices": {}}, []
    flags = pin(config, given=True)
    proj = project(build.llama_fit_params, spec.path, flags)
    ours = tool_estimate(spec, flags, devices, cpu)
    lines = [f"the build's own projection ({proj.command}), beside fitter's estimate of the flags as that tool reads "
             "them (-np streams, logits for a ubatch; the build's MiB are floored, and its host model leaves out "
             "repacked weights):", *compare(ours, proj.devices)]
    return {"source": proj.command, "llama_cpp": build.build(), "devices": proj.devices, "fitter": ours}, lines


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
    add_projection(est)
    est.add_argument("--json", action="store_true", help="machine-readable output (CONTRACTS.md)")
    est.add_argument("--tensors", action="store_true", help="also list every tensor's buffer type")
    add_launch_arguments(est)
    est.set_defaults(func=cmd_estimate)
