"""fitter's command line: thin commands over the library; FitterError → one line on stderr and exit code 2.

Imports stay light (no optuna, pandas or llama_cpp here): `fitter estimate` must finish in well under a second.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn

from fitter import LLAMA_CPP_TARGET, __version__
from fitter.errors import FitterError, LaunchConfigError

MIB = 1024 * 1024


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other bad input
        print(f"fitter: error: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def _model_path(arg: str | None) -> str:
    if arg:
        return arg
    from fitter.demo_models import demo_model_path

    return str(demo_model_path())


def _target_devices(ns: argparse.Namespace) -> tuple[Any, ...]:
    from fitter.devices import detect_gpus, parse_devices, rpc_devices

    rpc = tuple(x for x in ns.rpc.split(",") if x)
    if ns.devices and rpc:
        raise LaunchConfigError(f"--devices {ns.devices} and --rpc {ns.rpc}: give one target, not both")
    if ns.devices:
        return parse_devices(ns.devices)
    if rpc:
        return rpc_devices(list(rpc))
    return detect_gpus()


def cmd_estimate(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.devices import detect_cpu_profile
    from fitter.estimator import estimate
    from fitter.launch_config import launch_config_from_args
    from fitter.model_spec import load_model_spec
    from fitter.report import plan_json, plan_table

    config = launch_config_from_args(ns, flags)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = load_model_spec(_model_path(ns.model))
    plan = estimate(spec, config, _target_devices(ns), detect_cpu_profile())
    for w in [str(c.message) for c in caught] + list(plan.warnings):
        print(f"fitter: warning: {w}", file=sys.stderr)
    if ns.json:
        print(json.dumps(plan_json(plan, LLAMA_CPP_TARGET), indent=1, sort_keys=False))
    else:
        print(plan_table(plan, LLAMA_CPP_TARGET, per_tensor=ns.tensors))
    return 0


def cmd_demo_model(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.demo_models import SHAPES, demo_model_path, write_model

    if ns.shape not in SHAPES:
        raise FitterError(f"demo-model --shape {ns.shape!r}: unknown shape; known: {', '.join(sorted(SHAPES))}")
    if ns.shape == "demo":
        path = demo_model_path(Path(ns.out) if ns.out else None)
        print(path)
        return 0
    if not ns.out:
        raise FitterError(f"demo-model --shape {ns.shape}: give --out PATH for shapes other than the demo")
    for p in write_model(SHAPES[ns.shape], Path(ns.out), sparse=ns.sparse, n_shards=ns.shards):
        print(p)
    return 0


def cmd_probe(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.probe import probe, probe_json, probe_table

    result = probe()
    print(json.dumps(probe_json(result), indent=1) if ns.json else probe_table(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from fitter.launch_config import SERVER_DEFAULTS_HELP, add_launch_arguments

    parser = _Parser(prog="fitter", description="Find the fastest llama.cpp launch settings a machine can hold.")
    parser.add_argument("--version", action="version", version=f"fitter {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

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
    est.add_argument("--json", action="store_true", help="machine-readable output (CONTRACTS.md)")
    est.add_argument("--tensors", action="store_true", help="also list every tensor's buffer type")
    add_launch_arguments(est)
    est.set_defaults(func=cmd_estimate)

    demo = sub.add_parser("demo-model", help="write the demo model (or a test shape) and print its path")
    demo.add_argument("--out", help="where to write it (default: fitter's cache)")
    demo.add_argument("--shape", default="demo", help="demo (default) or a test shape, e.g. gpt-oss-120b")
    demo.add_argument("--sparse", action="store_true", help="header only; the data region is a hole")
    demo.add_argument("--shards", type=int, default=1)
    demo.set_defaults(func=cmd_demo_model)

    probe = sub.add_parser("probe", help="report this machine's GPUs, CPU, RAM and llama.cpp build",
                           description="Report what this machine offers llama.cpp: NVIDIA GPUs (NVML), CPU topology "
                           "and ISA, RAM, and the installed llama-cpp-python build.")
    probe.add_argument("--json", action="store_true", help="machine-readable output (shape: fitter/probe.py)")
    probe.set_defaults(func=cmd_probe)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    flags = _llama_flags(argv, getattr(ns, "model", None))
    try:
        result: int = ns.func(ns, flags)
        return result
    except FitterError as e:
        print(f"fitter: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _llama_flags(argv: list[str], model: str | None) -> list[str]:
    """The llama.cpp flags as given: the command, the model path and fitter's own options dropped."""
    own = {"--devices": 1, "--json": 0, "--tensors": 0}
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


if __name__ == "__main__":
    raise SystemExit(main())
