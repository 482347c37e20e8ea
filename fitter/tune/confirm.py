"""After the search: the front's trials and the baseline are measured again in interleaved rounds (confirm runs), the
front of the confirm runs is kept, and the result document is built from them.

Interleaved: each round runs every contender once, in a fresh shuffled order (seeded), so slow drift (a job that
starts beside the tune, a throttling CPU) hits every config alike, and each ratio over the baseline is taken
within rounds (fitter.noise: a t interval over the rounds' paired log ratios). A contender whose run fails in
any round is dropped and reported. The baseline is also the drift monitor: measured at the start of the study (its
trial), in the middle (fitter.tune.study.Tuner.drift_probe) and at the end (these rounds); a study whose baseline
moved more than its configs differ says so.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from fitter.flags import pin, resolve_context
from fitter.measure.runners import TrialRunner
from fitter.measure.types import Latency, samples_json
from fitter.memory.plan.estimator import MemoryPlan
from fitter.noise import SPEEDS, better_beyond_noise, ratio_interval, relative_spread, tied
from fitter.results.measurement import measurement_json, round_avgs, vram_bytes
from fitter.results.pareto import Entry, ParetoDoc, picks, ratios
from fitter.results.quality_record import QUALITY, quality_beyond_noise
from fitter.search.request import Candidate, TuneRequest, _default_distance, candidate
from fitter.tune.baseline import Baseline
from fitter.tune.options import DEFAULT_ROUNDS
from fitter.tune.quality_objective import kv_bytes
from fitter.tune.study import Tuner


def pinned_flags(cand: Candidate, plan: MemoryPlan | None) -> list[str]:
    """The flags a launcher passes: everything llama-server would decide itself pinned (fitter.flags.pin)."""
    return pin(cand.config, plan.context if plan is not None else None, cand.process)


@dataclass
class Contender:
    """One config of the confirm rounds: a trial of the study's front, or the baseline."""

    trial: int
    phase: str
    cand: Candidate
    plan: MemoryPlan | None
    study_values: list[float] | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)  # bench JSON of each round, in round order
    positions: list[int] = field(default_factory=list)  # where it ran in each round's order
    failed: dict[str, Any] | None = None

    def per_round(self, key: str) -> list[float]:
        return [float(m[key]["avg_ts"]) for m in self.runs if isinstance(m.get(key), dict)]


def contenders(req: TuneRequest, tuner: Tuner, baseline: Baseline) -> list[Contender]:
    """The study's Pareto-optimal trials (one per config) and the baseline when it ran ok."""
    out: list[Contender] = []
    seen: set[str] = set()
    bm = baseline.data.get("measurement") or {}
    if baseline.candidate is not None and bm.get("outcome") == "ok" and "trial" in baseline.data:
        cand = baseline.candidate
        out.append(Contender(baseline.data["trial"], "baseline", cand, tuner.screener(cand).plan))
        seen.add(cand.key)
    for t in sorted(tuner.study.best_trials, key=lambda t: t.number):
        key = t.user_attrs.get("key", "")
        if t.user_attrs.get("phase") == "baseline" or key in seen:
            continue  # the baseline is in already; a trial answered from storage repeats an earlier one
        seen.add(key)
        cand = candidate(req, dict(t.params))
        out.append(Contender(t.number, str(t.user_attrs.get("phase")), cand, tuner.screener(cand).plan,
                             list(t.values)))
    return out


def run_rounds(req: TuneRequest, runner: TrialRunner, pool: list[Contender], rounds: int,
               log: Callable[[str], None], stopped: Callable[[], bool] = lambda: False) -> None:
    """`rounds` interleaved rounds over `pool`, each in a fresh seeded order; a failed run drops its contender.
    `stopped()` (a Ctrl-C) ends them before the next run."""
    for k in range(rounds):
        alive = [c for c in pool if c.failed is None]
        order = list(alive)
        random.Random(f"{req.seed}|confirm|{k}").shuffle(order)
        log(f"fitter: confirm round {k + 1}/{rounds}: trials " + " ".join(
            "base" if c.phase == "baseline" else str(c.trial) for c in order))
        for position, c in enumerate(order):
            if stopped():
                return
            result = runner.run(req.model, c.cand.config, c.cand.spec, req.trial_timeout_s, c.plan)
            m = measurement_json(result, runner.backend, c.plan, runner.emulated)
            if result.measurement.outcome != "ok":
                c.failed = {"trial": c.trial, "flags": list(c.cand.flags), "outcome": result.measurement.outcome,
                            "reason": f"round {k + 1}: {result.measurement.reason}"}
                continue
            m["round"] = k + 1
            c.runs.append(m)
            c.positions.append(position)


