"""`fitter tune` as a library call: the target, the budgets, the space, the storage, the baseline, the study, the
confirm runs and the files, in an order that refuses bad input before anything starts or is created:

1. the flags, model, objectives, fit targets and space (parsed by the caller or here), the target's devices before
   anything starts (an emulated GPU's placeholder of the same size), whether anything fits;
2. what the run will need: the emulated GPU's pieces (a shared ggml with RPC: the user's build or llama-cpp-python; a C
   compiler) when trials run on one, llama-fit-params for the baseline;
3. the storage: the results folder and its study.db (a corrupt one is refused, nothing changed), the study opened
   or created;
4. then the runner (the worker, the emulated GPU), the baseline, the search, the confirm runs, pareto.json and
   trials.csv.

Faults keep the study: `stop` (a Ctrl-C) ends the search after the running trial and writes no result (the same
command resumes); a disk that refuses the study or the results (full, read-only) is a one-line error saying what is
kept and that the same command goes on once the disk allows (fitter.tune.faults).

The search itself is fitter.tune.study; this module does the I/O around it. Nothing here prints: progress and notes
go to the caller's `log`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution

from fitter.errors import FitterError
from fitter.flags import LaunchConfig, ProcessFlags, pin, placement_flags
from fitter.flags.parse import fixed_space_keys, searched_flags
from fitter.gguf.model_spec import ModelSpec
from fitter.machine.snapshot import MachineSnapshot
from fitter.measure.llama_build import LlamaCppBuild
from fitter.measure.projection import Projector, guess_projector
from fitter.measure.served import WorkloadRunner
from fitter.measure.types import BenchSpec
from fitter.memory.budgets import DEFAULT_FIT_TARGET_MIB, check_target_count, device_budgets
from fitter.memory.devices import Device
from fitter.memory.fit import fit
from fitter.memory.fit_devices import expert_layers
from fitter.memory.projected import guess_warning, guessed_kinds
from fitter.tune import split
from fitter.tune.baseline import replay_baseline, run_baseline, sim_fit_devices, study_baseline
from fitter.tune.confirm import DEFAULT_ROUNDS, confirm, result_doc
from fitter.tune.faults import result_writes, study_writes
from fitter.tune.fleet import Beater, Worker, claims_for
from fitter.tune.plan import Screener
from fitter.tune.render import dry_run_text
from fitter.tune.request import CTX_KEY, OBJECTIVES, STREAM_OBJECTIVES, TuneRequest, candidate, combos
from fitter.tune.result import RESULT_FILE, ParetoDoc, load_result, write_result
from fitter.tune.screen import Budgets
from fitter.tune.space import default_space_name, load_space, resolve, shipped_space
from fitter.tune.storage import (
    StudyKey,
    ensure_writable,
    journal_path,
    open_study,
    result_dir,
    storage_url,
    study_name,
    study_storage,
)
from fitter.tune.study import StudyCallback, Tuner
from fitter.tune.targets import Target, local_target, replay_target, sim_target
from fitter.tune.trials import write_trials_csv
from fitter.units import MIB
from fitter.workload import Workload, context_choices, context_problem, measure_problem


@dataclass(frozen=True)
class TuneOptions:
    """What `fitter tune` was asked, parsed (fitter.cli.tune builds it from argv)."""

    model: str
    spec: ModelSpec
    base: LaunchConfig  # the user's llama.cpp flags, parsed once
    demo: bool = False  # the model is the demo model (no GPU: it tunes on the emulated GPU by itself)
    process: ProcessFlags = field(default_factory=ProcessFlags)  # -t/-tb fix the threads; -C/-Cr the affinity
    objectives: tuple[str, ...] = ("tg", "pp", "vram")
    fit_targets: tuple[int, ...] | None = None  # None: the target's default (1024 MiB, llama.cpp's)
    space: str | None = None  # a search-space file; None: the shipped one for the model and machine
    trials: int = 12
    timeout_s: float | None = None
    trial_timeout_s: float | None = None
    seed: int = 0
    workload: Workload = field(default_factory=Workload)  # -p -n -d --concurrency, or --workload FILE
    repetitions: int = 3
    confirm_rounds: int = DEFAULT_ROUNDS  # interleaved confirm rounds (fitter.tune.confirm), each of -r repetitions
    storage: str | None = None
    study_name: str | None = None  # the study's name in a shared storage (default: fitter-<model file stem>)
    results: Path = Path("results")
    emulated_gpu_mib: int | tuple[int, ...] | None = None  # several: one emulated GPU per value
    emulated_cuda: bool = False  # `--emulated-gpu cuda:MiB`: the CUDA-shaped emulated GPU
    llama_fit_params: str | None = None
    llama_cpp: str | None = None  # `--llama-cpp DIR`: trials through that build's llama-server, its fit the baseline
    projection: str = "auto"  # the drift guard with --llama-cpp: auto (another build or backend), always, never
    backend: str = "llama-cpp-python"
    machine: str | None = None  # --backend sim: the simulated machine
    landscape: str | None = None  # --backend replay: the recorded landscape (fitter grid)


@dataclass(frozen=True)
class TuneOutcome:
    result: ParetoDoc | None  # None for a dry run, or when another worker of a fleet confirms the study
    folder: Path | None
    dry_run: str | None = None
    confirmed_by: str | None = None  # that other worker
    stopped: str | None = None  # `stop` was set: what the study keeps and how to resume (no result was written)


def parse_objectives(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in OBJECTIVES]
    if not names or bad or len(set(names)) != len(names):
        raise FitterError(f"--objectives {text!r}: give a comma list of distinct objectives from "
                          f"{', '.join(OBJECTIVES)} (tg: decode t/s, pp: prefill t/s, vram: peak VRAM, ctx: the "
                          "context, with --min-ctx; tg-stream: one stream's decode t/s, ttft: time to first token, "
                          "with --concurrency)")
    return names


def tune_target(o: TuneOptions, snapshot: MachineSnapshot | None) -> Target:
    """What the trials run on: this machine (`snapshot`), a simulated one, or a replayed landscape."""
    if o.backend == "sim":
        return sim_target(o.machine, o.emulated_gpu_mib, o.spec, o.seed)
    if o.backend == "replay":
        return replay_target(o.landscape, o.seed)
    assert snapshot is not None, "a tune on this machine needs its snapshot"
    return local_target(snapshot, o.base, o.process, o.emulated_gpu_mib, o.demo, o.fit_targets, o.emulated_cuda,
                        o.llama_cpp)


def plan_request(o: TuneOptions, target: Target, devices: tuple[Device, ...], rpc: tuple[str, ...],
                 log: Callable[[str], None] = lambda _: None) -> TuneRequest:
    """The request for the target's devices: objectives, the resolved space less what the flags fix, budgets."""
    objectives = o.objectives
    if "vram" in objectives and not target.has_gpu:
        objectives = tuple(x for x in objectives if x != "vram")
        log("fitter: no GPU: the vram objective is dropped")
    if target.distributions is not None:  # a replay: the recorded space
        distributions, source = dict(target.distributions), target.space_source or ""
    else:
        space = load_space(o.space) if o.space else shipped_space(default_space_name(o.spec.n_expert, target.has_gpu))
        distributions = resolve(space, n_layer=o.spec.n_layer, physical_cores=target.physical_cores,
                                performance_cores=target.performance_cores, expert_layers=expert_layers(o.spec))
        source = space.source
    fixed = fixed_space_keys(o.base)
    distributions = {k: d for k, d in distributions.items() if k not in fixed}
    if "n-cpu-moe" not in distributions:  # the flags place the experts (or there are none): nothing to order
        distributions.pop(split.ORDER, None)
    if o.workload.min_ctx and target.distributions is None:  # the context as a trade: searched, a Pareto axis
        contexts = context_choices(o.workload.min_ctx, o.spec.n_ctx_train)
        distributions = {CTX_KEY: CategoricalDistribution(contexts), **distributions}
        objectives = (*objectives, "ctx") if "ctx" not in objectives else objectives
    if target.distributions is None and len(devices) > 1 and not set(split.FIXING_FLAGS) & o.base.given:
        # several GPUs: per-device placement instead of -ncmoe's first layers (fitter.tune.split)
        distributions = split.split_dims(distributions, len(devices), o.spec.n_layer)
    if o.process.threads is not None:
        distributions.pop("threads", None)
    if o.process.threads_batch is not None:
        distributions.pop("threads-batch", None)
    if o.process.threads_batch is not None and o.process.threads is None:
        raise FitterError("-tb without -t: give both, or neither to search them")
    w = o.workload  # the runner measures each depth (fitter.measure.served); the spec names the deepest
    bench = BenchSpec(n_prompt=w.n_prompt, n_gen=w.n_gen, n_depth=max(w.depths), repetitions=o.repetitions,
                      threads=o.process.threads or target.default_threads, threads_batch=o.process.threads_batch,
                      streams=w.concurrency)
    targets = fit_targets(o, target)
    budgets: dict[str, int] = {}
    for name, budget in device_budgets(devices, targets).items():
        if budget is None:
            raise FitterError(f"{name}: its free memory is unknown, so tune has no VRAM budget for it; give "
                              "--emulated-gpu MiB, or tune on the machine that has the GPU")
        budgets[name] = budget
    return TuneRequest(model=o.model, spec=o.spec, base=o.base, distributions=distributions, devices=devices,
                       budgets=Budgets(budgets, target.host_budget, {}), cpu=target.cpu_profile,
                       objectives=objectives, bench=bench, workload=w, n_trials=o.trials, timeout_s=o.timeout_s,
                       trial_timeout_s=o.trial_timeout_s, seed=o.seed, rpc=rpc, space_source=source)


