"""`fitter tune` as a library call, in steps that refuse bad input before anything starts or is created:

1. `prepare`: the build and tools named, the workload, the target and the options it fixes, the request for the
   target's devices before anything starts (an emulated GPU's placeholder of the same size), whether anything fits
   (`--dry-run` stops here);
2. `make_runner`: what the run will need (llama-cpp-python or a build, the emulated GPU's pieces: a shared ggml with
   RPC and a C compiler), then the runner, not yet started;
3. `open_storage`: the results folder and its study (a corrupt study.db is refused, nothing changed), the fleet's
   claims;
4. `search`: with the runner started, the request for its devices, the baseline (trial 0) and the study;
5. `confirm_front`: the confirm rounds, once per study (by the first worker of a fleet to end its search);
6. `write_results`: pareto.json and trials.csv, and what NVML saw beyond llama.cpp's buffers.

Faults keep the study: `stop` (a Ctrl-C) ends the search after the running trial and writes no result (the same
command resumes); a disk that refuses the study or the results (full, read-only) is a one-line error saying what is
kept and that the same command goes on once the disk allows (fitter.storage.faults).

The search itself is fitter.tune.study; this module does the I/O around it. Nothing here prints: progress and notes
go to the caller's `log`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import optuna

from fitter.errors import FitterError
from fitter.flags import pin
from fitter.machine.snapshot import MachineSnapshot
from fitter.measure.llamacpp.builds import LlamaCppBuild
from fitter.measure.llamacpp.projection import guess_projector
from fitter.measure.served import WorkloadRunner
from fitter.memory.fit.budgets import check_target_count
from fitter.memory.plan.projected import guess_warning, guessed_kinds, projection_warning
from fitter.results.pareto import RESULT_FILE, ParetoDoc, load_result, write_result
from fitter.results.trials import write_trials_csv
from fitter.search.dry_run import dry_run_text
from fitter.search.request import OBJECTIVES, TuneRequest
from fitter.storage.faults import result_writes, study_writes
from fitter.storage.fleet import Beater, Claims, Worker, claims_for
from fitter.storage.optuna_api import study_storage
from fitter.storage.studies import (
    StudyKey,
    ensure_writable,
    journal_path,
    open_study,
    result_dir,
    storage_url,
    study_name,
)
from fitter.tune.baseline import Baseline, recorded_baseline, run_baseline, sim_fit_devices, study_baseline
from fitter.tune.confirm import confirm, result_doc
from fitter.tune.guards import check_something_fits, drift_guard, projected_before_start
from fitter.tune.options import TuneOptions, bench_settings, check_workload
from fitter.tune.quality_objective import QUALITY, check_quality, quality_book
from fitter.tune.study import StudyCallback, Tuner
from fitter.tune.targets import Target, fit_targets, plan_request, tune_target
from fitter.workload import measure_problem


@dataclass(frozen=True)
class TuneOutcome:
    result: ParetoDoc | None  # None for a dry run, or when another worker of a fleet confirms the study
    folder: Path | None
    dry_run: str | None = None
    confirmed_by: str | None = None  # that other worker
    stopped: str | None = None  # `stop` was set: what the study keeps and how to resume (no result was written)


@dataclass(frozen=True)
class Ready:
    """Step 1: the options as the target fixes them, and everything checked before anything starts."""

    o: TuneOptions
    snapshot: MachineSnapshot | None
    target: Target
    users: LlamaCppBuild | None  # `--llama-cpp DIR`'s build
    tool: Path | None  # llama-fit-params, for the baseline and the projection
    targets: tuple[int, ...]  # MiB left free per device
    planned: TuneRequest  # the request for the devices planned before anything starts
    guessed: tuple[str, ...]  # the memory kinds fitter has no rules for on the model (projected instead)


@dataclass(frozen=True)
class Opened:
    """Step 3: where the results go and the study that keeps the trials."""

    folder: Path
    url: str
    study: optuna.Study
    build: dict[str, str]
    worker: Worker
    claims: Claims


def run_tune(o: TuneOptions, snapshot: MachineSnapshot | None, log: Callable[[str], None] = lambda _: None,
             progress: Callable[[TuneRequest], StudyCallback] | None = None, dry_run: bool = False,
             stop: threading.Event | None = None, target: Callable[[TuneOptions], Target] | None = None) -> TuneOutcome:
    """Tune `o.model` on this machine (`snapshot`), a simulated one, or the target `target` makes of the options (a
    replayed landscape, fitter.grid.replay_tune); see the module docstring for the steps."""
    t_start = time.monotonic()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # fitter reports its own progress
    ready = prepare(o, snapshot, log, target)
    if dry_run:
        return TuneOutcome(None, None, dry_run_text(ready.planned, ready.planned.space_source))
    runner, baseline_unavailable = make_runner(ready)
    opened = open_storage(ready, runner, log)
    what = f"confirm of a study of {ready.o.search.trials} launches"  # the claim of the confirm rounds
    with runner, study_writes(opened.url):
        req, tuner, baseline = search(ready, opened, runner, baseline_unavailable, log, progress, stop)
        confirmed = confirm_front(ready, opened, req, tuner, runner, baseline, what, log)
    if isinstance(confirmed, TuneOutcome):
        return confirmed
    if confirmed is None:  # stopped before or during the confirm runs: they are all run again on resume
        opened.claims.release(what, opened.worker.name)
        return TuneOutcome(None, opened.folder, stopped=f"{tuner.launched_so_far()} of {req.n_trials} trials "
                           f"launched, each finished one kept in {opened.url}; the same command resumes the tune")
    entries, dropped, baseline = confirmed
    emulated = ready.target.emulated_mib is not None or runner.emulated
    doc = result_doc(req, ready.target.machine, opened.build, ready.targets, emulated, baseline, entries, dropped,
                     tuner, time.monotonic() - t_start, opened.url, str(opened.folder / RESULT_FILE),
                     ready.o.measure.confirm_rounds)
    write_results(ready, opened, doc, what, log)
    return TuneOutcome(doc, opened.folder)


def prepare(o: TuneOptions, snapshot: MachineSnapshot | None, log: Callable[[str], None],
            make_target: Callable[[TuneOptions], Target] | None = None) -> Ready:
    """Step 1: a wrong build folder, tool path, workload, target or fit target stops here, before any study is
    opened; then the request planned for the target's devices and whether anything of the space fits."""
    from fitter.measure.llamacpp.fit_params import find_llama_fit_params

    users = None
    if o.measure.llama_cpp is not None:
        from fitter.measure.llamacpp.builds import find_build, listed_by

        users = find_build(o.measure.llama_cpp)
        if o.measure.backend in ("sim", "replay"):
            raise FitterError(f"--llama-cpp DIR measures with that build: drop --backend {o.measure.backend}")
        if snapshot is not None:  # which GPU is CUDA0, as the build itself lists them
            snapshot = listed_by(snapshot, users.llama_server)
    fit_params = o.measure.llama_fit_params or (
        str(users.llama_fit_params) if users and users.llama_fit_params else None)
    if fit_params is None and o.measure.emulated_kind == "vulkan" and o.measure.emulated_gpu_mib is not None:
        from fitter.measure.emulator.emulated_vulkan import vulkan_build

        fit_params = str(vulkan_build() / "llama-fit-params")  # the emulated Vulkan GPU's fit is its build's
    tool = find_llama_fit_params(fit_params)
    check_workload(o)
    o = check_quality(o, users)
    target = make_target(o) if make_target is not None else tune_target(o, snapshot)
    if target.fixed_options is not None:
        o, note = target.fixed_options(o)
        log(note)
    for note in target.notes:
        log(f"fitter: {note}")
    targets = fit_targets(o, target)
    check_target_count([d.name for d in target.planned_devices], targets)
    planned = plan_request(o, target, target.planned_devices, target.planned_rpc, log)
    guessed = guessed_kinds(o.spec, target.planned_devices) if o.measure.projection != "never" else ()
    if guessed:
        planned = projected_before_start(o, target, planned, tool, log)
    elif (guess := guess_warning(o.spec, target.planned_devices)) is not None:  # --projection never: said once
        log(f"fitter: warning: {guess}")
    if planned.projector is not None or not guessed:
        check_something_fits(planned, targets)
    return Ready(o, snapshot, target, users, tool, targets, planned, guessed)


