"""`fitter tune` at the edge: the target, the budgets, the space, the storage, the baseline, the study, the confirm
runs and the files. The search itself is fitter/tune.py; this module does the I/O around it."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from fitter.devices import RPC, CpuProfile, Device, detect_cpu_profile
from fitter.errors import FitterError
from fitter.estimator import estimate
from fitter.export import placement_flags, server_flags
from fitter.fit import DEFAULT_FIT_TARGET_MIB, fit
from fitter.launch_config import parse_launch_flags, split_process_flags
from fitter.model_spec import ModelSpec, load_model_spec
from fitter.results import (
    StudyKey,
    ensure_writable,
    machine_dir_name,
    open_study,
    picks,
    ratios,
    result_dir,
    storage_url,
    write_pareto,
    write_trials_csv,
)
from fitter.screen import Budgets, device_totals
from fitter.search_space import default_space_name, load_space, params_to_flags, resolve, shipped_space
from fitter.trial_runner import TrialResult, TrialRunner, WorkerRunner
from fitter.tune import (
    OBJECTIVES,
    Candidate,
    Screener,
    TuneProgress,
    Tuner,
    TuneRequest,
    candidate,
    combos,
    measurement_json,
)
from fitter.worker import BenchSpec

MIB = 1024 * 1024
# The README's first command tunes the demo model; without a GPU it runs on an emulated one this big, with a fit
# target that leaves 80 MiB for the model (all of it on the device would need ~127 MiB: experts must be split).
DEMO_EMULATED_GPU_MIB = 96
DEMO_FIT_TARGET_MIB = 16
HOST_RESERVE = 512 * MIB  # RAM left to the OS and fitter itself when judging host memory
# space key → the llama.cpp flags that fix it on the command line instead
FLAG_OF_KEY = {"n-cpu-moe": ("-ncmoe", "--n-cpu-moe", "-cmoe", "--cpu-moe"),
               "n-gpu-layers": ("-ngl", "--gpu-layers", "--n-gpu-layers"),
               "batch-size": ("-b", "--batch-size"), "ubatch-size": ("-ub", "--ubatch-size"),
               "cache-type-k": ("-ctk", "--cache-type-k"), "cache-type-v": ("-ctv", "--cache-type-v"),
               "flash-attn": ("-fa", "--flash-attn"), "threads": ("-t", "--threads"),
               "threads-batch": ("-tb", "--threads-batch")}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_objectives(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in OBJECTIVES]
    if not names or bad or len(set(names)) != len(names):
        raise FitterError(f"--objectives {text!r}: give a comma list of distinct objectives from "
                          f"{', '.join(OBJECTIVES)} (tg: decode t/s, pp: prefill t/s, vram: peak VRAM)")
    return names


def parse_targets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise FitterError(f"--fit-target {text!r}: expected MiB[,MiB...] as integers") from None
    if any(v < 0 for v in values):
        raise FitterError(f"--fit-target {text!r}: MiB must be >= 0")
    return values


def run_tune(ns: argparse.Namespace, flags: list[str]) -> int:
    t_start = time.monotonic()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # fitter prints its own progress

    parse_launch_flags(flags)  # bad flags stop here, before anything starts
    demo = ns.model is None
    if demo:
        from fitter.demo_models import demo_model_path

        model = str(demo_model_path())
    else:
        model = ns.model
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        spec = load_model_spec(model)
    objectives = parse_objectives(ns.objectives)
    if ns.llama_fit_params:
        from fitter.llama_fit import find_llama_fit_params

        find_llama_fit_params(ns.llama_fit_params)  # a wrong path stops here, before any study is opened
    target = sim_target(ns, spec) if ns.backend == "sim" else local_target(ns, flags, demo)
    fit_target_text = ns.fit_target or target.default_fit_target
    targets = parse_targets(fit_target_text or str(DEFAULT_FIT_TARGET_MIB))
    if "vram" in objectives and not target.has_gpu:
        objectives = tuple(o for o in objectives if o != "vram")
        _log("fitter: no GPU: the vram objective is dropped")
    space = load_space(ns.space) if ns.space else shipped_space(default_space_name(spec.n_expert, target.has_gpu))
    distributions = resolve(space, n_layer=spec.n_layer, physical_cores=target.physical_cores,
                            performance_cores=target.performance_cores)
    distributions = {k: d for k, d in distributions.items() if not _fixed(flags, k)}
    if ns.threads is not None:
        distributions.pop("threads", None)
    if ns.threads_batch is not None:
        distributions.pop("threads-batch", None)
    if ns.threads_batch is not None and ns.threads is None:
        raise FitterError("-tb without -t: give both, or neither to search them")
    machine = target.machine
    emulated_mib = target.emulated_mib
    default_threads = ns.threads or target.default_threads
    bench = BenchSpec(n_prompt=ns.n_prompt, n_gen=ns.n_gen, n_depth=ns.n_depth, repetitions=ns.repetitions,
                      threads=default_threads, threads_batch=ns.threads_batch)

    def request(devices: tuple[Device, ...], rpc: tuple[str, ...]) -> TuneRequest:
        budgets = {}
        for i, d in enumerate(devices):
            free = d.free_bytes if d.free_bytes is not None else d.total_bytes or 0
            budgets[d.name] = free - targets[i if len(targets) > 1 else 0] * MIB
        return TuneRequest(model=model, spec=spec, fixed_flags=tuple(flags), distributions=distributions,
                           devices=devices, budgets=Budgets(budgets, target.host_budget, {}), cpu=target.cpu_profile,
                           objectives=objectives, bench=bench, n_trials=ns.trials, timeout_s=ns.timeout,
                           trial_timeout_s=ns.trial_timeout, seed=ns.seed, rpc=rpc)

    if ns.dry_run:
        req = request(target.dry_devices, target.dry_rpc)
        _check_something_fits(req, targets)
        print(dry_run_text(req, space.source))
        return 0

    with target.runner() as runner:
        devices = target.devices(runner)
        req = request(devices, getattr(runner, "rpc", ()))
        _check_something_fits(req, targets)
        build = runner.build()
        folder = _folder(ns, model, target.machine_dir, build["commit"])
        url = ns.storage or storage_url(folder)
        settings = {"objectives": list(objectives), "space": space.source, "fixed_flags": flags,
                    "fit_target_mib": list(targets), "bench": {"p": bench.n_prompt, "n": bench.n_gen,
                                                               "d": bench.n_depth, "r": bench.repetitions}}
        sampler = optuna.samplers.TPESampler(seed=ns.seed, multivariate=True, constant_liar=True)
        key = StudyKey(spec.identity, machine["fingerprint"], build["commit"])
        study = open_study(url, key, [OBJECTIVES[o] for o in objectives], sampler, settings)
        _log(f"fitter: study {url} ({len(study.trials)} trials so far); space {space.source}; "
             f"{req.n_trials} launched trials")
        tuner = Tuner(req, study, runner, on_event=_progress_printer(req), heartbeat_s=5)
        baseline = _run_baseline(ns, req, tuner, runner, targets, flags, target)
        tuner.run()
        print("", file=sys.stderr)
        entries, dropped = confirm_pareto(req, tuner, runner)
        baseline = confirm_baseline(req, tuner.screener, runner, baseline)
        entries, dropped = final_front(req, tuner.screener, entries, dropped, baseline)
    doc = pareto_doc(req, spec, model, machine, build, targets, emulated_mib is not None, baseline, entries, dropped,
                     tuner, time.monotonic() - t_start, url)
    write_pareto(folder, doc)
    write_trials_csv(folder, study)
    if ns.json:
        print(json.dumps(doc, indent=1))
    else:
        print(pareto_table(doc))
        print(f"\nresults: {folder}")
        if doc["picks"]:
            from fitter.launcher_export import render

            print(render(doc, "balanced", "server", str(folder / "pareto.json")))
    return 0 if entries else 1


def _flag_value(flags: list[str], names: tuple[str, ...]) -> str | None:
    for i, f in enumerate(flags):
        if f in names and i + 1 < len(flags):
            return flags[i + 1]
    return None


def _without(flags: list[str], names: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in names:
            skip = True
        else:
            out.append(f)
    return out


def _fixed(flags: list[str], key: str) -> bool:
    names = FLAG_OF_KEY.get(key, ())
    return any(f in names for f in flags)


def _real_devices(gpus: Any, rpc_flag: str | None) -> tuple[Device, ...]:
    from fitter.devices import detect_gpus, rpc_devices

    if rpc_flag:
        return tuple(rpc_devices([x for x in rpc_flag.split(",") if x]))
    return tuple(detect_gpus()) if gpus else ()


def _folder(ns: argparse.Namespace, model: str, machine_dir: str, commit: str) -> Path:
    folder = result_dir(Path(ns.results), model, machine_dir, commit)
    ensure_writable(folder)
    return folder


def _check_something_fits(req: TuneRequest, targets: tuple[int, ...]) -> None:
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
        if "n-gpu-layers" in req.distributions:
            params["n-gpu-layers"] = 0
        s = screener(candidate(req, params))
        if s.error is None and s.constraints:
            worst = max(s.constraints.items(), key=lambda kv: kv[1])
            if lightest is None or worst[1] < lightest[0]:
                lightest = (worst[1], f"{worst[0]} by {worst[1]:.1f} MiB with {' '.join(params_to_flags(params))}")
    detail = f" the lightest configuration is over budget on {lightest[1]};" if lightest else ""
    if req.devices:
        result = fit(req.spec, parse_launch_flags(list(req.fixed_flags)), req.devices, targets, cpu=req.cpu)
        if result.fits:
            detail += f" fitter fit finds a placement outside the space: {' '.join(placement_flags(result.config))}"
        elif result.suggestions:
            detail += " would fit: " + "; ".join(result.suggestions)
    raise FitterError(f"{req.model}: no configuration of the search space fits ({req.spec.n_layer} layers; budgets "
                      + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in req.budgets.devices.items())
                      + f"; host RAM {(req.budgets.host or 0) / MIB:.0f} MiB);{detail}; nothing was launched")


def _progress_printer(req: TuneRequest) -> Any:
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
        line = (f"\rtune: trial {done + (1 if event == 'start' else 0)}/{req.n_trials} "
                f"({'running' if event == 'start' else 'done'}), {p.pruned} screened out, {p.answered} from storage; "
                f"{best}; elapsed {elapsed:.0f} s" + (f", ETA {eta:.0f} s" if eta is not None else ""))
        print(line.ljust(120), end="", file=sys.stderr, flush=True)

    return show


# -- targets: this machine (its GPUs, --rpc devices or the emulated GPU) or a simulated one ------------------


@dataclass
class Target:
    runner: Callable[[], AbstractContextManager[Any]]  # a fresh TrialRunner, as a context manager
    devices: Callable[[Any], tuple[Device, ...]]  # the devices the estimator plans for, given the running runner
    dry_devices: tuple[Device, ...]  # the same, for --dry-run, without starting anything
    dry_rpc: tuple[str, ...]
    machine: dict[str, Any]
    machine_dir: str
    physical_cores: int
    performance_cores: int
    default_threads: int
    host_budget: int
    cpu_profile: CpuProfile
    has_gpu: bool
    emulated_mib: int | None = None
    default_fit_target: str | None = None
    sim: Any = None  # the simulated Machine


def local_target(ns: argparse.Namespace, flags: list[str], demo: bool) -> Target:
    import psutil

    from fitter.bench import machine_record, parse_cpu_mask
    from fitter.probe import build_cpu_info, detect_nvidia, detect_ram, read_cpu_snapshot

    cpu_info = build_cpu_info(read_cpu_snapshot())
    gpus, nvidia = detect_nvidia()
    rpc_flag = _flag_value(flags, ("--rpc", "-rpc"))
    emulated_mib = ns.emulated_gpu
    default_fit_target = None
    if emulated_mib is None and not gpus and not rpc_flag and demo:
        emulated_mib = DEMO_EMULATED_GPU_MIB
        default_fit_target = str(DEMO_FIT_TARGET_MIB)
        _log(f"fitter: no GPU found: tuning the demo model on fitter's emulated GPU ({emulated_mib} MiB, fit target "
             f"{ns.fit_target or default_fit_target} MiB; its speed is CPU speed)")
    # the emulated GPU's RPC server computes on the CPU too: its core is not the trials' to use
    reserved = 1 if emulated_mib is not None and cpu_info.physical_cores > 1 else 0
    if reserved and ns.threads is None:
        _log(f"fitter: one core left to the emulated GPU's server: trials use up to "
             f"{cpu_info.physical_cores - reserved} threads")
    machine = machine_record(cpu_info, detect_ram().total, [g.name for g in gpus], nvidia.driver)
    if emulated_mib is not None:
        machine["emulated_gpu_mib"] = emulated_mib
        cap = emulated_mib * MIB
        dry: tuple[Device, ...] = (Device("RPC0[127.0.0.1:50052]", RPC, cap, cap),)
    else:
        dry = _real_devices(gpus, rpc_flag)
    cpus = parse_cpu_mask(ns.cpu_mask, ns.cpu_range)
    return Target(
        runner=lambda: WorkerRunner(emulated_gpu_mib=emulated_mib, cpus=cpus, nvml=bool(gpus)),
        devices=lambda r: r.devices() or _real_devices(gpus, rpc_flag),
        dry_devices=dry, dry_rpc=("127.0.0.1:50052",) if emulated_mib is not None else (),
        machine=machine, machine_dir=machine_dir_name(machine, emulated_mib),
        physical_cores=cpu_info.physical_cores - reserved,
        performance_cores=max(1, cpu_info.performance_cores - reserved),
        default_threads=max(1, cpu_info.recommended_threads - reserved),
        host_budget=psutil.virtual_memory().available - HOST_RESERVE, cpu_profile=detect_cpu_profile(),
        has_gpu=bool(gpus or rpc_flag or emulated_mib is not None), emulated_mib=emulated_mib,
        default_fit_target=default_fit_target)


def sim_target(ns: argparse.Namespace, spec: ModelSpec) -> Target:
    """A simulated machine (fitter/sim.py): its GPUs, cores and RAM stand in for this machine's."""
    import hashlib

    from fitter.sim import SimRunner, load_machine

    if not ns.machine:
        raise FitterError("--backend sim: give --machine NAME|FILE (fitter machines lists the shipped ones)")
    if ns.emulated_gpu is not None:
        raise FitterError("--backend sim and --emulated-gpu: the simulated machine has its own GPUs")
    m = load_machine(ns.machine)
    fingerprint = hashlib.sha256(Path(m.path).read_bytes() if m.path else m.name.encode()).hexdigest()[:16]
    machine = {"sim": m.name, "description": m.description, "profile": m.path, "fingerprint": fingerprint,
               "physical_cores": m.cpu.p_cores + m.cpu.e_cores, "performance_cores": m.cpu.p_cores,
               "ram_bytes": int(m.ram.gib * 2**30), "gpus": [f"sim GPU {m.gpu.memory_gib:g} GiB"] * m.gpu.count
               if m.gpu else []}
    probe_runner = SimRunner(m, spec, seed=ns.seed)
    return Target(
        runner=lambda: contextlib.nullcontext(SimRunner(m, spec, seed=ns.seed)),
        devices=lambda r: r.devices(), dry_devices=probe_runner.devices(), dry_rpc=(),
        machine=machine, machine_dir=f"sim-{m.name}-{fingerprint[:8]}",
        physical_cores=m.cpu.p_cores + m.cpu.e_cores, performance_cores=m.cpu.p_cores,
        default_threads=m.cpu.p_cores, host_budget=int(m.ram.gib * 2**30) - HOST_RESERVE,
        cpu_profile=probe_runner.cpu_profile(), has_gpu=m.gpu is not None, sim=m)