def bench_settings(o: TuneOptions) -> dict[str, Any]:
    """What the study measures, as its settings record it: llama-bench's -p -n -d -r, and the workload when it
    is more than one test (a study measured under one workload is not resumed under another)."""
    w = o.workload
    out: dict[str, Any] = {"p": w.n_prompt, "n": w.n_gen, "d": max(w.depths), "r": o.repetitions}
    if not w.is_default_shape or w.min_ctx or w.prompts is not None:
        out["workload"] = {k: v for k, v in w.to_json().items() if k not in ("source", "description")}
    return out


def check_workload(o: TuneOptions) -> None:
    """A workload the target can measure and the context can hold, before anything starts."""
    w = o.workload
    if w.concurrency > 1 and o.backend != "sim" and o.llama_cpp is None:
        raise FitterError(f"{w.source}: {w.concurrency} concurrent streams are served by llama-server: give your "
                          "build with --llama-cpp DIR (the pinned one: python -m fitter.measure.tools), or tune a "
                          "simulated machine (--backend sim)")
    if not w.is_default_shape and o.backend == "replay":
        raise FitterError(f"{w.source}: a replayed landscape holds one test per config: drop the depth list and "
                          "--concurrency")
    streamed = [x for x in o.objectives if x in STREAM_OBJECTIVES]
    if streamed and w.concurrency < 2:
        raise FitterError(f"--objectives {','.join(streamed)}: measured with several streams served at once: give "
                          "--concurrency N (N >= 2) or a workload with concurrency")
    if "ctx" in o.objectives and not w.min_ctx:
        raise FitterError("--objectives ctx: the context is an objective where it is searched: give --min-ctx N")
    if w.min_ctx:
        if o.backend == "replay":
            raise FitterError(f"{w.source}: a replayed landscape holds the contexts it recorded: drop --min-ctx")
        context_choices(w.min_ctx, o.spec.n_ctx_train)  # more than the training context: refused here
    if (problem := context_problem(w, o.base, o.spec.n_ctx_train)) is not None:
        raise FitterError(problem)