def make_runner(ready: Ready) -> tuple[WorkloadRunner, str | None]:
    """Step 2: what the run needs, before anything is created (trials on the emulated GPU need it; so does the
    baseline of a simulated GPU: llama.cpp's fit runs on an emulated one of the same size, and is skipped without
    it, saying why: the second value), then the runner, not started."""
    from fitter.machine.llama_cpp import llama_cpp_python_problem
    from fitter.measure.emulator.emulated_gpu import emulated_gpu_problem

    o, target, users = ready.o, ready.target, ready.users
    measured = target.sim is None and target.recorded_baseline is None
    if measured and users is None and (problem := llama_cpp_python_problem()) is not None:
        raise FitterError(f"fitter tune measures with llama.cpp: give your build's bin/ folder with --llama-cpp DIR, "
                          f"or install llama-cpp-python (python -m fitter.measure.llamacpp.tools --llama-cpp-python "
                          f"builds llama.cpp and installs it on that build); here {problem}")
    serving = users.llama_server if users is not None else None  # the user's build serves its emulated GPU if it can
    if target.emulated_mib is not None and (problem := emulated_gpu_problem(serving)) is not None:
        raise FitterError(problem)
    unavailable = emulated_gpu_problem(ready.tool) if target.sim is not None and ready.planned.devices else None
    runner = WorkloadRunner(target.make_runner(), o.workload)
    if (problem := measure_problem(o.workload, o.base, runner.backend)) is not None:
        raise FitterError(problem)
    return runner, unavailable


