"""`fitter tune`: find the fastest llama.cpp settings this machine can hold (Optuna over real measured trials)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fitter.cli.bench import add_measure_arguments, workload_from_args
from fitter.cli.common import (
    add_emulated_gpu,
    add_llama_cpp,
    launch_args,
    load_model,
    log,
    model_path,
)
from fitter.errors import FitterError
from fitter.flags import SERVER_DEFAULTS_HELP, add_launch_arguments, add_process_arguments
from fitter.memory.fit.budgets import parse_fit_targets

if TYPE_CHECKING:  # optuna and the study load when a tune runs, not when the parser is built
    import optuna

    from fitter.search.request import TuneRequest
    from fitter.tune.study import StudyCallback, TuneProgress


class Stderr:
    """tune's stderr: the progress line overwrites itself (it has no newline), any other line ends it first."""

    def __init__(self) -> None:
        self.open = False  # a progress line is on screen without its newline

    def progress(self, line: str) -> None:
        print(f"\r{line}".ljust(121), end="", file=sys.stderr, flush=True)
        self.open = True

    def end(self) -> bool:
        """End an open progress line; whether one was open."""
        was, self.open = self.open, False
        if was:
            print(file=sys.stderr, flush=True)
        return was

    def log(self, message: str) -> None:
        """A line of its own (an empty `message` only ends the progress line, when one is open)."""
        if not self.end() or message:
            log(message)


def progress_printer(req: TuneRequest, out: Stderr) -> StudyCallback:
    """One self-overwriting stderr line per trial event: trials done, screened, answered, the best so far, ETA."""
    from optuna.trial import TrialState

    def show(event: str, p: TuneProgress, study: optuna.Study) -> None:
        done = p.launched
        best_tg = best_pp = None
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            m = t.user_attrs.get("measurement", {})
            if "tg" in m and all(v <= 0 for v in t.constraints.values()):
                best_tg = max(best_tg or 0.0, m["tg"]["avg_ts"])
                best_pp = max(best_pp or 0.0, m["pp"]["avg_ts"])
        elapsed = time.monotonic() - p.started
        eta = elapsed / done * (req.n_trials - done) if done else None
        best = f"best tg {best_tg:.1f} t/s, pp {best_pp:.1f} t/s" if best_tg is not None else "no result yet"
        line = (f"tune: trial {done + (1 if event == 'start' else 0)}/{req.n_trials} "
                f"({'running' if event == 'start' else 'done'}), {p.pruned} screened out, {p.answered} from storage; "
                f"{best}; elapsed {elapsed:.0f} s" + (f", ETA {eta:.0f} s" if eta is not None else ""))
        out.progress(line)

    return show


def _stopping(stop: threading.Event, out: Stderr) -> None:
    """The first Ctrl-C (from the signal handler: os.write, since the progress line may be mid-print on stderr)."""
    stop.set()
    was, out.open = out.open, False
    line = "fitter: Ctrl-C: stopping after the running trial (Ctrl-C again stops at once)\n"
    os.write(sys.stderr.fileno(), ("\n" if was else "").encode() + line.encode())


def cmd_tune(ns: argparse.Namespace) -> int:
    """The first Ctrl-C lets the running trial end (it is kept), stops the search and exits 130 saying how to
    resume (the same command); a second one stops at once."""
    from fitter.tune.options import MeasureOptions, SearchOptions, StorageOptions, TuneOptions, parse_objectives

    if ns.trials < 1:
        raise FitterError(f"--trials {ns.trials}: give at least 1")
    if ns.confirm_rounds < 1:
        raise FitterError(f"--confirm-rounds {ns.confirm_rounds}: give at least 1 (2 or more for intervals and ties)")
    config, process = launch_args(ns)  # bad flags stop here, before anything starts
    workload, config = workload_from_args(ns, config, tune=True)
    if ns.models_preset and ns.model:
        raise FitterError("--models-preset FILE names the set's models: give them there, not on the command line")
    models = [] if ns.models_preset else [model_path(m) for m in ns.model] or [model_path(None)]
    specs = [load_model(m, config) for m in models]
    objectives = parse_objectives(ns.objectives)
    reference = None
    if len(models) > 1:  # several files of one model: one front, quality against the highest-precision file
        from fitter.measure.quality import model_file, reference_file
        from fitter.tune.files import check_files

        files = [model_file(m) for m in models]
        check_files(files)
        reference = reference_file(files).path
        objectives = objectives if "quality" in objectives else (*objectives, "quality")

    def options_for(model: str, spec: Any, base: Any = config, targets: tuple[int, ...] | None = None) -> TuneOptions:
        if targets is None and ns.fit_target:
            targets = parse_fit_targets(ns.fit_target)
        return TuneOptions(
            model=model, spec=spec, base=base, process=process, workload=workload, demo=not ns.model,
            search=SearchOptions(objectives=objectives, space=ns.space, fit_targets=targets,
                                 trials=ns.trials, timeout_s=ns.timeout, seed=ns.seed,
                                 quality_text=ns.quality_text, quality_ctx=ns.quality_ctx,
                                 quality_reference=reference),
            measure=MeasureOptions(backend=ns.backend, machine=ns.machine, landscape=ns.landscape,
                                   emulated_gpu_mib=ns.emulated_gpu, emulated_kind=ns.emulated_kind,
                                   llama_cpp=ns.llama_cpp, llama_fit_params=ns.llama_fit_params,
                                   projection=ns.projection, repetitions=ns.repetitions,
                                   confirm_rounds=ns.confirm_rounds, trial_timeout_s=ns.trial_timeout),
            storage=StorageOptions(storage=ns.storage, study_name=ns.study_name, results=Path(ns.results)))

    if ns.models_preset:  # models loaded together: each tuned within its share of the set's fit
        from fitter.cli.tune_set import tune_set

        return tune_set(ns, config, options_for, _run_one)
    if len(models) > 1:
        return _tune_files(ns, [options_for(m, s) for m, s in zip(models, specs, strict=True)])
    code, _ = _run_one(ns, options_for(models[0], specs[0]))
    return code


