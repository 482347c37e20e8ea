"""Regression of the tuning logic on simulated machines (fitter/sim/): for every shipped profile with the model
shape it is meant for, over 5 seeds, the tuner's median pick reaches ≥ 98 % of the exhaustive grid's best decode
within ≤ 12 launched trials, launches nothing the estimator predicted infeasible, and its pick fits; on the profiles
where fitter's prior is wrong, its median prefill pick reaches ≥ 98 % of the grid's best prefill too.

The grid is computed here, over the same space and budgets, with noise-free speeds; the tuner sees the machine's
noisy measurements, as it would on real hardware. The grid keeps llama-server's load mode: in the simulated machine
pinned host memory speeds only op offload's copies of a prompt's batches (fitter.sim.physics), never decode, so the
decode optimum is one of its points; a pick with another load mode is priced on its own."""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from fitter.gguf.model_spec import load_model_spec
from fitter.grid.points import GridPoint, best, grid, sim_request, true_speeds
from fitter.search.plan import Screener
from fitter.search.request import OBJECTIVES, candidate
from fitter.search.screen import device_totals
from fitter.sim import SimRunner, load_machine, out_of_memory, shipped_machines
from fitter.tune.study import Tuner
from tests.models import model_file

# the tuning regression over every shipped profile: ~8 min on 2 cores:
# deselected by the default test command, run by .ci/run (pytest -m slow)
# the grid of seeds' 120b space (kv-offload searched) takes 120 s on 2 quiet cores, past the suite's 300 s on a busy
# machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SEEDS = range(5)
MAX_LAUNCHED = 12
BOUND = 0.98

# The profiles where fitter's prior is wrong (issue 14, 4b) are held to their prefill optimum too: there the first
# structured trial misses it (arm-slowfa: -fa on, 0.63 of the best pp; laptop-2p8e: -t 2, 0.34), and the tuner must
# still find it. Measured over the 5 seeds: every pick at ≥ 0.996 of the grid's best pp and ≥ 0.9997 of its best tg.
PP_BOUND = {"arm-slowfa": 0.98, "laptop-2p8e": 0.98}
# Left out of CI: egpu-12gb's decode prior is right (its first structured trial is the decode optimum; only its
# prefill prior is wrong, as on every GPU profile at -p 512), and its 1000-point grid alone takes ~2.5 min on 2
# busy cores. Measured: the tuner's pick is the grid's best tg and best pp on all 5 seeds. Run it with -m slow -k egpu
# after removing it here, or in benchmarks/search_efficiency.py.
NOT_IN_CI = {"egpu-12gb"}
# The profiles of published machines (tests/golden/published.json) hold the sim to hardware, not the tuner: their
# check is tests/sim/test_published.py (and their gpt-oss-120b grids would add minutes here).
NOT_IN_CI |= {"rtx3090-epyc7343", "rtx3090-cpu-unstated", "rtx2080-i9-10900x"}

# Machines with two or more GPUs search a per-device placement (fitter.search.split) that no grid of one -ncmoe covers:
# their regression is tests/tune/test_multi_gpu_regression.py.
CASES = [(name, load_machine(name).models[0]) for name in shipped_machines()
         if name not in NOT_IN_CI and len(load_machine(name).gpus) < 2]


def _key(params: dict[str, Any]) -> str:
    return repr(sorted(params.items()))


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{s}" for m, s in CASES])
def case(request: pytest.FixtureRequest) -> dict[str, Any]:
    machine_name, shape = request.param
    machine = load_machine(machine_name)
    path = str(model_file(shape, sparse=True))
    spec = load_model_spec(path)
    req = sim_request(machine, spec, path)
    at_default = {"load-mode": CategoricalDistribution(["auto"])} if "load-mode" in req.distributions else {}
    points = grid(replace(req, distributions={**req.distributions, **at_default}), machine, processes=2)
    return {"machine": machine, "spec": spec, "path": path, "points": {_key(p.params): p for p in points},
            "best": best(points), "screener_cache": {}, "req": req}


def _truth(case: dict[str, Any], params: dict[str, Any]) -> GridPoint:
    """The grid's point for `params`, or (another load mode) its noise-free speeds computed alone."""
    found = case["points"].get(_key(params))
    return found if found is not None else true_speeds(case["req"], case["machine"], Screener(case["req"]), params)


def _tune(case: dict[str, Any], seed: int) -> tuple[optuna.Study, Tuner]:
    machine, spec = case["machine"], case["spec"]
    req = sim_request(machine, spec, case["path"], seed=seed)
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)
    study = optuna.create_study(directions=[OBJECTIVES[o] for o in req.objectives], sampler=sampler)
    tuner = Tuner(req, study, SimRunner(machine, spec, seed=seed))
    tuner.screener._cache = case["screener_cache"]  # the same estimates for every seed: computed once
    tuner.run()
    return study, tuner


def test_the_tuner_reaches_98_percent_of_the_grid_optimum_within_12_launches(case: dict[str, Any]) -> None:
    optimum: GridPoint = case["best"]
    ratios, pp_ratios = [], []
    pp_optimum = best(list(case["points"].values()), "pp")
    for seed in SEEDS:
        study, tuner = _tune(case, seed)
        launched = [t for t in study.trials if t.user_attrs.get("launched")]
        assert len(launched) <= MAX_LAUNCHED
        for t in launched:  # nothing the estimator predicted over budget was launched
            assert all(v <= 0 for v in t.constraints.values()) or t.state == TrialState.FAIL, t.user_attrs["flags"]
        picked = tuner.best("tg")
        assert picked is not None
        truth = _truth(case, dict(picked.params))
        assert truth.feasible
        ratios.append(truth.tg / optimum.tg)
        pp_pick = tuner.best("pp")
        assert pp_pick is not None
        pp_truth = _truth(case, dict(pp_pick.params))
        pp_ratios.append(pp_truth.pp / pp_optimum.pp if pp_truth.feasible else 0.0)
        # the pick fits: the estimator puts it within every budget and the machine runs it
        cand = candidate(tuner.req, dict(picked.params))
        plan = Screener(tuner.req)(cand).plan
        assert plan is not None and out_of_memory(case["machine"], plan) is None
        totals = device_totals(plan)
        assert all(totals[d] <= b for d, b in tuner.req.budgets.devices.items())
    print(f"\n{case['machine'].name} × {case['spec'].path}: grid best tg {optimum.tg:.2f} t/s at {optimum.params}; "
          f"tuner/optimum per seed {[round(r, 4) for r in ratios]}; pp {[round(r, 4) for r in pp_ratios]}")
    assert statistics.median(ratios) >= BOUND
    name = case["machine"].name
    if name in PP_BOUND:
        assert statistics.median(pp_ratios) >= PP_BOUND[name]
