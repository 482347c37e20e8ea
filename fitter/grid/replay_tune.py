"""`fitter tune --backend replay`: a recorded landscape (`fitter grid`) as the target a tune runs on. Its devices,
budgets, cores, CPU rules, space, fixed flags and bench settings stand in for this machine's, so the study searches
exactly the recorded space; its baseline is the recorded point; every trial is answered by fitter.grid.replay."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from optuna.distributions import CategoricalDistribution, json_to_distribution

from fitter.errors import FitterError
from fitter.flags import pin
from fitter.flags.consumers import with_bench_context
from fitter.flags.parse import parse_launch_flags
from fitter.grid.landscape import Landscape, load_landscape
from fitter.grid.replay import ReplayRunner
from fitter.tune.options import TuneOptions
from fitter.tune.session import TuneOutcome, run_tune
from fitter.tune.study import StudyCallback
from fitter.tune.targets import RecordedBaseline, Target
from fitter.workload import Workload


def replay_target(path: str | None, seed: int) -> Target:
    """The landscape at `path` as a tune's target."""
    if not path:
        raise FitterError("--backend replay: give --landscape FILE (fitter grid records one)")
    land = load_landscape(path)
    fingerprint = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    name = land.model.get("name") or "landscape"
    machine = {"replay": str(path), "fingerprint": fingerprint, "recorded": land.machine,
               "physical_cores": land.target["physical_cores"], "performance_cores": land.target["performance_cores"],
               "gpus": [d.name for d in land.devices]}
    probe = ReplayRunner(land, seed)
    t = land.target
    recorded = land.baseline
    return Target(
        make_runner=lambda: ReplayRunner(land, seed), devices=lambda r: r.devices(),
        planned_devices=probe.devices(), planned_rpc=land.rpc, machine=machine,
        machine_dir=f"replay-{name}-{fingerprint[:8]}", physical_cores=t["physical_cores"],
        performance_cores=t["performance_cores"], default_threads=t["default_threads"], host_budget=t["host_budget"],
        cpu_profile=land.cpu_profile, has_gpu=bool(land.devices), default_fit_target=land.fit_target_mib,
        space_source=land.space,
        # the study's own distributions as recorded (an int range stays one), else the recorded choices
        distributions={k: json_to_distribution(land.optuna[k]) if k in land.optuna else CategoricalDistribution(
            tuple(v)) for k, v in land.distributions.items()},
        fixed_options=lambda o: replayed_options(o, land),
        recorded_baseline=RecordedBaseline(tuple(recorded.flags) if recorded else None, land.baseline_reason))


def replayed_options(o: TuneOptions, land: Landscape) -> tuple[TuneOptions, str]:
    """`o` for a replay of `land`: the recorded model, fixed flags, space, fit targets and threads must be the ones
    given (or be left out: then they are the landscape's); the bench settings (-p -n -d -r) are the landscape's. With
    the line the log says."""

    def refuse(what: str, recorded: Any, given: Any) -> FitterError:
        return FitterError(f"{land.path}: recorded with {what} {recorded}, this tune gives {given}: replay the "
                           "landscape as it was recorded (leave it out to take the recorded one)")

    if o.spec.identity != land.model.get("identity"):
        raise refuse("the model", f"{land.model.get('name', '?')} ({land.model.get('identity', '')[:12]})",
                     f"{o.model} ({o.spec.identity[:12]})")
    given = pin(o.base, given=True)
    if given and parse_launch_flags(land.fixed_flags, land.consumer) != o.base:
        raise refuse("the flags", repr(" ".join(land.fixed_flags)), repr(" ".join(given)))
    if o.base.consumer != land.consumer:
        raise refuse("--for", land.consumer, o.base.consumer)
    if o.search.space and o.search.space != land.space:
        raise refuse("the space", land.space, o.search.space)
    fit = o.search.fit_targets
    if fit and tuple(fit) != land.fit_target_mib:
        raise refuse("--fit-target", ",".join(map(str, land.fit_target_mib)), ",".join(map(str, fit)))
    if o.measure.emulated_gpu_mib is not None:
        raise FitterError("--backend replay and --emulated-gpu: the landscape has its own devices")
    recorded_threads = (land.threads["t"], land.threads["tb"])
    if o.process.threads is not None and (o.process.threads, o.process.threads_batch) != recorded_threads:
        raise refuse("-t/-tb", recorded_threads, (o.process.threads, o.process.threads_batch))
    b = land.bench
    note = (f"fitter: replaying {land.path}: {len(land.points)} configs recorded over {land.rounds} rounds "
            f"(-p {b['p']} -n {b['n']} -d {b['d']} -r {b['r']})")
    base = with_bench_context(parse_launch_flags(land.fixed_flags, land.consumer), b["p"] + b["n"] + b["d"])
    return replace(
        o, base=base, search=replace(o.search, space=None, fit_targets=land.fit_target_mib),
        workload=Workload(n_prompt=b["p"], n_gen=b["n"], depths=(b["d"],), source=str(land.path)),
        measure=replace(o.measure, repetitions=b["r"]),
        process=replace(o.process, threads=land.threads["t"], threads_batch=land.threads["tb"])), note


def run_replay(o: TuneOptions, log: Callable[[str], None] = lambda _: None,
               progress: Callable[[Any], StudyCallback] | None = None, dry_run: bool = False,
               stop: threading.Event | None = None) -> TuneOutcome:
    """`fitter tune --backend replay --landscape FILE`: run_tune on the landscape's target, read where run_tune reads
    a target (after the build, tools and workload are checked)."""
    return run_tune(o, None, log, progress, dry_run, stop,
                    target=lambda o: replay_target(o.measure.landscape, o.search.seed))