def open_storage(ready: Ready, runner: WorkloadRunner, log: Callable[[str], None]) -> Opened:
    """Step 3: the results folder (refused when it cannot be written), the study (opened or created, keyed by the
    model, the machine and the build) and the fleet's claims."""
    o, target, planned = ready.o, ready.target, ready.planned
    build = runner.build()
    folder = result_dir(o.storage.results, o.model, target.machine_dir, build["commit"])
    ensure_writable(folder)
    url = o.storage.storage or storage_url(folder)
    name = study_name(o.model, o.storage.study_name, o.storage.storage is None)
    settings = {"objectives": list(planned.objectives), "space": planned.space_source,
                "fixed_flags": pin(o.base, given=True), "fit_target_mib": list(ready.targets),
                "bench": bench_settings(o)}
    sampler = optuna.samplers.TPESampler(seed=o.search.seed, multivariate=True, constant_liar=True)
    key = StudyKey(o.spec.identity, target.machine["fingerprint"], build["commit"])
    study = open_study(url, key, [OBJECTIVES[x] for x in planned.objectives], sampler, settings, name=name)
    worker, claims = Worker.this(), claims_for(study_storage(study), name, journal_path(url))
    log(f"fitter: study {name!r} at {url} ({len(study.trials)} trials so far); space {planned.space_source}; "
        f"{planned.n_trials} launched trials; this worker is {worker.name}")
    return Opened(folder, url, study, build, worker, claims)


def search(ready: Ready, opened: Opened, runner: WorkloadRunner, baseline_unavailable: str | None,
           log: Callable[[str], None], progress: Callable[[TuneRequest], StudyCallback] | None,
           stop: threading.Event | None) -> tuple[TuneRequest, Tuner, Baseline]:
    """Step 4, the runner started: the request for its devices (screened by llama.cpp's projection where fitter
    guesses, or beside the drift guard's), the baseline as trial 0, then the study's search."""
    o, target = ready.o, ready.target
    req = plan_request(o, target, target.devices(runner), runner.rpc)
    if ready.guessed:  # the trials' screen: llama.cpp's projection on the devices the runner started
        projector = guess_projector(o.spec, ready.tool, "no llama-fit-params was found", runner.rpc, req.devices)
        req = replace(req, projector=projector)
        if target.planned_rpc:  # the emulated GPU runs now: the guess said before it started gives way, aloud
            log(f"fitter: warning: {projection_warning(o.spec, req.devices, projector.source)}")
            # the worker's child holds the emulated GPU's one connection between trials: released to project
            projector.before_run = getattr(runner, "release_devices", None)
    elif ready.users is not None:
        req = replace(req, projector=drift_guard(o, ready.users, opened.build["commit"], runner.rpc, log))
    book = quality_book(o, ready.users, opened.study, log) if QUALITY in req.objectives else None
    tuner = Tuner(req, opened.study, runner, on_event=progress(req) if progress else None, heartbeat_s=5,
                  claims=opened.claims, worker=opened.worker, log=log, quality=book)
    tuner.stop = stop or tuner.stop
    if target.recorded_baseline is not None:
        baseline = recorded_baseline(req, tuner, target.recorded_baseline, log)
    else:
        fit_devices: Any = sim_fit_devices(req, ready.tool, target.sim) if target.sim is not None else (
            lambda: contextlib.nullcontext(req.rpc))
        baseline = run_baseline(req, tuner, ready.tool, ready.targets, fit_devices, log, baseline_unavailable)
    if baseline.candidate is not None:
        tuner.drift_probe = baseline.candidate  # the baseline again half-way: the drift monitor's middle
    tuner.run()
    log("")
    return req, tuner, baseline