def fit_targets(o: TuneOptions, target: Target) -> tuple[int, ...]:
    return o.fit_targets or target.default_fit_target or (DEFAULT_FIT_TARGET_MIB,)


def check_something_fits(req: TuneRequest, targets: tuple[int, ...]) -> None:
    """A model that cannot fit even with every expert on the CPU: no trials; by how much, and what would fit."""
    screener = Screener(req)
    all_combos = combos(req)
    if any(screener.placement(c) is not None for c in all_combos):
        return
    lightest: tuple[float, str] | None = None
    for c in all_combos:
        params = screener._with_threads(c)
        if "n-cpu-moe" in req.distributions:
            params["n-cpu-moe"] = req.spec.n_layer
        if split.MODE in req.distributions:  # every expert on the CPU, llama.cpp's own split
            params.update({split.experts_key(i): req.spec.n_layer for i in range(len(req.devices))})
        if "n-gpu-layers" in req.distributions:
            params["n-gpu-layers"] = 0
        cand = candidate(req, params)
        s = screener(cand)
        if s.error is None and s.constraints:
            worst = max(s.constraints.items(), key=lambda kv: kv[1])
            if lightest is None or worst[1] < lightest[0]:
                searched = " ".join(searched_flags(list(cand.flags), req.fixed_flags))
                lightest = (worst[1], f"{worst[0]} by {worst[1]:.1f} MiB with {searched}")
    detail = f" the lightest configuration is over budget on {lightest[1]};" if lightest else ""
    if req.devices:
        projector = req.projector if guessed_kinds(req.spec) else None
        result = fit(req.spec, req.base, req.devices, targets, cpu=req.cpu, projects=projector)
        if result.fits:
            detail += f" fitter fit finds a placement outside the space: {' '.join(placement_flags(result.config))}"
        elif result.suggestions:
            detail += " would fit: " + "; ".join(result.suggestions)
    raise FitterError(f"{req.model}: no configuration of the search space fits ({req.spec.n_layer} layers; budgets "
                      + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in req.budgets.devices.items())
                      + f"; host RAM {(req.budgets.host or 0) / MIB:.0f} MiB);{detail}; nothing was launched")


