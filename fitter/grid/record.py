"""`fitter grid` as a library call: every config of a search space measured on this machine (or a simulated one),
K times, into a landscape file (fitter.grid.landscape) that `--backend replay` plays back.

The target, devices, budgets, space and screening are `fitter tune`'s own (fitter.tune.session.tune_target and
plan_request, the Screener): a config the estimator screens out is recorded with its reason and never launched.
The baseline (llama.cpp's --fit choice, fitter.tune.baseline.baseline_candidate) is one more point. Feasible
configs run in K interleaved rounds: each round is a fresh seeded shuffle of all of them, one bench run each, so
slow drift (a warming CPU, other load) hits every config alike. The file is rewritten atomically after every run;
the same command again continues it (a config gets the runs of the rounds it lacks), and a file recorded for
another model, machine, build, space, flags, budgets or bench settings is refused.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from optuna.distributions import distribution_to_json

from fitter.errors import FitterError
from fitter.flags import pin
from fitter.grid.landscape import DeviceRecord, Landscape, Point, best_within_noise, load_landscape, write_landscape
from fitter.grid.points import space_points
from fitter.machine.snapshot import MachineSnapshot
from fitter.memory.fit.budgets import check_target_count
from fitter.paths import safe_name
from fitter.results.measurement import measurement_json
from fitter.search.plan import Screener
from fitter.search.request import THREAD_KEYS, Candidate, TuneRequest, _choices, candidate
from fitter.search.space import params_to_flags
from fitter.storage.studies import slug
from fitter.tune.baseline import _candidate, baseline_candidate, on_these_devices, sim_fit_devices
from fitter.tune.options import TuneOptions
from fitter.tune.targets import fit_targets, plan_request, tune_target

LANDSCAPES = Path("landscapes")
# what a resumed recording must share with the file, as (label, how to read it off a landscape)
_SAME: tuple[tuple[str, Callable[[Landscape], Any]], ...] = (
    ("model", lambda s: s.model.get("identity")),
    ("machine", lambda s: s.machine.get("fingerprint")),
    ("llama.cpp build", lambda s: s.llama_cpp.get("commit")),
    ("emulated GPU", lambda s: (s.emulated_gpu_mib, s.emulated_kind)),
    ("devices", lambda s: [(d.kind, d.total_bytes) for d in s.devices]),
    ("fit target", lambda s: list(s.fit_target_mib)),
    ("bench settings", lambda s: s.bench),
    ("threads", lambda s: s.threads),
    ("space", lambda s: s.distributions),
    ("flags", lambda s: list(s.fixed_flags)),
    ("program (--for)", lambda s: s.consumer),
)


def default_out(model: str, machine_dir: str) -> Path:
    """landscapes/<model>-<machine dir>.json: the machine folder `fitter tune` files its results under."""
    return LANDSCAPES / f"{slug(Path(model).stem)}-{safe_name(machine_dir, keep='+')}.json"


def round_order(keys: list[str], seed: int, round_index: int) -> list[str]:
    """The order of one round: a permutation of every feasible config, seeded by the round."""
    order = list(keys)
    random.Random(f"{seed}|round {round_index}").shuffle(order)
    return order


def record_landscape(o: TuneOptions, snapshot: MachineSnapshot | None, rounds: int = 3, out: Path | None = None,
                     log: Callable[[str], None] = lambda _: None,
                     max_runs: int | None = None) -> tuple[Landscape, Path]:
    """Record (or continue) the landscape of `o`'s space; at most `max_runs` runs this call (None: all)."""
    from fitter.machine.llama_cpp import llama_cpp_python_problem
    from fitter.measure.emulator.emulated_gpu import emulated_gpu_problem
    from fitter.measure.llamacpp.fit_params import find_llama_fit_params

    if rounds < 1:
        raise FitterError(f"--rounds {rounds}: give at least 1")
    if o.measure.backend == "replay":
        raise FitterError("fitter grid measures: --backend replay plays a landscape back, it does not record one")
    tool = find_llama_fit_params(o.measure.llama_fit_params)
    target = tune_target(o, snapshot)
    for note in target.notes:
        log(f"fitter: {note}")
    targets = fit_targets(o, target)
    check_target_count([d.name for d in target.planned_devices], targets)
    if target.sim is None and (problem := llama_cpp_python_problem()) is not None:
        raise FitterError(f"fitter grid measures with llama.cpp: install llama-cpp-python (python -m "
                          f"fitter.measure.llamacpp.tools --llama-cpp-python); here {problem}")
    if target.emulated_mib is not None and (problem := emulated_gpu_problem(None)) is not None:
        raise FitterError(problem)
    unavailable = emulated_gpu_problem(tool) if target.sim is not None and target.planned_devices else None
    runner = target.make_runner()
    build = runner.build()
    path = out or default_out(o.model, target.machine_dir)
    existing = load_landscape(path) if path.exists() else None
    t0 = time.monotonic()
    with runner:
        req = plan_request(o, target, target.devices(runner), runner.rpc)
        screener = Screener(req)
        land = _header(o, req, target, build, targets, rounds, path)
        cands: dict[str, Candidate] = {}
        points: list[Point] = []
        for params in space_points(req):
            cand = candidate(req, params)
            s = screener(cand)
            points.append(Point(params, cand.flags, None if s.feasible else s.reason()))
            cands[points[-1].key] = cand
        if existing is not None:
            _check_same(existing, land, path)
            land = replace(land, points=existing.points, rounds=max(rounds, existing.rounds),
                           baseline_reason=existing.baseline_reason, wall_s=existing.wall_s)
            log(f"fitter: continuing {path}: {sum(len(p.runs) for p in existing.points)} runs recorded")
        else:
            land = replace(land, points=tuple(points))
        base = land.baseline
        if base is None:
            fit_devices: Any = sim_fit_devices(req, tool, target.sim) if target.sim is not None else (
                lambda: contextlib.nullcontext(req.rpc))
            fitted, why, message = baseline_candidate(req, tool, targets, fit_devices, unavailable)
            if fitted is None:
                log(f"fitter: {message}")
                land = replace(land, baseline_reason=why)
            else:
                if message:  # a note on how llama.cpp's fit ran
                    log(f"fitter: baseline: {message}")
                base = Point({}, fitted.flags, baseline=True)
                land = replace(land, points=(base, *land.points), baseline_reason=None)
        if base is not None:
            cands[base.key] = _baseline_candidate(req, base)
        write_landscape(path, land)
        land = _measure(req, runner, screener, land, cands, rounds, path, log, max_runs, t0)
    return land, path