# -- baseline ---------------------------------------------------------------------------------------------------


def _run_baseline(ns: argparse.Namespace, req: TuneRequest, tuner: Tuner, runner: TrialRunner,
                  targets: tuple[int, ...], flags: list[str], target: Target) -> dict[str, Any]:
    """Trial 0: what llama.cpp does on its own. With a GPU: its `--fit` placement (llama-fit-params) with default
    batch, KV and threads; without one: llama-server's defaults. A resumed study keeps its baseline."""
    for t in tuner.study.get_trials(deepcopy=False):
        if t.user_attrs.get("phase") == "baseline":
            return _baseline_json(t)
    if req.devices:
        from fitter.llama_fit import LlamaFitError, baseline_flags, find_llama_fit_params

        tool = find_llama_fit_params(ns.llama_fit_params)
        if tool is None:
            _log("fitter: llama-fit-params not found (python -m fitter.llama_tools llama-fit-params, or "
                 "--llama-fit-params PATH): no baseline, so no ratios over llama.cpp's own choice")
            return {"name": "llama.cpp --fit", "flags": None, "measurement": None,
                    "reason": "llama-fit-params not found"}
        # the deployed context, explicitly: the fit must place the model for the context every trial runs with
        # (with -c 0 llama-fit-params resolves a context of its own, not llama-server's)
        n_ctx = estimate(req.spec, parse_launch_flags(flags), (), req.cpu).context.n_ctx
        flags = [*_without(flags, ("-c", "--ctx-size")), "-c", str(n_ctx)]
        try:
            fitted = _llama_fit(tool, req, flags, targets, target)
        except LlamaFitError as e:
            _log(f"fitter: llama.cpp's --fit failed, no baseline: {e}")
            return {"name": "llama.cpp --fit", "flags": None, "measurement": None, "reason": str(e)}
        base_flags = baseline_flags(fitted, flags)
        if req.rpc and "--rpc" not in base_flags:
            base_flags += ["--rpc", ",".join(req.rpc)]
    else:
        base_flags = list(flags)
    threads = req.default_threads
    cand = Candidate({}, parse_launch_flags(base_flags), replace(req.bench, threads=threads, threads_batch=threads),
                     (*base_flags, "-t", str(threads), "-tb", str(threads)))
    s = tuner.screener(cand)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        trial = tuner.study.ask()
    # Measured even when fitter predicts it over the fit target: it is llama.cpp's choice, the reference point.
    tuner.launch(trial, cand, s, "baseline")
    return _baseline_json(tuner.study._storage.get_trial(trial._trial_id))