def run_tune(o: TuneOptions, snapshot: MachineSnapshot | None, log: Callable[[str], None] = lambda _: None,
             progress: Callable[[TuneRequest], StudyCallback] | None = None, dry_run: bool = False,
             stop: threading.Event | None = None) -> TuneOutcome:
    """Tune `o.model` on this machine (`snapshot`) or a simulated one; see the module docstring for the order."""
    from fitter.machine.llama_cpp import llama_cpp_python_problem
    from fitter.measure.emulated_gpu import emulated_gpu_problem
    from fitter.measure.llama_fit import find_llama_fit_params

    t_start = time.monotonic()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # fitter reports its own progress
    users = None
    if o.llama_cpp is not None:
        from fitter.measure.llama_build import find_build

        users = find_build(o.llama_cpp)  # a wrong folder stops here, before any study is opened
        if o.backend in ("sim", "replay"):
            raise FitterError(f"--llama-cpp DIR measures with that build: drop --backend {o.backend}")
        if snapshot is not None:  # which GPU is CUDA0, as the build itself lists them
            from fitter.measure.llama_build import listed_by

            snapshot = listed_by(snapshot, users.llama_server)
    fit_params = o.llama_fit_params or (str(users.llama_fit_params) if users and users.llama_fit_params else None)
    tool = find_llama_fit_params(fit_params)  # a wrong path stops here, before any study is opened
    check_workload(o)
    target = tune_target(o, snapshot)
    if target.replay is not None:
        o = replay_options(o, target.replay, log)
    for note in target.notes:
        log(f"fitter: {note}")
    targets = fit_targets(o, target)
    check_target_count([d.name for d in target.planned_devices], targets)
    planned = plan_request(o, target, target.planned_devices, target.planned_rpc, log)
    guessed = guessed_kinds(o.spec) if o.projection != "never" else ()
    if guessed:
        planned = projected_before_start(o, target, planned, tool, log)
    elif (guess := guess_warning(o.spec)) is not None:  # --projection never: the guess, said once
        log(f"fitter: warning: {guess}")
    if planned.projector is not None or not guessed:
        check_something_fits(planned, targets)
    if dry_run:
        return TuneOutcome(None, None, dry_run_text(planned, planned.space_source))

    # what the run needs, before anything is created: trials on the emulated GPU need it; so does the baseline of
    # a simulated GPU (llama.cpp's fit runs on an emulated one of the same size), which is skipped without it
    measured = target.sim is None and target.replay is None
    if measured and o.llama_cpp is None and (problem := llama_cpp_python_problem()) is not None:
        raise FitterError(f"fitter tune measures with llama.cpp: give your build's bin/ folder with --llama-cpp DIR, "
                          f"or install llama-cpp-python (python -m fitter.measure.tools --llama-cpp-python builds "
                          f"llama.cpp and installs it on that build); here {problem}")
    serving = users.llama_server if users is not None else None  # the user's build serves its emulated GPU if it can
    if target.emulated_mib is not None and (problem := emulated_gpu_problem(serving)) is not None:
        raise FitterError(problem)
    baseline_unavailable = emulated_gpu_problem(tool) if target.sim is not None and planned.devices else None

    runner = WorkloadRunner(target.make_runner(), o.workload)
    if (problem := measure_problem(o.workload, o.base, runner.backend)) is not None:
        raise FitterError(problem)
    build = runner.build()
    folder = result_dir(o.results, o.model, target.machine_dir, build["commit"])
    ensure_writable(folder)
    url = o.storage or storage_url(folder)
    name = study_name(o.model, o.study_name, o.storage is None)
    settings = {"objectives": list(planned.objectives), "space": planned.space_source,
                "fixed_flags": pin(o.base, given=True), "fit_target_mib": list(targets),
                "bench": bench_settings(o)}
    sampler = optuna.samplers.TPESampler(seed=o.seed, multivariate=True, constant_liar=True)
    key = StudyKey(o.spec.identity, target.machine["fingerprint"], build["commit"])
    study = open_study(url, key, [OBJECTIVES[x] for x in planned.objectives], sampler, settings, name=name)
    worker, claims = Worker.this(), claims_for(study_storage(study), name, journal_path(url))
    log(f"fitter: study {name!r} at {url} ({len(study.trials)} trials so far); space {planned.space_source}; "
        f"{planned.n_trials} launched trials; this worker is {worker.name}")

    with runner, study_writes(url):
        req = plan_request(o, target, target.devices(runner), runner.rpc)
        if guessed:  # the trials' screen: llama.cpp's projection on the devices the runner started
            projector = guess_projector(o.spec, tool, "no llama-fit-params was found", runner.rpc)
            req = replace(req, projector=projector)
        elif users is not None:
            req = replace(req, projector=drift_guard(o, users, build["commit"], runner.rpc, log))
        tuner = Tuner(req, study, runner, on_event=progress(req) if progress else None, heartbeat_s=5,
                      claims=claims, worker=worker, log=log)
        tuner.stop = stop or tuner.stop
        fit_devices: Any = sim_fit_devices(req, tool, target.sim) if target.sim is not None else (
            lambda: contextlib.nullcontext(req.rpc))
        if target.replay is not None:
            recorded = target.replay.baseline
            baseline = replay_baseline(req, tuner, list(recorded.flags) if recorded else None,
                                       target.replay.baseline_reason, log)
        else:
            baseline = run_baseline(req, tuner, tool, targets, fit_devices, log, baseline_unavailable)
        if baseline.candidate is not None:
            tuner.drift_probe = baseline.candidate  # the baseline again half-way: the drift monitor's middle
        tuner.run()
        log("")
        # the confirm rounds run once per study and --trials: by the first worker of a fleet to end its search, once
        # every other worker's running trial has ended (a rerun with more --trials confirms again; one with as many
        # does not: it shows the result that confirm wrote, when it is on this machine)
        what = f"confirm of a study of {o.trials} launches"
        c = tuner.claim(what) if not tuner.stop.is_set() else None
        if c is not None and not c.granted:
            with result_writes(url):
                write_trials_csv(folder, study)
            log(f"fitter: worker {c.holder} {'confirmed' if c.done else 'confirms'} the study's front and writes "
                f"pareto.json on its machine; this worker's trials are in {url}")
            done = load_result(folder) if c.done and (folder / RESULT_FILE).exists() else None
            return TuneOutcome(done, folder, confirmed_by=c.holder)
        if c is not None:
            try:
                with Beater(claims, worker.name):
                    tuner.wait_for_others()
                    if "trial" not in baseline.data:  # measured by another worker, or not at all
                        baseline = study_baseline(req, tuner) or baseline
                    if not tuner.stop.is_set():
                        entries, dropped, baseline = confirm(req, tuner, runner, baseline, log, o.confirm_rounds)
            except BaseException:
                claims.release(what, worker.name)  # the next worker (or this command again) confirms
                raise
    if tuner.stop.is_set():  # before or during the confirm runs: they are all run again on resume
        claims.release(what, worker.name)
        return TuneOutcome(None, folder, stopped=f"{tuner.launched_so_far()} of {req.n_trials} trials launched, "
                           f"each finished one kept in {url}; the same command resumes the tune")
    emulated = target.emulated_mib is not None or runner.emulated
    doc = result_doc(req, target.machine, build, targets, emulated, baseline, entries, dropped, tuner,
                     time.monotonic() - t_start, url, str(folder / RESULT_FILE), o.confirm_rounds)
    try:
        with result_writes(url):
            write_result(folder, doc.data)
            write_trials_csv(folder, study)
    except BaseException:
        with contextlib.suppress(Exception):  # a full disk may refuse this too: the claim then goes stale
            claims.release(what, worker.name)  # the same command, run again, confirms and writes them
        raise
    claims.finish(what, worker.name)
    if snapshot is not None and snapshot.gpus and target.emulated_mib is None:
        record_overheads(study, snapshot, log)
    return TuneOutcome(doc, folder)