def _header(o: TuneOptions, req: TuneRequest, target: Any, build: dict[str, Any], targets: tuple[int, ...],
            rounds: int, path: Path) -> Landscape:
    return Landscape(
        path=str(path),
        model={"name": Path(o.model).stem, "identity": o.spec.identity, "arch": o.spec.arch,
               "path": str(Path(o.model).resolve())},
        machine=target.machine, llama_cpp=dict(build), emulated_gpu_mib=target.emulated_mib,
        emulated_cuda=o.measure.emulated_kind == "cuda", emulated_kind=o.measure.emulated_kind,
        devices=tuple(DeviceRecord.of(d) for d in req.devices), rpc=req.rpc,
        fit_target_mib=tuple(targets),
        bench={"p": o.workload.n_prompt, "n": o.workload.n_gen, "d": o.workload.depths[0], "r": o.measure.repetitions},
        threads={"t": o.process.threads, "tb": o.process.threads_batch},
        target={"physical_cores": target.physical_cores, "performance_cores": target.performance_cores,
                "default_threads": req.default_threads, "host_budget": target.host_budget},
        cpu_profile=req.cpu, space=req.space_source,
        distributions={k: _choices(d) for k, d in req.distributions.items()},
        optuna={k: distribution_to_json(d) for k, d in req.distributions.items()},
        fixed_flags=tuple(pin(o.base, given=True)), consumer=o.base.consumer, rounds=rounds, seed=o.search.seed,
        points=())


def _check_same(old: Landscape, new: Landscape, path: Path) -> None:
    for label, read in _SAME:
        if read(old) != read(new):
            raise FitterError(f"{path}: recorded for another {label} ({read(old)}), this run has {read(new)}: give "
                              "another --out, or the settings it was recorded with")