def _run_one(ns: argparse.Namespace, options: Any) -> tuple[int, Any]:
    """One model's tune, its result printed: (exit status, the outcome when it wrote a result)."""
    from fitter.export.launchers import render
    from fitter.machine.snapshot import take_snapshot
    from fitter.process import first_interrupt_deferred
    from fitter.results.table import pareto_table
    from fitter.tune.session import run_tune

    config = options.base
    snapshot = take_snapshot() if ns.backend not in ("sim", "replay") else None
    stop, out = threading.Event(), Stderr()
    try:
        with first_interrupt_deferred(lambda: _stopping(stop, out)):
            progress = lambda req: progress_printer(req, out)  # noqa: E731
            if ns.backend == "replay":  # a recorded landscape is the target (fitter.grid.replay_tune)
                from fitter.grid.replay_tune import run_replay

                outcome = run_replay(options, out.log, progress, dry_run=ns.dry_run, stop=stop)
            else:
                outcome = run_tune(options, snapshot, out.log, progress, dry_run=ns.dry_run, stop=stop)
    except KeyboardInterrupt:  # the second Ctrl-C: the running trial is left for the next run to fail and go on
        out.log("fitter: interrupted: the running trial is left unfinished; the same command resumes the tune (it "
                "fails that trial and keeps every finished one)")
        return 130, None
    except FitterError:
        out.end()  # the one-line error on a line of its own
        raise
    if outcome.stopped is not None:
        out.log(f"fitter: stopped: {outcome.stopped}")
        return 130, None
    if outcome.dry_run is not None:
        print(outcome.dry_run)
        return 0, None
    result = outcome.result
    if outcome.confirmed_by is not None:  # a worker of a fleet: another one confirms and writes pareto.json
        if result is None:
            print(f"fitter: this worker's trials are in the study; worker {outcome.confirmed_by} writes its results")
            return 0, None
        print(f"fitter: the study was confirmed by worker {outcome.confirmed_by}; its result:", file=sys.stderr)
    assert result is not None and outcome.folder is not None
    if ns.json:
        print(json.dumps(result.data, indent=1))
    else:
        print(pareto_table(result))
        print(f"\nresults: {outcome.folder}")
        # the balanced pick as its program takes it (llama-bench has no launcher format: the table's flags are it)
        fmt = {"llama-server": "server", "llama-cli": "server", "llama-cpp-python": "python"}.get(config.consumer)
        if result.picks and fmt:
            print(render(result, "balanced", fmt))
    return (0 if result.pareto else 1), outcome


def _tune_files(ns: argparse.Namespace, options: list[Any]) -> int:
    """Several files of one model: each tuned in turn (its own study and result), then one front over them all."""
    from fitter.measure.quality import model_file, reference_file
    from fitter.tune.files import combined, combined_lines, write_combined

    files = [model_file(o.model) for o in options]
    done = []
    for o, f in zip(options, files, strict=True):
        print(f"\n== {f.path} ({f.bits_per_weight:.2f} bits per weight)", file=sys.stderr)
        code, outcome = _run_one(ns, o)
        if outcome is None or outcome.result is None or outcome.folder is None:
            return code
        done.append((f, outcome.result, outcome.folder))
    doc = combined(done, reference_file(files))
    path = write_combined(Path(ns.results), doc)
    if ns.json:
        print(json.dumps(doc, indent=1))
    else:
        print("\n".join(combined_lines(doc)))
        print(f"\nall files: {path}")
    return 0 if doc["pareto"] else 1