def pooled(runs: list[dict[str, Any]], repetitions: int) -> dict[str, Any]:
    """The rounds of one config as one bench JSON: every round's samples, their mean and spread, each device's
    highest peak; `confirm` says how it was taken (rounds × repetitions) and keeps each round's averages."""
    out = dict(runs[-1])
    out.pop("round", None)
    out.update(_pooled_tests(runs))
    if isinstance(out.get("depths"), list):  # a workload's depths, each pooled over the rounds as well
        out["depths"] = [{**d, **_pooled_tests([m["depths"][i] for m in runs if len(m.get("depths") or ()) > i])}
                         for i, d in enumerate(out["depths"])]
    peaks: dict[str, dict[str, Any]] = {}
    for m in runs:
        for name, p in (m.get("peak_vram") or {}).items():
            if name not in peaks or int(p["bytes"]) > int(peaks[name]["bytes"]):
                peaks[name] = dict(p)
    if peaks:
        out["peak_vram"] = peaks
    rounds = {k: [float(m[k]["avg_ts"]) for m in runs if isinstance(m.get(k), dict)] for k in SPEEDS}
    if all(isinstance(m.get("tg_stream"), dict) for m in runs):  # several streams: their per-stream decode
        rounds["tg_stream"] = [float(m["tg_stream"]["avg_ts"]) for m in runs]
    out["confirm"] = {"rounds": len(runs), "repetitions": repetitions, "round_avg_ts": rounds}
    if all(isinstance(m.get("ttft"), dict) for m in runs):  # and time to first token, lower better
        out["confirm"]["round_avg_ms"] = {"ttft": [float(m["ttft"]["avg_ms"]) for m in runs]}
    return out


def _pooled_tests(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run's samples of each test (pp, tg, a workload's per-stream decode and time to first token) as one."""
    out: dict[str, Any] = {}
    for key in (*SPEEDS, "tg_stream"):
        stats = [m[key] for m in runs if isinstance(m.get(key), dict)]
        if stats:
            out[key] = samples_json(stats[0], [float(s) for st in stats for s in st["samples_ts"]])
    lat = [m["ttft"] for m in runs if isinstance(m.get("ttft"), dict)]
    if lat:
        out["ttft"] = Latency.from_ms([float(x) for st in lat for x in st["samples_ms"]]).to_json()
    return out


def _entry(c: Contender, repetitions: int, n_ctx_train: int) -> dict[str, Any]:
    m = pooled(c.runs, repetitions)
    return {"trial": c.trial, "phase": c.phase, "flags": pinned_flags(c.cand, c.plan), "measurement": m,
            "vram_bytes": vram_bytes(m), "n_ctx": resolve_context(c.cand.config, n_ctx_train).n_ctx,
            "study_values": c.study_values,
            "defaults_distance": -1 if c.phase == "baseline" else _default_distance(c.cand.params),
            "positions": c.positions}


def confirm(req: TuneRequest, tuner: Tuner, runner: TrialRunner, baseline: Baseline, log: Callable[[str], None],
            rounds: int = DEFAULT_ROUNDS) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Baseline]:
    """The confirm rounds: the entries that survived them (the baseline among them when it ran), what was dropped,
    and the baseline with its confirmed measurement."""
    pool = contenders(req, tuner, baseline)
    run_rounds(req, runner, pool, rounds, log, tuner.stop.is_set)
    dropped = [c.failed for c in pool if c.failed is not None]
    entries = [_entry(c, req.bench.repetitions, req.spec.n_ctx_train) for c in pool if c.failed is None and c.runs]
    for c, e in zip((c for c in pool if c.failed is None and c.runs), entries, strict=True):
        e["kv_bytes"] = kv_bytes(req.spec, c.cand.config)  # what its KV types save against f16 (the picks say)
        if tuner.quality is not None:  # its KV class's quality, as measured (the baseline's too)
            e[QUALITY] = tuner.quality.of(c.cand.config)
    base = next((e for e in entries if e["phase"] == "baseline"), None)
    if base is not None:
        data = baseline.data
        baseline = replace(baseline, data={**data, "trial_measurement": data["measurement"],
                                           "measurement": base["measurement"]})
    return entries, dropped, baseline


# -- the front of the confirm runs, ratios, intervals and ties (pure) ---------------------------------------------


def _dominates(o: dict[str, Any], e: dict[str, Any], objectives: tuple[str, ...]) -> bool:
    """o is at least as good as e in every objective's estimate and better beyond noise in one (a speed whose
    interval of o/e lies above 1, or less measured VRAM, which is a peak counter, not a noisy rate)."""
    om, em = o["measurement"], e["measurement"]
    ro, re = round_avgs(om), round_avgs(em)
    strictly = False
    for obj in objectives:
        if obj == QUALITY:  # the KV class's KL divergence: lower, and beyond the text's noise to count as better
            if float(o[QUALITY]["kld"]) > float(e[QUALITY]["kld"]):
                return False
            strictly |= quality_beyond_noise(o[QUALITY], e[QUALITY])
            continue
        if obj in ("vram", "ctx"):  # a count, not a noisy rate: less VRAM, a larger context
            mine, theirs = (o["vram_bytes"], e["vram_bytes"]) if obj == "vram" else (-o["n_ctx"], -e["n_ctx"])
            if mine > theirs:
                return False
            strictly |= mine < theirs
            continue
        if obj == "ttft":  # a latency: the less the better, so e's over o's is the rate-like ratio
            a, b = float(em["ttft"]["avg_ms"]), float(om["ttft"]["avg_ms"])
            ra, rb = round_ms(em).get("ttft"), round_ms(om).get("ttft")
        else:
            key = "tg_stream" if obj == "tg-stream" else obj
            a, b, ra, rb = float(om[key]["avg_ts"]), float(em[key]["avg_ts"]), ro.get(key), re.get(key)
        if a < b:
            return False
        if ra and rb and len(ra) == len(rb) > 1:
            strictly |= better_beyond_noise(ra, rb)
        else:  # no rounds to judge noise by: the estimates decide
            strictly |= a > b
    return strictly


def round_ms(measurement: dict[str, Any]) -> dict[str, list[float]]:
    """Per-round averages of a confirmed measurement's latencies (time to first token)."""
    raw = (measurement.get("confirm") or {}).get("round_avg_ms")
    return {k: [float(x) for x in v] for k, v in raw.items()} if isinstance(raw, dict) else {}


