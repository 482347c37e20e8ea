#!/usr/bin/env python
"""How fast each search finds a config within 98 % of the best decode, on every shipped simulated machine.

    python benchmarks/search_efficiency.py [--seeds 3] [--cap 60] [--machines seeds,gpu-8gb]

For each machine (with the first model shape it is meant for) the exhaustive grid of the shipped search space gives
the optimum (noise-free decode t/s, fitter/tune/grid.py). Then each search runs on the noisy simulated machine until
one of its launched configs is truly within 98 % of that optimum, or `--cap` launches:

- fitter: `fitter tune`'s study (estimator screening, structured start, neighbours, constrained TPE);
- random: configs drawn uniformly from the space, each launched;
- grid: the space in its natural order, each launched;
- TPE, NSGA-II: Optuna's samplers on decode alone, without the estimator; a failed launch is a FAIL trial;
- optimus-style: TPE where a failed launch scores 0 t/s (how llama-optimus treats failures).

Columns: launches to reach 98 % (median over seeds; ">cap" when a seed never got there), launches the machine
refused (out of memory: what screening would have avoided), and model loads (a placement change reloads the model).
Figures, not a test: the bounds are held by tests/tune/test_tuning_regression.py.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optuna

from fitter.flags import LaunchConfig
from fitter.gguf.model_spec import load_model_spec
from fitter.sim import SimRunner, load_machine, shipped_machines
from fitter.tune.grid import GridPoint, best, space_points, true_speeds
from fitter.tune.grid import sim_request as make_request
from fitter.tune.plan import Screener
from fitter.tune.request import OBJECTIVES, TuneRequest, candidate
from fitter.tune.study import Tuner
from tests.models import model_file

BOUND = 0.98


class CachedSimRunner(SimRunner):
    """A SimRunner whose memory plans come from a cache shared by every search on the machine (plans do not depend
    on the seed), so the benchmark measures searches, not the estimator."""

    def __init__(self, machine: Any, spec: Any, seed: int, plans: dict[LaunchConfig, Any]) -> None:
        super().__init__(machine, spec, seed=seed)
        self._plans = plans

    def plan(self, config: LaunchConfig) -> Any:
        if config not in self._plans:
            self._plans[config] = super().plan(config)
        return self._plans[config]


class Outcome:
    def __init__(self) -> None:
        self.launches = 0
        self.refused = 0
        self.reached_at: int | None = None
        self.loads = 0


def _key(params: dict[str, Any]) -> str:
    return repr(sorted(params.items()))


def _launch(req: TuneRequest, runner: SimRunner, params: dict[str, Any], points: dict[str, GridPoint],
            target: float, out: Outcome) -> float | None:
    """Launch one config the way a search without an estimator would: the measured decode, or None on failure."""
    cand = candidate(req, params)
    out.launches += 1
    if cand.error is not None:
        out.refused += 1
        return None
    m = runner.run(req.model, cand.config, cand.spec, None).measurement
    if m.outcome != "ok" or m.tg is None:
        out.refused += 1
        return None
    truth = points[_key(params)]
    if out.reached_at is None and truth.tg is not None and truth.tg >= target:
        out.reached_at = out.launches
    return float(m.tg.avg_ts)


def run_fitter(req: TuneRequest, runner: SimRunner, points: dict[str, GridPoint], target: float, cap: int,
               cache: dict[str, Any]) -> Outcome:
    req = TuneRequest(**{**req.__dict__, "n_trials": cap})
    sampler = optuna.samplers.TPESampler(seed=req.seed, multivariate=True, constant_liar=True)
    study = optuna.create_study(directions=[OBJECTIVES[o] for o in req.objectives], sampler=sampler)
    out = Outcome()

    class Counting:
        backend, emulated = runner.backend, runner.emulated

        def build(self) -> dict[str, str]:
            return runner.build()

        def run(self, model: str, config: Any, spec: Any, timeout: Any, plan: Any = None) -> Any:
            result = runner.run(model, config, spec, timeout, plan)
            out.launches += 1
            if result.measurement.outcome != "ok":
                out.refused += 1
            return result

    tuner = Tuner(req, study, Counting())
    tuner.screener._cache = cache

    def stop_when_reached(event: str, progress: Any, s: optuna.Study) -> None:
        if event != "end" or out.reached_at is not None:
            return
        last = [t for t in s.get_trials(deepcopy=False) if t.user_attrs.get("launched")][-1]
        truth = points.get(_key(dict(last.params))) if last.params else None
        if truth is not None and truth.tg is not None and truth.tg >= target:
            out.reached_at = out.launches
            tuner.req = TuneRequest(**{**tuner.req.__dict__, "n_trials": 0})  # done: no more launches

    tuner.on_event = stop_when_reached
    tuner.run()
    return out


def run_list(req: TuneRequest, runner: SimRunner, order: list[dict[str, Any]], points: dict[str, GridPoint],
             target: float, cap: int) -> Outcome:
    out = Outcome()
    for params in order[:cap]:
        _launch(req, runner, params, points, target, out)
        if out.reached_at is not None:
            break
    return out


def run_sampler(req: TuneRequest, runner: SimRunner, sampler: optuna.samplers.BaseSampler,
                points: dict[str, GridPoint], target: float, cap: int, failures_as_zero: bool) -> Outcome:
    study = optuna.create_study(direction="maximize", sampler=sampler)
    out = Outcome()
    while out.launches < cap and out.reached_at is None:
        trial = study.ask(req.distributions)
        tg = _launch(req, runner, dict(trial.params), points, target, out)
        if tg is not None:
            study.tell(trial, tg)
        elif failures_as_zero:
            study.tell(trial, 0.0)
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--cap", type=int, default=60)
    parser.add_argument("--machines", default=",".join(shipped_machines()))
    ns = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.simplefilter("ignore")
    names = ["fitter", "random", "grid", "TPE", "NSGA-II", "optimus-style"]
    print(f"launches to reach {BOUND:.0%} of the grid's best decode (median of {ns.seeds} seeds; cap {ns.cap}), "
          "refused launches (OOM), model loads\n")
    print(f"{'':32}" + " ".join(f"{n:>12}" for n in names))
    print(f"{'machine':10} {'model':14} {'grid':>6} " + " ".join(f"{'n oom lds':>12}" for _ in names))
    for name in ns.machines.split(","):
        t0 = time.perf_counter()
        machine = load_machine(name)
        shape = machine.models[0]
        path = str(model_file(shape, sparse=True))
        spec = load_model_spec(path)
        base_req = make_request(machine, spec, path)
        screener = Screener(base_req)
        all_points = [true_speeds(base_req, machine, screener, p) for p in space_points(base_req)]
        points = {_key(p.params): p for p in all_points}
        target = BOUND * (best(all_points).tg or 0.0)
        plans: dict[LaunchConfig, Any] = {}
        results: dict[str, list[Outcome]] = {n: [] for n in names}
        for seed in range(ns.seeds):
            req = make_request(machine, spec, path, seed=seed)

            order = [p.params for p in all_points]
            shuffled = list(order)
            random.Random(seed).shuffle(shuffled)
            for n in names:
                r = CachedSimRunner(machine, spec, seed, plans)
                if n == "fitter":
                    o = run_fitter(req, r, points, target, ns.cap, screener._cache)
                elif n in ("random", "grid"):
                    o = run_list(req, r, shuffled if n == "random" else order, points, target, ns.cap)
                else:
                    sampler = optuna.samplers.NSGAIISampler(seed=seed) if n == "NSGA-II" else \
                        optuna.samplers.TPESampler(seed=seed)
                    o = run_sampler(req, r, sampler, points, target, ns.cap, failures_as_zero=n == "optimus-style")
                o.loads = r.model_loads
                results[n].append(o)
        cells = []
        for n in names:
            outs = results[n]
            reached = [o.reached_at if o.reached_at is not None else ns.cap + 1 for o in outs]
            med = statistics.median(reached)
            shown = f">{ns.cap}" if med > ns.cap else f"{med:g}"
            refused = statistics.median(o.refused for o in outs)
            loads = statistics.median(o.loads for o in outs)
            cells.append(f"{shown:>4} {refused:>3g} {loads:>3g}")
        print(f"{name:10} {shape:14} {len(all_points):>6} " + " ".join(f"{c:>12}" for c in cells)
              + f"   ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