Confirmed = tuple[list[dict[str, Any]], list[dict[str, Any]], Baseline]


def confirm_front(ready: Ready, opened: Opened, req: TuneRequest, tuner: Tuner, runner: WorkloadRunner,
                  baseline: Baseline, what: str, log: Callable[[str], None]) -> Confirmed | TuneOutcome | None:
    """Step 5: the confirm rounds run once per study and --trials: by the first worker of a fleet to end its search,
    once every other worker's running trial has ended (a rerun with more --trials confirms again; one with as many
    does not: it shows the result that confirm wrote, when it is on this machine). The front, the dropped and the
    baseline as confirmed; the outcome when another worker confirms; None when stopped."""
    c = tuner.claim(what) if not tuner.stop.is_set() else None
    if c is not None and not c.granted:
        with result_writes(opened.url):
            write_trials_csv(opened.folder, opened.study)
        log(f"fitter: worker {c.holder} {'confirmed' if c.done else 'confirms'} the study's front and writes "
            f"pareto.json on its machine; this worker's trials are in {opened.url}")
        done = load_result(opened.folder) if c.done and (opened.folder / RESULT_FILE).exists() else None
        return TuneOutcome(done, opened.folder, confirmed_by=c.holder)
    if c is None:
        return None
    try:
        with Beater(opened.claims, opened.worker.name):
            tuner.wait_for_others()
            if "trial" not in baseline.data:  # measured by another worker, or not at all
                baseline = study_baseline(req, tuner) or baseline
            if tuner.stop.is_set():
                return None
            confirmed = confirm(req, tuner, runner, baseline, log, ready.o.measure.confirm_rounds)
            return None if tuner.stop.is_set() else confirmed  # a round cut short confirms nothing
    except BaseException:
        opened.claims.release(what, opened.worker.name)  # the next worker (or this command again) confirms
        raise


def write_results(ready: Ready, opened: Opened, doc: ParetoDoc, what: str, log: Callable[[str], None]) -> None:
    """Step 6: pareto.json and trials.csv (a disk that refuses them leaves the claim for the same command to confirm
    again), then what NVML saw the trials use beyond llama.cpp's buffers."""
    try:
        with result_writes(opened.url):
            write_result(opened.folder, doc.data)
            write_trials_csv(opened.folder, opened.study)
    except BaseException:
        with contextlib.suppress(Exception):  # a full disk may refuse this too: the claim then goes stale
            opened.claims.release(what, opened.worker.name)  # the same command, run again, confirms and writes them
        raise
    opened.claims.finish(what, opened.worker.name)
    snapshot = ready.snapshot
    if snapshot is not None and snapshot.gpus and ready.target.emulated_mib is None:
        record_overheads(opened.study, snapshot, log)


def record_overheads(study: optuna.Study, snapshot: MachineSnapshot, log: Callable[[str], None]) -> None:
    """What NVML saw the trials use on this machine's GPUs beyond llama.cpp's buffers, kept for later budgets
    (fitter.machine.measured_overhead): the next estimate, fit or tune here plans with it instead of the default."""
    from fitter.machine.measured_overhead import record_measurements

    measured = [(m, f"fitter tune trial {t.number}") for t in study.get_trials(deepcopy=False)
                if isinstance(m := t.user_attrs.get("measurement"), dict) and m.get("outcome") == "ok"]
    gpus = tuple(c.gpu for c in snapshot.gpu_order())  # CUDA0 first, as the measurements name them
    problem = record_measurements(measured, gpus, snapshot.record()["fingerprint"], snapshot.nvidia.driver)
    if problem:
        log(f"fitter: warning: {problem}")