def _baseline_candidate(req: TuneRequest, base: Point) -> Candidate:
    """The recorded baseline as this session's trial: its RPC endpoint moved to this session's emulated GPU."""
    return _candidate(req, on_these_devices(req, list(base.flags)), "the landscape's baseline flags")


def _measure(req: TuneRequest, runner: Any, screener: Screener, land: Landscape, cands: dict[str, Candidate],
             rounds: int, path: Path, log: Callable[[str], None], max_runs: int | None, t0: float) -> Landscape:
    """The rounds: each a seeded permutation of the feasible configs; a config's run of a round it has is kept."""
    by_key = {p.key: p for p in land.points}
    feasible = [p.key for p in land.points if p.screened is None]
    todo = sum(1 for i in range(rounds) for k in feasible if i not in by_key[k].rounds_done())
    done, wall0 = 0, land.wall_s
    for i in range(rounds):
        for key in round_order(feasible, land.seed, i):
            point = by_key[key]
            if i in point.rounds_done():
                continue
            if max_runs is not None and done >= max_runs:
                return land
            cand = cands[key]
            plan = screener(cand).plan
            result = runner.run(req.model, cand.config, cand.spec, req.trial_timeout_s, plan)
            m = measurement_json(result, runner.backend, plan, runner.emulated)
            run = {**m, "round": i, "at": round(time.time(), 3), "loadavg": [round(x, 2) for x in os.getloadavg()]}
            by_key[key] = replace(point, runs=(*point.runs, run))
            land = replace(land, points=tuple(by_key[p.key] for p in land.points),
                           wall_s=wall0 + time.monotonic() - t0)
            write_landscape(path, land)
            done += 1
            speeds = (f"tg {m['tg']['avg_ts']:.1f} pp {m['pp']['avg_ts']:.1f} t/s" if m["outcome"] == "ok"
                      else m["outcome"])
            log(f"grid: round {i + 1}/{rounds}, run {done}/{todo}: {_label(point)}: {speeds}")
    return land


def _label(point: Point) -> str:
    if point.baseline:
        return "baseline (llama.cpp --fit)"
    searched = {k: v for k, v in point.params.items() if k not in THREAD_KEYS}
    threads = [f"{'-t' if k == 'threads' else '-tb'} {point.params[k]}" for k in THREAD_KEYS if k in point.params]
    return " ".join([*params_to_flags(searched), *threads])


def landscape_table(land: Landscape, top: int = 10) -> str:
    """The recorded configs by mean decode speed (per-run means' range beside it), which are within noise of the
    best, and the counts."""
    tg, pp = land.summary("tg"), land.summary("pp")
    tied = best_within_noise(land, "tg", include_baseline=True)
    by_key = {p.key: p for p in land.points}
    screened = sum(1 for p in land.points if p.screened is not None)
    runs = sum(len(p.runs) for p in land.points)
    failed = sum(1 for p in land.points for r in p.runs if r["outcome"] != "ok")
    lines = [f"{len(land.points)} configs ({screened} screened out by the estimator, baseline "
             f"{'included' if land.baseline else 'absent'}), {runs} runs ({failed} not ok) in {land.rounds} rounds, "
             f"{land.wall_s:.0f} s", "",
             f"{'tg t/s':>8} {'(runs)':>15} {'pp t/s':>8} {'(runs)':>15}  ~best  config"]
    for key in sorted(tg, key=lambda k: -tg[k][0])[:top]:
        t_mean, t_runs = tg[key]
        p_mean, p_runs = pp.get(key, (0.0, [0.0]))
        lines.append(f"{t_mean:8.1f} {min(t_runs):7.1f}-{max(t_runs):<7.1f} {p_mean:8.1f} "
                     f"{min(p_runs):7.1f}-{max(p_runs):<7.1f}  {'yes' if key in tied else '':>5}  "
                     f"{_label(by_key[key])}")
    lines.append(f"\n{len(tied)} of {len(tg)} measured configs are within noise of the best decode (the 95 % t "
                 "interval of the rounds' paired log ratios contains 1, as tune's ties; "
                 "fitter.grid.landscape.best_within_noise)")
    return "\n".join(lines)