def replay_options(o: TuneOptions, land: Any, log: Callable[[str], None]) -> TuneOptions:
    """`o` for a replay of `land` (fitter.sim.landscape.Landscape): the recorded model, fixed flags, space, fit
    targets and threads must be the ones given (or be left out: then they are the landscape's); the bench settings
    (-p -n -d -r) are the landscape's."""
    from fitter.flags.consumers import with_bench_context
    from fitter.flags.parse import parse_launch_flags

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
    if o.space and o.space != land.space:
        raise refuse("the space", land.space, o.space)
    if o.fit_targets and tuple(o.fit_targets) != land.fit_target_mib:
        raise refuse("--fit-target", ",".join(map(str, land.fit_target_mib)), ",".join(map(str, o.fit_targets)))
    if o.emulated_gpu_mib is not None:
        raise FitterError("--backend replay and --emulated-gpu: the landscape has its own devices")
    recorded_threads = (land.threads["t"], land.threads["tb"])
    if o.process.threads is not None and (o.process.threads, o.process.threads_batch) != recorded_threads:
        raise refuse("-t/-tb", recorded_threads, (o.process.threads, o.process.threads_batch))
    b = land.bench
    log(f"fitter: replaying {land.path}: {len(land.points)} configs recorded over {land.rounds} rounds "
        f"(-p {b['p']} -n {b['n']} -d {b['d']} -r {b['r']})")
    base = with_bench_context(parse_launch_flags(land.fixed_flags, land.consumer), b["p"] + b["n"] + b["d"])
    return replace(o, base=base, space=None, fit_targets=land.fit_target_mib,
                   workload=Workload(n_prompt=b["p"], n_gen=b["n"], depths=(b["d"],), source=str(land.path)),
                   repetitions=b["r"],
                   process=replace(o.process, threads=land.threads["t"], threads_batch=land.threads["tb"]))