def final_front(objectives: tuple[str, ...], entries: list[dict[str, Any]], dropped: list[dict[str, Any]]
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The Pareto front of the confirm runs: the study's front was chosen from single noisy trials, so a config its
    confirm runs show dominated beyond noise is dropped (and reported). llama.cpp's own choice competes too: when it
    is not dominated it is on the front and may be a pick."""
    front, out_dropped = [], list(dropped)
    for e in entries:
        by = next((o for o in entries if o is not e and _dominates(o, e, objectives)), None)
        if by is None:
            front.append(e)
        elif e["phase"] != "baseline":
            out_dropped.append({"trial": e["trial"], "flags": e["flags"], "outcome": "dominated",
                                "reason": f"its confirm runs are dominated by trial {by['trial']}'s"})
    return sorted(front, key=lambda e: e["trial"]), out_dropped


def annotate(objectives: tuple[str, ...], front: list[dict[str, Any]], base_m: dict[str, Any] | None,
             base_trial: int | None = None) -> None:
    """Each entry's ratios over the baseline with their 95 % intervals (paired by round), and its ties: the other
    entries, and the baseline (trial `base_trial`) also when it is off the front, it cannot be told apart from in
    any speed objective."""
    speeds = tuple(k for k in SPEEDS if k in objectives)
    base_rounds = round_avgs(base_m) if base_m and base_m.get("outcome") == "ok" else {}
    for e in front:
        rounds = round_avgs(e["measurement"])
        e["ratios"], e["intervals"] = ratios(e["measurement"], base_m), {}  # without rounds: the averages' ratio
        for k in SPEEDS:
            iv = ratio_interval(rounds[k], base_rounds[k]) if k in rounds and k in base_rounds and len(
                rounds[k]) == len(base_rounds[k]) else None
            if iv is not None:
                e["ratios"][k] = round(iv[0], 3)
                e["intervals"][k] = [round(iv[1], 3), round(iv[2], 3)]
        e["ties"] = [o["trial"] for o in front if o is not e and tied(rounds, round_avgs(o["measurement"]), speeds)]
        if base_trial is not None and base_trial not in (o["trial"] for o in front) and tied(
                rounds, base_rounds, speeds):  # llama.cpp's choice, off the front (less VRAM beat it), is still a tie
            e["ties"].append(base_trial)


def drift_record(start: dict[str, Any] | None, middle: dict[str, Any] | None, end: dict[str, Any] | None,
                 front: list[dict[str, Any]]) -> dict[str, Any]:
    """The baseline measured at the start, middle and end of the study: how far it moved per speed, against how far
    the front's configs differ from it; `exceeds_differences` when the drift is the larger."""
    points = [{"at": at, **{k: float(m[k]["avg_ts"]) for k in SPEEDS if isinstance(m.get(k), dict)},
               **({"launched": m["launched"]} if "launched" in m else {})}
              for at, m in (("start", start), ("middle", middle), ("end", end))
              if isinstance(m, dict) and m.get("outcome", "ok") == "ok"]
    spread = {k: round(relative_spread([p[k] for p in points if k in p]), 4) for k in SPEEDS}
    diffs = {k: round(max((abs(r - 1.0) for e in front if e["phase"] != "baseline"
                           if (r := (e.get("ratios") or {}).get(k)) is not None), default=0.0), 4) for k in SPEEDS}
    exceeds = len(points) > 1 and any(spread[k] > diffs[k] for k in SPEEDS)
    out: dict[str, Any] = {"baseline": points, "spread": spread, "differences": diffs,
                           "exceeds_differences": exceeds}
    if exceeds:
        worst = max(SPEEDS, key=lambda k: spread[k] - diffs[k])
        out["note"] = (f"the baseline's {worst} moved {spread[worst]:.0%} during the study, more than the front's "
                       f"configs differ from it ({diffs[worst]:.0%}): the search compared trials under drift; the "
                       "confirm rounds are interleaved, so their intervals hold, but a quieter machine would choose "
                       "more surely")
    elif len(points) < 2:
        out["note"] = ("no drift monitor: the baseline was measured once" if points else
                       "no drift monitor: there is no baseline")
    return out


def workers(trials: list[Any]) -> list[dict[str, Any]]:
    """The workers that launched the study's trials, each with its trial numbers (the baseline's worker too)."""
    by: dict[str, list[int]] = {}
    for t in trials:
        if t.user_attrs.get("launched"):
            by.setdefault(str(t.user_attrs.get("worker", "unknown")), []).append(t.number)
    return [{"worker": w, "trials": sorted(n)} for w, n in sorted(by.items())]


def result_doc(req: TuneRequest, machine: dict[str, Any], build: dict[str, str], targets: tuple[int, ...],
               emulated: bool, baseline: Baseline, entries: list[dict[str, Any]], dropped: list[dict[str, Any]],
               tuner: Tuner, wall_s: float, url: str, source: str, rounds: int = DEFAULT_ROUNDS) -> ParetoDoc:
    """pareto.json of a finished tune (CONTRACTS.md), read back as the one result model."""
    base_m = baseline.data.get("measurement")
    front, dropped = final_front(req.objectives, entries, dropped)
    annotate(req.objectives, front, base_m, baseline.data.get("trial"))
    base_data = dict(baseline.data)
    if baseline.candidate is not None:
        base_data["n_ctx"] = resolve_context(baseline.candidate.config, req.spec.n_ctx_train).n_ctx
        if tuner.quality is not None:
            base_data[QUALITY] = tuner.quality.of(baseline.candidate.config)
    if base_m and base_m.get("outcome") == "ok":
        base_data["intervals"] = {k: [1.0, 1.0] for k in SPEEDS if k in base_m}
        # ties are symmetric, and annotate names the baseline among each entry's ties, on the front or off it
        base_data["ties"] = [e["trial"] for e in front
                             if e["phase"] != "baseline" and base_data.get("trial") in e["ties"]]
    drift = drift_record(baseline.data.get("trial_measurement"), tuner.study.user_attrs.get("drift_middle"),
                         base_m, front)
    trials = tuner.study.get_trials(deepcopy=False)
    spec, model = req.spec, req.model
    data = {
        "for": req.base.consumer,
        "workload": req.workload.to_json(),
        "model": {"path": str(Path(model).resolve()), "name": Path(model).stem, "arch": spec.arch,
                  "identity": spec.identity, "n_params": spec.n_params, "tensor_bytes": spec.tensor_bytes},
        "machine": machine, "llama_cpp": build, "objectives": list(req.objectives),
        "fit_target_mib": list(targets), "emulated": emulated,
        # what the screen allowed each device (free memory less the fit target) and the host: an export for
        # another program is re-planned against these
        "budgets": {"devices": dict(req.budgets.devices), "host": req.budgets.host},
        "baseline": base_data, "pareto": front, "dropped": dropped,
        "picks": picks([Entry.from_json(e, source) for e in front]),
        "confirm": {"rounds": rounds, "repetitions": req.bench.repetitions, "interleaved": True,
                    "interval": "95 % Student t over the rounds' paired log ratios"},
        "drift": drift,
        **({QUALITY: tuner.quality.section()} if tuner.quality is not None else {}),
        "study": {"storage": url, "trials": len(trials),
                  "launched": sum(1 for t in trials if t.user_attrs.get("launched")),
                  "screened_out": sum(1 for t in trials if t.state == TrialState.PRUNED
                                      and not t.user_attrs.get("launched")),
                  "answered_from_storage": sum(1 for t in trials if "same_as" in t.user_attrs),
                  "pooled": sum(1 for t in trials if t.user_attrs.get("pooled")),
                  "model_loads_this_run": tuner.progress.model_loads, "wall_s": round(wall_s, 1),
                  "margins": tuner.study.user_attrs.get("margins", {}),
                  # every worker that measured (host:pid; one for a tune on one machine), and who ran what once
                  "workers": workers(trials), "confirmed_by": tuner.worker.name,
                  "drift_middle_by": (tuner.study.user_attrs.get("drift_middle") or {}).get("worker")},
    }
    return ParetoDoc.from_json(data, source)
