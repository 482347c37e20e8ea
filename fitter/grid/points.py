"""The exhaustive grid of a search space on a simulated machine: every config, whether the estimator lets it run, and
its noise-free speeds. The reference the tuner is held to (tests/tune/test_tuning_regression.py) and the denominator of
benchmarks/search_efficiency.py.

Screening goes through the tuner's own `Screener`, so a grid and the tuners run after it share one cache of memory
plans: threads never change memory, and a config the grid estimated is not estimated again.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fitter.flags import parse_launch_flags
from fitter.measure.types import BenchSpec
from fitter.memory.fit.budgets import device_budgets
from fitter.memory.fit.fit_devices import expert_layers
from fitter.memory.plan.tensor_split import tensor_mode_runs
from fitter.search.plan import Screener
from fitter.search.request import TuneRequest, _choices, candidate
from fitter.search.screen import Budgets
from fitter.search.space import default_space_name, for_target, resolve, shipped_space
from fitter.sim import SimRunner, out_of_memory, speeds
from fitter.tune.targets import HOST_RESERVE
from fitter.units import GIB


@dataclass(frozen=True)
class GridPoint:
    params: dict[str, Any]
    feasible: bool
    pp: float | None  # noise-free t/s; None when not feasible
    tg: float | None
    device_bytes: int | None


def space_points(req: TuneRequest) -> Iterator[dict[str, Any]]:
    keys = list(req.distributions)
    for values in itertools.product(*(_choices(req.distributions[k]) for k in keys)):
        yield dict(zip(keys, values, strict=True))


def true_speeds(req: TuneRequest, machine: Any, screener: Screener, params: dict[str, Any]) -> GridPoint:
    """What the simulated machine would measure for `params` without noise (fitter.sim.physics.speeds)."""
    cand = candidate(req, params)
    s = screener(cand)
    if not s.feasible or s.plan is None or out_of_memory(machine, s.plan) is not None:
        return GridPoint(params, False, None, None, None)
    pp, tg = speeds(machine, s.plan, cand.spec)
    device = sum(t.total for name, t in s.plan.totals().items() if name != "CPU")
    return GridPoint(params, True, pp, tg, device)


def grid(req: TuneRequest, machine: Any, screener: Screener | None = None, processes: int = 1) -> list[GridPoint]:
    """Every config of the space. With `processes` > 1 the points are split between worker processes (each with
    its own cache), for the regression tests' 2-core CI."""
    points = list(space_points(req))
    if processes <= 1:
        screener = screener or Screener(req)
        return [true_speeds(req, machine, screener, p) for p in points]
    import multiprocessing

    # threads never change memory: keep a placement's thread variants in one worker so its cache answers them
    groups: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        groups.setdefault(repr({k: v for k, v in p.items() if k not in ("threads", "threads-batch")}), []).append(p)
    chunks: list[list[dict[str, Any]]] = [[] for _ in range(processes)]
    for i, group in enumerate(groups.values()):
        chunks[i % processes].extend(group)
    # spawn, not fork: a forked child inherits the locks of the parent's other threads (heartbeats, NVML sampling,
    # logging) in whatever state they were held, and can hang on one; a spawned child starts clean
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.starmap(_grid_part, [(req, machine, chunk) for chunk in chunks])
    by_key = {repr(p.params): p for part in parts for p in part}
    return [by_key[repr(p)] for p in points]


def _grid_part(req: TuneRequest, machine: Any, points: list[dict[str, Any]]) -> list[GridPoint]:
    screener = Screener(req)
    return [true_speeds(req, machine, screener, p) for p in points]


def best(points: list[GridPoint], objective: str = "tg") -> GridPoint:
    feasible = [p for p in points if p.feasible]
    if not feasible:
        raise ValueError("no feasible config in the grid")
    return max(feasible, key=lambda p: p.tg if objective == "tg" else p.pp)  # type: ignore[arg-type,return-value]


def sim_request(machine: Any, spec: Any, model: str, fixed_flags: tuple[str, ...] = ("-fa", "on"),
                n_trials: int = 12, seed: int = 0, objectives: tuple[str, ...] = ("tg", "pp", "vram"),
                fit_target_mib: int = 1024, bench: Any = None) -> TuneRequest:
    """What `fitter tune MODEL --backend sim --machine M` asks for: the shipped space for the model and machine,
    budgets from the machine's free GPU memory and RAM."""
    runner = SimRunner(machine, spec, seed=seed)
    devices = runner.devices()
    space = shipped_space(default_space_name(spec.n_expert, bool(devices)))
    cores = machine.cpu.p_cores + machine.cpu.e_cores
    dists = resolve(space, n_layer=spec.n_layer, physical_cores=cores, performance_cores=machine.cpu.p_cores,
                    expert_layers=expert_layers(spec))
    base = parse_launch_flags(fixed_flags)
    dists = for_target(dists, has_gpu=bool(devices), pinned_host=any(d.profile.host_buft for d in devices),
                       tensor_split=tensor_mode_runs(spec, base, len(devices)))
    budgets = {name: b or 0 for name, b in device_budgets(devices, (fit_target_mib,)).items()}
    host = int(machine.ram.gib * GIB) - HOST_RESERVE
    objectives = objectives if devices else tuple(o for o in objectives if o != "vram")
    return TuneRequest(model=model, spec=spec, base=base, distributions=dists,
                       devices=devices, budgets=Budgets(budgets, host, {}), cpu=runner.cpu_profile(),
                       objectives=objectives, bench=bench or BenchSpec(threads=machine.cpu.p_cores),
                       n_trials=n_trials, seed=seed)