def record_overheads(study: optuna.Study, snapshot: MachineSnapshot, log: Callable[[str], None]) -> None:
    """What NVML saw the trials use on this machine's GPUs beyond llama.cpp's buffers, kept for later budgets
    (fitter.machine.overhead): the next estimate, fit or tune here plans with it instead of the default."""
    from fitter.machine.overhead import record_measurements

    measured = [(m, f"fitter tune trial {t.number}") for t in study.get_trials(deepcopy=False)
                if isinstance(m := t.user_attrs.get("measurement"), dict) and m.get("outcome") == "ok"]
    gpus = tuple(c.gpu for c in snapshot.gpu_order())  # CUDA0 first, as the measurements name them
    problem = record_measurements(measured, gpus, snapshot.record()["fingerprint"], snapshot.nvidia.driver)
    if problem:
        log(f"fitter: warning: {problem}")


def projected_before_start(o: TuneOptions, target: Target, planned: TuneRequest, tool: Path | None,
                           log: Callable[[str], None]) -> TuneRequest:
    """The request the checks before the study (and --dry-run) screen with, for a model fitter guesses a kind for:
    llama.cpp's projection where the build can see the devices (the CPU, real GPUs); a simulated GPU it never sees,
    so that is refused; an emulated GPU is started only by the run, so until then the guess, said aloud."""
    projector = guess_projector(o.spec, tool, "no llama-fit-params was found (--llama-fit-params PATH)")
    if target.sim is not None and target.planned_devices:
        raise FitterError(f"{o.model}: fitter has no rules for the {' and '.join(guessed_kinds(o.spec))} memory of "
                          f"{o.spec.arch!r}, and llama.cpp cannot project a simulated machine's GPUs: take fitter's "
                          "guess with --projection never")
    if target.planned_rpc:
        log(f"fitter: warning: {o.spec.arch}: before the emulated GPU starts, the feasible region is fitter's guess "
            f"of its {' and '.join(guessed_kinds(o.spec))} memory; every trial is screened by {projector.source}")
        return planned
    log(f"fitter: {o.spec.arch}: fitter has no rules for its {' and '.join(guessed_kinds(o.spec))} memory: every "
        f"config is screened by {projector.source}")
    return replace(planned, projector=projector)