def register(sub: Any) -> None:
    from fitter.cli.common import add_set_arguments

    tune = sub.add_parser(
        "tune",
        help="find the fastest llama.cpp settings this machine can hold (Optuna over real measured trials)",
        description="A constrained multi-objective Optuna study: decode t/s, prefill t/s and peak VRAM over the search "
        "space (-ncmoe/-ngl, -b/-ub, -ctk/-ctv, -fa, -t/-tb), under the free-VRAM target and host RAM. Every config "
        "is screened by the estimator first (predicted over budget: never launched); every launched trial is "
        "measured like `fitter bench` at the deployed context. Trial 0 is llama.cpp's own --fit choice, the "
        "baseline. The Pareto-optimal configs and the baseline are re-measured in interleaved rounds and written "
        "with the picks to results/<model>/<machine>/<llama.cpp build>/pareto.json; a killed tune resumes from "
        "study.db.",
        epilog=SERVER_DEFAULTS_HELP + "\n\nThe context (-c), slots (-np) and other llama.cpp flags you give are "
        "fixed; a searched flag you give (e.g. -ub 512) is removed from the search.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune.add_argument("model", nargs="*", help="GGUF file or any shard (default: the demo model); several files of "
                      "one model (its quantizations) are tuned each and put on one front with their quality, measured "
                      "against the highest-precision file")
    tune.add_argument("--space", metavar="FILE", help="search space TOML (default: shipped moe, dense or cpu)")
    tune.add_argument("--objectives", default="tg,pp,vram", metavar="LIST",
                      help="any of tg (decode t/s), pp (prefill t/s), vram (peak VRAM); with --concurrency "
                      "tg-stream (one stream's decode t/s) and ttft (time to first token); with --min-ctx, ctx is "
                      "added; quality: the KL divergence of each KV cache type from f16, measured with llama.cpp's "
                      "llama-perplexity (the KV types searched widen to every type llama.cpp takes) "
                      "(default: tg,pp,vram)")
    add_set_arguments(tune, "fitted as one set (fitter fit --models-preset) and each tuned within its share; the "
                      "picks are written as one preset (RESULTS/set-preset.ini)")
    tune.add_argument("--quality-text", metavar="FILE", help="with --objectives ...,quality: the text quality is "
                      "measured on (default: the --prompts file, else the public-domain text fitter ships)")
    tune.add_argument("--quality-ctx", type=int, default=512, metavar="N",
                      help="llama-perplexity's -c for quality: the text is scored in chunks of N tokens, the second "
                      "half of each (default 512; the text needs 2N tokens or more)")
    tune.add_argument("--fit-target", default=None, metavar="MiB[,MiB...]",
                      help="memory to leave free per device (default 1024, as llama.cpp's --fit-target)")
    tune.add_argument("--trials", type=int, default=12, metavar="N",
                      help="launched trials in the study, the baseline included (default 12)")
    tune.add_argument("--timeout", type=float, default=None, metavar="S", help="stop launching after S seconds")
    tune.add_argument("--trial-timeout", type=float, default=None, metavar="S",
                      help="seconds before a trial counts as hung (default: from the predicted work)")
    tune.add_argument("--dry-run", action="store_true",
                      help="show the space, the feasible region and the planned first trials; launch nothing")
    tune.add_argument("--storage", metavar="URL", help="any Optuna storage URL (default: the results folder's "
                      "study.db): sqlite:///FILE, postgresql://USER@HOST/DB for a fleet of identical machines, or "
                      "journal:PATH (Optuna's journal file on a shared filesystem); every worker runs the same "
                      "command and the study's launches spread over them")
    tune.add_argument("--study-name", metavar="NAME", help="the study's name in --storage (default: "
                      "fitter-<model file stem>)")
    tune.add_argument("--results", default="results", metavar="DIR", help="results root (default ./results)")
    add_emulated_gpu(tune, "tune on", several=True)
    tune.add_argument("--llama-fit-params", metavar="PATH", help="llama.cpp's llama-fit-params for the baseline")
    add_llama_cpp(tune, "every trial runs its llama-server at the deployed context, its llama-fit-params gives the "
                  "baseline, its commit keys the results")
    tune.add_argument("--projection", choices=("auto", "always", "never"), default="auto",
                      help="screen configs with llama.cpp's own projection (llama-fit-params --fit-print) — auto: "
                      "the memory fitter has no rules for on the model's architecture (its KV cache, compute "
                      "buffers) comes from it, and with --llama-cpp every config is also checked against it when "
                      "the build is another commit or backend than fitter's rules were matched against; always: "
                      "that check for every config; never: take fitter's guess")
    tune.add_argument("--confirm-rounds", type=int, default=4, metavar="N",
                      help="interleaved confirm rounds of the front and the baseline, each of -r repetitions, a fresh "
                      "order each round; ratios, their 95 %% intervals and ties come from them (default 4)")
    tune.add_argument("--min-ctx", dest="min_ctx", type=int, default=None, metavar="N",
                      help="search the context (-c) from N up to the model's training context instead of fixing it: "
                      "context becomes a Pareto axis beside speed and VRAM, so the table shows what each larger "
                      "context costs (or min_ctx in a --workload file)")
    tune.add_argument("--seed", type=int, default=0)
    add_process_arguments(tune, {"-t": "fix the threads (removes threads from the search)",
                                 "-tb": "fix the batch threads (removes threads-batch from the search)"},
                          names=("-t", "-tb"))
    tune.add_argument("--json", action="store_true", help="print pareto.json instead of the table")
    add_measure_arguments(tune)
    add_launch_arguments(tune)
    tune.set_defaults(func=cmd_tune)
