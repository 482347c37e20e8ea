"""`fitter grid`: every config of a search space measured on this machine, K interleaved times, into a landscape
file that `fitter tune --backend replay --landscape FILE` plays back."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fitter.cli.bench import add_measure_arguments, workload_from_args
from fitter.cli.common import (
    add_emulated_gpu,
    launch_args,
    load_model,
    log,
    model_path,
    single_emulated_gpu,
)
from fitter.errors import FitterError
from fitter.flags import SERVER_DEFAULTS_HELP, add_launch_arguments, add_process_arguments
from fitter.memory.fit.budgets import parse_fit_targets


def cmd_grid(ns: argparse.Namespace) -> int:
    from fitter.grid.record import landscape_table, record_landscape
    from fitter.machine.snapshot import take_snapshot
    from fitter.tune.options import MeasureOptions, SearchOptions, TuneOptions

    if ns.backend == "replay":
        raise FitterError("fitter grid measures: --backend replay plays a landscape back, it does not record one")
    if ns.cpu_only and ns.emulated_gpu is not None:
        raise FitterError("--cpu-only and --emulated-gpu: give one")
    if ns.max_runs is not None and ns.max_runs < 1:
        raise FitterError(f"--max-runs {ns.max_runs}: give at least 1")
    config, process = launch_args(ns)  # bad flags stop here, before anything starts
    workload, config = workload_from_args(ns, config)
    if not workload.is_default_shape:
        raise FitterError(f"fitter grid records one test per config: {workload.label()} has several depths or "
                          "streams; give one -d and no --concurrency")
    if workload.prompts is not None or config.draft_model:
        raise FitterError("fitter grid records synthetic tests for a replayed landscape: drop --prompts and -md")
    model = model_path(ns.model)
    spec = load_model(model, config)
    snapshot = take_snapshot() if ns.backend != "sim" else None
    if ns.cpu_only and snapshot is not None and snapshot.gpus:
        raise FitterError(f"--cpu-only: this machine has {len(snapshot.gpus)} NVIDIA GPU(s), which trials would "
                          "use; --cpu-only is for the demo model on a machine without one")
    options = TuneOptions(
        model=model, spec=spec, base=config, process=process, workload=workload,
        demo=ns.model is None and not ns.cpu_only,
        search=SearchOptions(space=ns.space, seed=ns.seed,
                             fit_targets=parse_fit_targets(ns.fit_target) if ns.fit_target else None),
        measure=MeasureOptions(backend=ns.backend, machine=ns.machine, emulated_gpu_mib=single_emulated_gpu(ns, "grid"),
                               emulated_kind=ns.emulated_kind, llama_fit_params=ns.llama_fit_params,
                               repetitions=ns.repetitions, trial_timeout_s=ns.trial_timeout))
    land, path = record_landscape(options, snapshot, ns.rounds, Path(ns.out) if ns.out else None, log, ns.max_runs)
    print(landscape_table(land))
    print(f"\nlandscape: {path}")
    return 0


def register(sub: Any) -> None:
    g = sub.add_parser(
        "grid",
        help="measure every config of a search space, K interleaved times, into a landscape file (for replay)",
        description="The search space fitter tune would search, exhaustively: every config the estimator lets run is "
        "measured like `fitter bench` in --rounds interleaved rounds (each a fresh seeded shuffle of all of them, so "
        "drift hits every config alike); screened-out configs are recorded with their reason, never launched; "
        "llama.cpp's --fit choice is recorded too (the baseline). The landscape file is rewritten after every run: "
        "the same command again continues it. `fitter tune --backend replay --landscape FILE` replays it.",
        epilog=SERVER_DEFAULTS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g.add_argument("model", nargs="?", help="GGUF file or any shard (default: the demo model)")
    g.add_argument("--space", metavar="FILE", help="search space TOML (default: shipped moe, dense or cpu)")
    g.add_argument("--fit-target", default=None, metavar="MiB[,MiB...]",
                   help="memory to leave free per device (default 1024, as llama.cpp's --fit-target)")
    g.add_argument("--rounds", type=int, default=3, metavar="K", help="runs of every config (default 3)")
    g.add_argument("--out", metavar="FILE",
                   help="the landscape file (default landscapes/<model>-<machine>.json); an existing one continues")
    g.add_argument("--max-runs", type=int, default=None, metavar="N",
                   help="stop after N runs (the same command continues later)")
    g.add_argument("--cpu-only", action="store_true",
                   help="the demo model on the CPU: no emulated GPU by itself on a machine without a GPU")
    g.add_argument("--trial-timeout", type=float, default=None, metavar="S",
                   help="seconds before a run counts as hung (default: from the predicted work)")
    add_emulated_gpu(g, "measure on")
    g.add_argument("--llama-fit-params", metavar="PATH", help="llama.cpp's llama-fit-params for the baseline")
    g.add_argument("--seed", type=int, default=0, help="the rounds' shuffles (default 0)")
    add_process_arguments(g, {"-t": "fix the threads (removes threads from the space)",
                              "-tb": "fix the batch threads (removes threads-batch from the space)"},
                          names=("-t", "-tb"))
    add_measure_arguments(g)
    add_launch_arguments(g)
    g.set_defaults(func=cmd_grid)