def drift_guard(o: TuneOptions, users: LlamaCppBuild, commit: str, rpc: tuple[str, ...],
                log: Callable[[str], None]) -> Projector | None:
    """The build's own projection of each config before it is launched, when fitter's rules may not hold for it:
    another commit than the one they were matched against, a CUDA device (no golden from a CUDA build yet) or a
    backend fitter has no rules for (`--projection auto`); `always`/`never` force it. The screen then takes the
    larger of the two per device (fitter.tune.screen.Screen.with_projection), and the trial records both."""
    from fitter import LLAMA_CPP_TARGET
    from fitter.measure.llama_build import list_devices

    tool = users.llama_fit_params
    if o.projection == "never" or tool is None:
        if o.projection == "always":
            raise FitterError(f"--projection always: {users.folder} has no llama-fit-params to project with")
        return None
    why = None
    if o.projection == "always":
        why = "asked for"
    elif not commit.startswith(LLAMA_CPP_TARGET["commit"]):
        why = f"the build is {commit}, fitter's rules were matched against {LLAMA_CPP_TARGET['commit']}"
    else:
        names = [d.name for d in list_devices(users, rpc)]
        other = [n for n in names if not n.startswith("RPC")]
        if other:
            why = f"{', '.join(other)}: no golden data from that backend yet"
    if why is None:
        return None
    log(f"fitter: drift guard on ({why}): each config is projected by {tool} before it is launched, and screened "
        "with the larger of that and fitter's estimate")
    return Projector(tool, o.spec, rpc)