def _llama_fit(tool: Path, req: TuneRequest, flags: list[str], targets: tuple[int, ...], target: Target) -> Any:
    """llama.cpp's fit on the devices the trials use. A simulated GPU is stood in for by an emulated one with the
    same free memory: the fit only queries memory and projects (no_alloc), so a header-only model is enough."""
    from fitter.llama_fit import run_llama_fit

    if target.sim is None:
        return run_llama_fit(tool, req.model, flags, req.rpc, targets, threads=req.default_threads)
    if len(req.devices) != 1:
        from fitter.llama_fit import LlamaFitError

        raise LlamaFitError(f"the simulated machine has {len(req.devices)} GPUs; the baseline fit emulates one")
    from fitter.emulated_gpu import EmulatedGpu

    free = req.devices[0].free_bytes or req.devices[0].total_bytes or 0
    with EmulatedGpu(cap_mib=free // MIB) as gpu:
        return run_llama_fit(tool, req.model, flags, (gpu.endpoint,), targets, threads=req.default_threads)


def _baseline_json(t: FrozenTrial) -> dict[str, Any]:
    return {"name": "llama.cpp --fit", "trial": t.number, "flags": t.user_attrs.get("flags"),
            "measurement": t.user_attrs.get("measurement")}


# -- confirm runs and the result --------------------------------------------------------------------------------


def pinned_flags(cand: Candidate, plan: Any) -> list[str]:
    """The flags a launcher passes: everything llama-server would decide itself pinned (fitter/export.py)."""
    return [*server_flags(cand.config, plan.context, cand.config.rpc), "-t", str(cand.spec.threads), "-tb",
            str(cand.spec.threads_batch or cand.spec.threads)]


def confirm_spec(spec: BenchSpec) -> BenchSpec:
    """Confirm runs take twice the repetitions (at least 5): they decide the picks and the ratios, and a trial's
    spread on a busy or emulated machine is 10-20 % per sample."""
    return replace(spec, repetitions=max(5, 2 * spec.repetitions))


def _confirm(req: TuneRequest, screener: Screener, runner: TrialRunner,
             cand: Candidate) -> tuple[TrialResult, dict[str, Any], Any]:
    """One confirm run: its result, its bench JSON and the config's memory plan (from the search's cache)."""
    plan = screener(cand).plan
    result = runner.run(req.model, cand.config, confirm_spec(cand.spec), req.trial_timeout_s)
    return result, measurement_json(result, runner.backend, plan, runner.emulated), plan


def confirm_pareto(req: TuneRequest, tuner: Tuner,
                   runner: TrialRunner) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Re-measure every Pareto-optimal trial; a pick that fails its confirm run is dropped and reported."""
    entries, dropped = [], []
    front = sorted(tuner.study.best_trials, key=lambda t: t.number)
    seen: set[str] = set()
    for t in front:
        if t.user_attrs.get("phase") == "baseline":
            continue  # confirmed by confirm_baseline, which every tune runs
        key = t.user_attrs.get("key", "")
        if key in seen:  # a trial answered from storage repeats an earlier one
            continue
        seen.add(key)
        flags = list(t.user_attrs["flags"])
        cand = candidate(req, dict(t.params)) if t.params else _from_flags(req, flags)
        _log(f"fitter: confirm run of trial {t.number}: {' '.join(flags)}")
        result, m, plan = _confirm(req, tuner.screener, runner, cand)
        if result.measurement.outcome != "ok":
            dropped.append({"trial": t.number, "flags": flags, "outcome": result.measurement.outcome,
                            "reason": result.measurement.reason})
            continue
        vram = sum(p["bytes"] for p in result.peak_vram.values()) if result.peak_vram else \
            sum(v for k, v in device_totals(plan).items() if k != "CPU")
        entries.append({"trial": t.number, "phase": t.user_attrs.get("phase"), "flags": pinned_flags(cand, plan),
                        "measurement": m, "vram_bytes": vram, "study_values": list(t.values)})
    return entries, dropped


def final_front(req: TuneRequest, screener: Screener, entries: list[dict[str, Any]], dropped: list[dict[str, Any]],
                baseline: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The Pareto front of the confirm runs: the study's front was chosen from single noisy trials, so what its
    confirm runs show dominated is dropped (and reported). llama.cpp's own choice competes too: when its confirm run
    is not dominated, it is on the front and may be a pick."""
    pool = list(entries)
    bm = baseline.get("measurement") or {}
    if bm.get("outcome") == "ok" and baseline.get("flags") and "trial" in baseline:
        vram = sum(p["bytes"] for p in bm.get("peak_vram", {}).values())
        cand = _from_flags(req, list(baseline["flags"]))
        pool.append({"trial": baseline["trial"], "phase": "baseline", "flags": pinned_flags(cand, screener(cand).plan),
                     "measurement": bm, "vram_bytes": vram})

    def vector(e: dict[str, Any]) -> tuple[float, ...]:  # larger is better in every coordinate
        m = e["measurement"]
        out = {"tg": m["tg"]["avg_ts"], "pp": m["pp"]["avg_ts"], "vram": -float(e["vram_bytes"])}
        return tuple(out[o] for o in req.objectives)

    front, out_dropped = [], list(dropped)
    for e in pool:
        by = next((o for o in pool if o is not e and all(a >= b for a, b in zip(vector(o), vector(e), strict=True))
                   and vector(o) != vector(e)), None)
        if by is None:
            front.append(e)
        elif e["phase"] != "baseline":
            out_dropped.append({"trial": e["trial"], "flags": e["flags"], "outcome": "dominated",
                                "reason": f"its confirm run is dominated by trial {by['trial']}'s"})
    return sorted(front, key=lambda e: e["trial"]), out_dropped


def confirm_baseline(req: TuneRequest, screener: Screener, runner: TrialRunner,
                     baseline: dict[str, Any]) -> dict[str, Any]:
    """Re-measure the baseline beside the confirm runs, so every ratio compares runs made under the same conditions
    (the baseline's trial ran first, on a cold machine). Its trial measurement stays in the study."""
    if not baseline.get("flags") or (baseline.get("measurement") or {}).get("outcome") != "ok":
        return baseline
    cand = _from_flags(req, list(baseline["flags"]))
    _log(f"fitter: confirm run of the baseline: {' '.join(baseline['flags'])}")
    _, m, _ = _confirm(req, screener, runner, cand)
    return {**baseline, "trial_measurement": baseline["measurement"], "measurement": m}


def _from_flags(req: TuneRequest, flags: list[str]) -> Candidate:
    plain, process = split_process_flags(flags, "the baseline's flags")
    threads = int(process.get("-t", req.default_threads))
    tb = int(process.get("-tb", threads))
    return Candidate({}, parse_launch_flags(plain), replace(req.bench, threads=threads, threads_batch=tb),
                     tuple(flags))


def pareto_doc(req: TuneRequest, spec: ModelSpec, model: str, machine: dict[str, Any], build: dict[str, str],
               targets: tuple[int, ...], emulated: bool, baseline: dict[str, Any], entries: list[dict[str, Any]],
               dropped: list[dict[str, Any]], tuner: Tuner, wall_s: float, url: str) -> dict[str, Any]:
    base_m = baseline.get("measurement")
    for e in entries:
        e["ratios"] = ratios(e["measurement"], base_m)
    trials = tuner.study.get_trials(deepcopy=False)
    return {
        "model": {"path": str(Path(model).resolve()), "name": Path(model).stem, "arch": spec.arch,
                  "identity": spec.identity, "n_params": spec.n_params, "tensor_bytes": spec.tensor_bytes},
        "machine": machine, "llama_cpp": build, "objectives": list(req.objectives),
        "fit_target_mib": list(targets), "emulated": emulated,
        "baseline": baseline, "pareto": entries, "dropped": dropped, "picks": picks(entries),
        "study": {"storage": url, "trials": len(trials),
                  "launched": sum(1 for t in trials if t.user_attrs.get("launched")),
                  "screened_out": sum(1 for t in trials if t.state == TrialState.PRUNED
                                      and not t.user_attrs.get("launched")),
                  "answered_from_storage": sum(1 for t in trials if "same_as" in t.user_attrs),
                  "model_loads_this_run": tuner.progress.model_loads, "wall_s": round(wall_s, 1),
                  "margins": tuner.study.user_attrs.get("margins", {})},
    }


def pareto_table(doc: dict[str, Any]) -> str:
    picks_by_trial: dict[int, list[str]] = {}
    for name, n in doc["picks"].items():
        picks_by_trial.setdefault(n, []).append(name)
    lines = [f"{'trial':>5}  {'pp t/s':>9} {'tg t/s':>8} {'VRAM MiB':>9} {'pp×':>6} {'tg×':>6}  picks / flags"]
    base = doc["baseline"]
    bm = base.get("measurement")
    if bm and bm.get("outcome") == "ok":
        vram = sum(p["bytes"] for p in bm.get("peak_vram", {}).values()) / MIB
        lines.append(f"{'base':>5}  {bm['pp']['avg_ts']:9.1f} {bm['tg']['avg_ts']:8.1f} {vram:9.1f} {'1.000':>6} "
                     f"{'1.000':>6}  llama.cpp --fit: {' '.join(base['flags'] or [])}")
    elif base.get("flags") or base.get("reason") or bm:
        lines.append(f"{'base':>5}  llama.cpp --fit: {(bm or {}).get('outcome') or base.get('reason')}")
    for e in doc["pareto"]:
        m, r = e["measurement"], e["ratios"]
        lines.append(f"{e['trial']:>5}  {m['pp']['avg_ts']:9.1f} {m['tg']['avg_ts']:8.1f} "
                     f"{e['vram_bytes'] / MIB:9.1f} {_ratio(r['pp'])} {_ratio(r['tg'])}  "
                     f"{','.join(picks_by_trial.get(e['trial'], [])) or '-'}: "
                     + ("llama.cpp --fit (the baseline) " if e.get("phase") == "baseline" else "")
                     + " ".join(_short(e["flags"])))
    for d in doc["dropped"]:
        if d["outcome"] == "dominated":
            lines.append(f"{d['trial']:>5}  dropped: {d['reason']}")
        else:
            lines.append(f"{d['trial']:>5}  dropped: its confirm run ended {d['outcome']}: {d['reason']}")
    s = doc["study"]
    lines.append(f"\n{s['trials']} trials: {s['launched']} launched, {s['screened_out']} screened out by the "
                 f"estimator, {s['answered_from_storage']} answered from storage; {s['model_loads_this_run']} model "
                 f"loads this run; {s['wall_s']:.0f} s")
    return "\n".join(lines)


def _ratio(x: float | None) -> str:
    return f"{x:6.3f}" if x is not None else f"{'-':>6}"


def _short(flags: list[str]) -> list[str]:
    """The searched part of pinned flags, for the table (the export has them all)."""
    keep = {"-ncmoe", "-ngl", "-b", "-ub", "-ctk", "-ctv", "-fa", "-t", "-tb", "-ot"}
    out = []
    for i, f in enumerate(flags):
        if f in keep and i + 1 < len(flags):
            out += [f, flags[i + 1]]
    return out


def dry_run_text(req: TuneRequest, source: str) -> str:
    """The space, the feasible region and the planned first trials; nothing launched."""
    from fitter.tune import structured_start

    screener = Screener(req)
    lines = [f"space {source}:"]
    for k, d in req.distributions.items():
        lines.append(f"  {k}: {d}")
    lines.append("feasible region (each batch/KV/flash-attention combination at its best placement):")
    n_feasible = 0
    for c in combos(req):
        placed = screener.placement(screener._with_threads(c))
        label = " ".join(f"{k}={v}" for k, v in c.items())
        if placed is None:
            lines.append(f"  {label}: nothing fits")
            continue
        n_feasible += 1
        place = {k: placed[k] for k in ("n-cpu-moe", "n-gpu-layers") if k in placed}
        plan = screener(candidate(req, placed)).plan
        used = ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in device_totals(plan).items()) if plan else ""
        lines.append(f"  {label}: {place or 'fits'} ({used})")
    lines.append(f"{n_feasible} of {len(combos(req))} combinations fit; budgets: "
                 + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in req.budgets.devices.items())
                 + f", host {(req.budgets.host or 0) / MIB:.0f} MiB")
    lines.append("planned first trials (after the baseline, llama.cpp's own --fit):")
    for p in structured_start(req, screener):
        lines.append(f"  {p.phase}: {' '.join(candidate(req, p.params).flags)}")
    return "\n".join(lines)
