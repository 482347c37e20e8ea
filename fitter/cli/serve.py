"""`fitter serve RESULT [--policy P] [--dry-run] [-- llama-server flags]`: the fastest tuned config that fits now."""

from __future__ import annotations

import argparse
from typing import Any

from fitter.cli.common import log
from fitter.results.pareto import POLICIES


def cmd_serve(ns: argparse.Namespace) -> int:
    """llama-server's exit status; 0 after a dry run (the line on stdout); nothing fits: a FitterError (exit 2)."""
    from fitter.serve.supervise import serve

    rpc = tuple(x for x in (ns.rpc or "").split(",") if x)
    return serve(ns.result, ns.policy, lambda line: log(f"fitter: serve: {line}"), dry_run=ns.dry_run,
                 extra=ns.extra, build_dir=ns.llama_cpp, rpc=rpc, model=ns.model, min_ctx=ns.min_ctx, show=print)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="start llama-server with the fastest tuned config that fits the memory free now",
        usage="fitter serve RESULT [options] [-- llama-server flags]",
        description="Read the devices' free memory now, re-plan every measured config of a tuning result for them, "
        "and start llama-server with the fastest config of the policy that fits, saying which and why. Where none "
        "fits, the policy's pick with more experts on the CPU (-ncmoe) or a smaller context, re-planned by the "
        "estimator and marked unmeasured; where nothing fits, one line saying what would, and nothing starts. "
        "SIGINT and SIGTERM go to llama-server; fitter exits with its status. Flags after -- go to llama-server.")
    p.add_argument("result", help="a results folder (or its pareto.json)")
    p.add_argument("--policy", default="balanced", choices=POLICIES)
    p.add_argument("--dry-run", action="store_true", help="print the chosen llama-server line and why; start nothing")
    p.add_argument("--llama-cpp", metavar="DIR", help="the llama.cpp build's bin/ folder whose llama-server to run "
                   "(default: the one the result was measured with, else fitter's pinned build, else PATH's)")
    p.add_argument("--rpc", metavar="HOST:PORT[,...]", help="a result measured on fitter's emulated GPU: serve on "
                   "these RPC devices (one per emulated GPU) instead of fresh emulated GPUs of the recorded caps")
    p.add_argument("--model", metavar="PATH", help="the tuned GGUF at another path (its header must match)")
    p.add_argument("--min-ctx", type=int, default=None, metavar="N", help="the smallest context a re-plan may "
                   "shrink to (default 4096, llama.cpp's --fit-ctx)")
    p.set_defaults(func=cmd_serve, extra=[])  # fitter.cli.app.main: the flags after `--`, for llama-server
