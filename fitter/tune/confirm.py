"""After the search: every Pareto-optimal trial and the baseline are measured again (confirm runs, twice the
repetitions), the front of the confirm runs is kept, and the result document is built from them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from fitter.flags import pin
from fitter.measure.runner import TrialRunner
from fitter.measure.types import BenchSpec, TrialResult
from fitter.memory.estimator import MemoryPlan
from fitter.tune.baseline import Baseline
from fitter.tune.plan import Screener
from fitter.tune.request import Candidate, TuneRequest, candidate
from fitter.tune.result import Entry, ParetoDoc, picks, ratios, vram_bytes
from fitter.tune.study import Tuner, measurement_json


def pinned_flags(cand: Candidate, plan: MemoryPlan | None) -> list[str]:
    """The flags a launcher passes: everything llama-server would decide itself pinned (fitter.flags.pin)."""
    return pin(cand.config, plan.context if plan is not None else None, cand.process)


def confirm_spec(spec: BenchSpec) -> BenchSpec:
    """Confirm runs take twice the repetitions (at least 5): they decide the picks and the ratios, and a trial's
    spread on a busy or emulated machine is 10-20 % per sample."""
    return replace(spec, repetitions=max(5, 2 * spec.repetitions))


def _confirm(req: TuneRequest, screener: Screener, runner: TrialRunner,
             cand: Candidate) -> tuple[TrialResult, dict[str, Any], MemoryPlan | None]:
    """One confirm run: its result, its bench JSON and the config's memory plan (from the search's cache)."""
    plan = screener(cand).plan
    result = runner.run(req.model, cand.config, confirm_spec(cand.spec), req.trial_timeout_s, plan)
    return result, measurement_json(result, runner.backend, plan, runner.emulated), plan


def confirm_pareto(req: TuneRequest, tuner: Tuner, runner: TrialRunner,
                   log: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Re-measure every Pareto-optimal trial; a pick that fails its confirm run is dropped and reported."""
    entries, dropped = [], []
    seen: set[str] = set()
    for t in sorted(tuner.study.best_trials, key=lambda t: t.number):
        if t.user_attrs.get("phase") == "baseline":
            continue  # confirmed by confirm_baseline, which every tune runs
        key = t.user_attrs.get("key", "")
        if key in seen:  # a trial answered from storage repeats an earlier one
            continue
        seen.add(key)
        flags = list(t.user_attrs["flags"])
        cand = candidate(req, dict(t.params))
        log(f"fitter: confirm run of trial {t.number}: {' '.join(flags)}")
        result, m, plan = _confirm(req, tuner.screener, runner, cand)
        if result.measurement.outcome != "ok":
            dropped.append({"trial": t.number, "flags": flags, "outcome": result.measurement.outcome,
                            "reason": result.measurement.reason})
            continue
        entries.append({"trial": t.number, "phase": t.user_attrs.get("phase"), "flags": pinned_flags(cand, plan),
                        "measurement": m, "vram_bytes": vram_bytes(m), "study_values": list(t.values)})
    return entries, dropped


def confirm_baseline(req: TuneRequest, screener: Screener, runner: TrialRunner, baseline: Baseline,
                     log: Callable[[str], None]) -> Baseline:
    """Re-measure the baseline beside the confirm runs, so every ratio compares runs made under the same conditions
    (the baseline's trial ran first, on a cold machine). Its trial measurement stays in the study."""
    data, cand = baseline.data, baseline.candidate
    if cand is None or (data.get("measurement") or {}).get("outcome") != "ok":
        return baseline
    log(f"fitter: confirm run of the baseline: {' '.join(data['flags'])}")
    _, m, _ = _confirm(req, screener, runner, cand)
    return replace(baseline, data={**data, "trial_measurement": data["measurement"], "measurement": m})


def final_front(req: TuneRequest, screener: Screener, entries: list[dict[str, Any]], dropped: list[dict[str, Any]],
                baseline: Baseline) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The Pareto front of the confirm runs: the study's front was chosen from single noisy trials, so what its
    confirm runs show dominated is dropped (and reported). llama.cpp's own choice competes too: when its confirm run
    is not dominated, it is on the front and may be a pick."""
    pool = list(entries)
    bm = baseline.data.get("measurement") or {}
    if bm.get("outcome") == "ok" and baseline.candidate is not None and "trial" in baseline.data:
        cand = baseline.candidate
        pool.append({"trial": baseline.data["trial"], "phase": "baseline",
                     "flags": pinned_flags(cand, screener(cand).plan), "measurement": bm, "vram_bytes": vram_bytes(bm)})

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


def result_doc(req: TuneRequest, machine: dict[str, Any], build: dict[str, str], targets: tuple[int, ...],
               emulated: bool, baseline: Baseline, entries: list[dict[str, Any]], dropped: list[dict[str, Any]],
               tuner: Tuner, wall_s: float, url: str, source: str) -> ParetoDoc:
    """pareto.json of a finished tune (CONTRACTS.md), read back as the one result model."""
    base_m = baseline.data.get("measurement")
    for e in entries:
        e["ratios"] = ratios(e["measurement"], base_m)
    trials = tuner.study.get_trials(deepcopy=False)
    spec, model = req.spec, req.model
    data = {
        "for": req.base.consumer,
        "model": {"path": str(Path(model).resolve()), "name": Path(model).stem, "arch": spec.arch,
                  "identity": spec.identity, "n_params": spec.n_params, "tensor_bytes": spec.tensor_bytes},
        "machine": machine, "llama_cpp": build, "objectives": list(req.objectives),
        "fit_target_mib": list(targets), "emulated": emulated,
        # what the screen allowed each device (free memory less the fit target) and the host: an export for
        # another program is re-planned against these
        "budgets": {"devices": dict(req.budgets.devices), "host": req.budgets.host},
        "baseline": baseline.data, "pareto": entries, "dropped": dropped,
        "picks": picks([Entry.from_json(e, source) for e in entries]),
        "study": {"storage": url, "trials": len(trials),
                  "launched": sum(1 for t in trials if t.user_attrs.get("launched")),
                  "screened_out": sum(1 for t in trials if t.state == TrialState.PRUNED
                                      and not t.user_attrs.get("launched")),
                  "answered_from_storage": sum(1 for t in trials if "same_as" in t.user_attrs),
                  "model_loads_this_run": tuner.progress.model_loads, "wall_s": round(wall_s, 1),
                  "margins": tuner.study.user_attrs.get("margins", {})},
    }
    return ParetoDoc.from_json(data, source)
