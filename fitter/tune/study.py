"""`fitter tune`: a constrained multi-objective Optuna study over real trials.

Objectives: decode t/s (`tg`, maximize), prefill t/s (`pp`, maximize), peak VRAM (`vram`, MiB, minimize).
Constraints, not penalties (`trial.set_constraint`, feasible when ≤ 0): MiB over each device's budget (free memory
minus `--fit-target`) and over available host RAM. How each sampled configuration ends:

- the estimator predicts it over budget, or llama.cpp would refuse it → PRUNED with its violations; nothing launched;
- it was measured before (this run or an earlier one on the same storage) → answered from storage, not re-run;
- measured `ok` → COMPLETE with its values;
- measured `oom` → PRUNED with the measured violation, and that device's margin becomes
  max(measured − predicted) for the rest of the study (kept in the study's attributes, so a resumed study keeps it);
- `crash` / `timeout` → FAIL with the reason in the trial's attributes (samplers ignore FAIL trials).

The search uses the structure a person would. For a choice of batch sizes, KV types and flash attention (a "combo"),
the fastest placement for decode is the one with the fewest weight bytes read from RAM per token, i.e. the smallest
`-ncmoe` (largest `-ngl` for a dense model) the estimator says fits. So the study first measures llama.cpp's own
choice (`--fit`, the baseline), then the combo with the fewest CPU bytes per token at its smallest fitting `-ncmoe`
(decode first), the largest `-ub` that fits at its own placement (prefill first) and the lightest placement
(least VRAM); then it walks one-parameter neighbours of the best decode and best prefill trials, each placed at its
own smallest fitting `-ncmoe`; what budget is left goes to Optuna's multi-objective TPE sampler over the whole space.
Neighbours that keep the placement (threads, a KV or batch change that fits at the same `-ncmoe`) read the same
bytes per token, so they sort next to each other and the worker keeps the model loaded between them.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from fitter.errors import FitterError
from fitter.flags import resolve_context
from fitter.measure.runners import TrialRunner
from fitter.measure.types import TrialResult
from fitter.memory.backends.devices import Device
from fitter.results.measurement import measurement_json, vram_bytes
from fitter.results.quality_record import QUALITY
from fitter.search.plan import Screener, neighbours, structured_start
from fitter.search.pooling import SamplePool
from fitter.search.request import STREAM_OBJECTIVES, Candidate, TuneRequest, _choices, candidate
from fitter.search.screen import Screen, device_totals
from fitter.storage.fleet import (
    Claim,
    Claims,
    MemoryClaims,
    Worker,
    fail_trial,
    heartbeat,
    launch_slot,
    measured,
    wait_for_others,
)
from fitter.storage.optuna_api import frozen, record_heartbeat, set_params, study_storage, trial_id
from fitter.tune.objectives import objective_value
from fitter.tune.quality_objective import QualityBook
from fitter.units import MIB


@dataclass
class TuneProgress:
    launched: int = 0
    pruned: int = 0
    answered: int = 0
    failed: int = 0
    asked: int = 0
    model_loads: int = 0
    elsewhere: int = 0  # planned configs another worker of the fleet had claimed (fitter.storage.fleet)
    started: float = field(default_factory=time.monotonic)


# -- the study --------------------------------------------------------------------------------------------------

StudyCallback = Callable[[str, TuneProgress, optuna.Study], None]
DRIFT_CLAIM = "drift monitor, middle"  # the drift probe runs once per study (fitter.storage.fleet)


class Tuner:
    def __init__(self, req: TuneRequest, study: optuna.Study, runner: TrialRunner,
                 on_event: StudyCallback | None = None, heartbeat_s: float | None = None,
                 claims: Claims | None = None, worker: Worker | None = None,
                 log: Callable[[str], None] = lambda _: None, quality: QualityBook | None = None) -> None:
        self.req = req
        self.quality = quality  # --objectives …,quality: each KV class's measured quality (tune.quality_objective)
        self.study = study
        self.runner = runner
        self.screener = Screener(req)
        self.progress = TuneProgress()
        self.on_event = on_event or (lambda *_: None)
        self.log = log
        self._heartbeat_s = heartbeat_s
        # the fleet: this worker, and the claims that keep two workers from launching one config
        self.claims = claims if claims is not None else MemoryClaims()
        self.worker = worker or Worker.this()
        self._loaded_key: tuple[Any, ...] | None = None
        self._done: dict[str, FrozenTrial] = {}
        self._absorbed: set[int] = set()
        self.pool = SamplePool.empty()  # samples shared by configs a speed cannot tell apart (fitter.search.pooling)
        self.absorb()
        self.progress.launched = self.launched_so_far()
        # the baseline's candidate, measured again half-way through the launches: the drift monitor's middle point
        # (its start is the baseline's trial, its end the confirm rounds; fitter.tune.confirm.drift_record)
        self.drift_probe: Candidate | None = None
        self.stop = threading.Event()  # set from outside (a Ctrl-C): no trial starts after it, the running one ends

    def absorb(self) -> None:
        """What the study learnt since this worker last looked (its own trials, another worker's, an earlier run's):
        finished configs to answer from storage, their samples for the pool, the devices' learnt margins."""
        for device, margin in self.study.user_attrs.get("margins", {}).items():
            self.screener.learn_margin(device, int(margin))
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                               TrialState.FAIL)):
            if t.number in self._absorbed:
                continue
            self._absorbed.add(t.number)
            key = t.user_attrs.get("key")
            if key and measured(t):
                self._done.setdefault(key, t)
                if t.state == TrialState.COMPLETE and t.params and "same_as" not in t.user_attrs:
                    self._pool_own(candidate(self.req, dict(t.params)), t.number,
                                   t.user_attrs.get("measurement") or {})

    # counts over the whole study, so a resumed study continues where it stopped
    def launched_so_far(self) -> int:
        return sum(1 for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get("launched"))

    def _out_of_budget(self) -> bool:
        # the study's launches, every worker's: --trials is the study's budget, shared by a fleet
        if self.stop.is_set() or max(self.progress.launched, self.launched_so_far()) >= self.req.n_trials:
            return True
        timeout = self.req.timeout_s
        return timeout is not None and time.monotonic() - self.progress.started > timeout

    # -- trial bookkeeping ------------------------------------------------------------------------------------

    def _tell_screened(self, trial: optuna.Trial, cand: Candidate, s: Screen, phase: str) -> None:
        self._attrs(trial, cand, phase)
        if s.plan is not None:
            trial.set_user_attr("predicted_bytes", {k: v for k, v in device_totals(s.plan).items()})
        if s.projection is not None:
            trial.set_user_attr("projected_bytes", {k: sum(v.values()) for k, v in s.projection.items()})
        trial.set_user_attr("reason", s.reason())
        for name, value in (s.constraints or {"invalid": 1.0}).items():
            trial.set_constraint(name, value if s.error is None else max(value, 1.0))
        self.study.tell(trial, state=TrialState.PRUNED)
        self.progress.pruned += 1

    def _attrs(self, trial: optuna.Trial, cand: Candidate, phase: str) -> None:
        trial.set_user_attr("key", cand.key)
        trial.set_user_attr("flags", list(cand.flags))
        trial.set_user_attr("phase", phase)

    def _answer_from_storage(self, trial: optuna.Trial, cand: Candidate, prior: FrozenTrial, phase: str) -> None:
        self._attrs(trial, cand, phase)
        trial.set_user_attr("same_as", prior.number)
        for k in ("reason", "measurement", "predicted_bytes"):
            if k in prior.user_attrs:
                trial.set_user_attr(k, prior.user_attrs[k])
        for name, value in prior.constraints.items() if isinstance(prior.constraints, dict) else ():
            trial.set_constraint(name, value)
        if prior.state == TrialState.COMPLETE:
            self.study.tell(trial, prior.values)
        else:
            self.study.tell(trial, state=prior.state)
        self.progress.answered += 1

    def ask(self, distributions: dict[str, Any] | None = None) -> optuna.Trial:
        """A new trial, its first heartbeat recorded at once: a tune killed while it screens or starts the trial (before
        the heartbeat thread runs) still leaves a trial the next tune can fail as stale; Optuna never fails a RUNNING
        trial without a heartbeat (RDBStorage._get_stale_trial_ids)."""
        with warnings.catch_warnings():  # Optuna warns that heartbeats are meant for optimize(); fitter beats itself
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            trial = self.study.ask(distributions)
        if self._heartbeat_s is not None:
            record_heartbeat(self.study, trial)
        return trial

    def _heartbeat(self, trial: optuna.Trial) -> Callable[[], None]:
        """Beat for the running trial while it runs (fitter.storage.fleet.heartbeat); the stop function."""
        if self._heartbeat_s is None:
            return lambda: None
        return heartbeat(study_storage(self.study), trial_id(trial), self.claims, self.worker.name, self._heartbeat_s)

    def launch_slot(self) -> str | None:
        """One of the study's --trials launches for this worker, or None (fitter.storage.fleet.launch_slot)."""
        return launch_slot(self.claim, self.launched_so_far(), self.req.n_trials)

    def launch(self, trial: optuna.Trial, cand: Candidate, s: Screen | None, phase: str,
               claim: str | None = None) -> TrialResult | None:
        """Run the trial this worker claimed (`claim`: the config's key unless told otherwise) and tell the study.
        None, the trial failed unlaunched, when the fleet launched --trials while this worker screened it."""
        claim = claim or cand.key
        slot = self.launch_slot()
        if slot is None:
            self.claims.release(claim, self.worker.name)
            self._attrs(trial, cand, phase)
            trial.set_user_attr("reason", f"not launched: the fleet's workers launched the study's {self.req.n_trials} "
                                "trials (--trials) while this one screened it")
            self.study.tell(trial, state=TrialState.FAIL)
            return None
        try:
            result = self._launch(trial, cand, s, phase, claim)
        except BaseException:
            self.claims.release(slot, self.worker.name)
            raise
        self.claims.finish(slot, self.worker.name, trial.number)
        return result

    def _launch(self, trial: optuna.Trial, cand: Candidate, s: Screen | None, phase: str, claim: str) -> TrialResult:
        self._attrs(trial, cand, phase)
        trial.set_user_attr("worker", self.worker.name)
        trial.set_user_attr("claim", claim)
        # last: another worker waiting for the fleet (fitter.storage.fleet.wait_for_others) judges a launched trial
        # by its worker and claim, so a launched one without them was failed as stale (CI: journal, under load)
        trial.set_user_attr("launched", True)
        self.claims.settle(claim, self.worker.name, trial.number)
        if s is not None and s.plan is not None:
            trial.set_user_attr("predicted_bytes", device_totals(s.plan))
            if s.projection is not None:  # the build's own projection, beside fitter's (the drift guard)
                trial.set_user_attr("projected_bytes", {k: sum(v.values()) for k, v in s.projection.items()})
        self.on_event("start", self.progress, self.study)
        spec = cand.spec
        if phase != "baseline" and spec.n_gen and self.pool.has(cand, "tg"):
            spec = replace(spec, n_gen=0)  # its decode class was measured: prefill only (fitter.search.pooling)
        stop_heartbeat = self._heartbeat(trial)
        try:
            result = self.runner.run(self.req.model, cand.config, spec, self.req.trial_timeout_s,
                                     s.plan if s is not None else None)
        except BaseException:  # stopped (Ctrl-C) or broken mid-trial: the config is free for the next worker at once
            self.claims.release(claim, self.worker.name)
            raise
        finally:
            stop_heartbeat()
        m = result.measurement
        self.progress.launched += 1
        self.progress.model_loads += 0 if m.reused_model else 1
        try:
            self._tell_measured(trial, cand, s, phase, result)
        except optuna.exceptions.UpdateFinishedTrialError:
            # another worker failed this trial as stale (this one missed its beats, e.g. it was suspended): the
            # measurement is not the study's; the config is free for whoever claims it next
            self.claims.release(claim, self.worker.name)
            self.log(f"fitter: trial {trial.number} was failed by another worker while it ran (no beat for "
                     f"{self.claims.grace_s:.0f} s); its measurement is dropped")
            self.progress.failed += 1
            return result
        self.claims.finish(claim, self.worker.name, trial.number)
        told = frozen(self.study, trial)
        self._done[cand.key] = told
        self._absorbed.add(told.number)
        self.on_event("end", self.progress, self.study)
        self._probe_drift()
        return result

    def _tell_measured(self, trial: optuna.Trial, cand: Candidate, s: Screen | None, phase: str,
                       result: TrialResult) -> None:
        m = result.measurement
        measurement = measurement_json(result, self.runner.backend, s.plan if s else None, self.runner.emulated)
        if m.outcome == "ok" and phase != "baseline":
            pooled = self._pool_measurement(cand, trial.number, measurement)
            if pooled:
                trial.set_user_attr("pooled", pooled)
        trial.set_user_attr("measurement", measurement)
        trial.set_user_attr("reason", m.reason)
        trial.set_user_attr("outcome", m.outcome)
        needs = ("pp", "tg", *(STREAM_OBJECTIVES[o] for o in self.req.objectives if o in STREAM_OBJECTIVES))
        if m.outcome == "ok" and all(isinstance(measurement.get(k), dict) for k in needs):
            vram = vram_bytes(measurement)  # the devices' measured peak, else their logged buffers
            trial.set_user_attr("vram_bytes", vram)
            for name, value in (s.constraints if s else {}).items():
                trial.set_constraint(name, value)
            n_ctx = resolve_context(cand.config, self.req.spec.n_ctx_train).n_ctx
            trial.set_user_attr("n_ctx", n_ctx)
            try:
                quality = self.quality.of(cand.config) if self.quality is not None else None
            except FitterError as e:  # its quality could not be measured: a failed trial that says why
                trial.set_user_attr("reason", f"quality: {e}")
                self.study.tell(trial, state=TrialState.FAIL)
                self.progress.failed += 1
                return
            if quality is not None:
                trial.set_user_attr(QUALITY, quality)
            values = [objective_value(measurement, o, vram, n_ctx, quality) for o in self.req.objectives]
            self.study.tell(trial, values)
        elif m.outcome == "oom":
            self._learn_from_oom(trial, m, s)
            self.study.tell(trial, state=TrialState.PRUNED)
            self.progress.pruned += 1
        else:
            self.study.tell(trial, state=TrialState.FAIL)
            self.progress.failed += 1

    def _pool_own(self, cand: Candidate, number: int, measurement: dict[str, Any]) -> None:
        """A trial's own samples (not those it pooled from others) into the pool."""
        for speed in ("tg", "pp"):
            stats = measurement.get(speed) or {}
            samples = list(stats.get("samples_ts") or [])
            own = (stats.get("pooled") or {}).get("own", len(samples))
            self.pool.add(cand, speed, number, samples[:own])

    def _pool_measurement(self, cand: Candidate, number: int, measurement: dict[str, Any]) -> dict[str, list[int]]:
        """Pool the trial's speeds with its classes' earlier samples (in place); then add its own. Returns the trials
        each speed pooled from."""
        own = {k: dict(v) for k in ("tg", "pp") if isinstance(v := measurement.get(k), dict)}
        spec, out = cand.spec, {}
        for speed, n in (("tg", spec.n_gen), ("pp", spec.n_prompt)):
            if not n:
                continue
            pooled = self.pool.pooled(cand, speed, own.get(speed), n, spec.n_depth)
            if pooled is not None:
                measurement[speed] = pooled
                if "pooled" in pooled:
                    out[speed] = list(pooled["pooled"]["trials"])
        self._pool_own(cand, number, own)
        return out

    def _probe_drift(self) -> None:
        """The baseline once more when half the launches are spent: the drift monitor's middle point. Not a trial
        (it would be answered from storage): kept in the study's attributes, so a resumed study keeps it."""
        cand = self.drift_probe
        half = max(2, (self.req.n_trials + 1) // 2)
        if cand is None or self.progress.launched < half or "drift_middle" in self.study.user_attrs or \
                self.stop.is_set():
            return
        if not self.claim(DRIFT_CLAIM).granted:
            return  # another worker of the fleet measures it
        s = self.screener(cand)
        result = self.runner.run(self.req.model, cand.config, cand.spec, self.req.trial_timeout_s, s.plan)
        self.progress.model_loads += 0 if result.measurement.reused_model else 1
        m = measurement_json(result, self.runner.backend, s.plan, self.runner.emulated)
        self.study.set_user_attr("drift_middle", {
            "outcome": m["outcome"], "launched": self.progress.launched, "at": round(time.time(), 1),
            **{k: {"avg_ts": m[k]["avg_ts"], "stddev_ts": m[k]["stddev_ts"]} for k in ("pp", "tg")
               if isinstance(m.get(k), dict)}, "worker": self.worker.name})
        self.claims.finish(DRIFT_CLAIM, self.worker.name)

    def _learn_from_oom(self, trial: optuna.Trial, m: Any, s: Screen | None) -> None:
        """The device that refused an allocation: measured need = its logged buffers + the refused request."""
        oom = m.oom
        device = _oom_device(oom.buft if oom else None, self.req.devices)
        if device is None or s is None or s.plan is None:
            trial.set_constraint("oom", 1.0)
            return
        logged = sum(int(b.mib * MIB) for b in m.buffers if b.buft == device)
        needed = logged + (oom.requested_bytes or 0)
        predicted = device_totals(s.plan).get(device, 0)
        margin = needed - predicted
        if margin > 0:
            self.screener.learn_margin(device, margin)
            margins = dict(self.study.user_attrs.get("margins", {}))
            margins[device] = max(int(margins.get(device, 0)), margin)
            self.study.set_user_attr("margins", margins)
        budget = self.screener.budgets.devices.get(device, 0)
        trial.set_user_attr("oom_margin_bytes", margin)
        trial.set_constraint(f"vram:{device}", max(1.0, (max(needed, predicted) - budget) / MIB))

    # -- the search -------------------------------------------------------------------------------------------

    def run_candidate(self, params: dict[str, Any], phase: str) -> FrozenTrial | None:
        """Screen exactly these params, then answer them from storage or launch them. None: out of budget, or another
        worker of the fleet has claimed the config (its result reaches this one from storage)."""
        if self._out_of_budget():
            return None
        self.absorb()
        cand = candidate(self.req, params)
        s = self.screener(cand)
        if cand.key not in self._done and s.feasible and self._held_elsewhere(cand.key, wait=False):
            self.progress.elsewhere += 1
            return None
        trial = self.ask()
        self.progress.asked += 1
        set_params(self.study, trial, params, self.req.distributions)
        return self._settle(trial, cand, s, phase)

    def _ask_and_run(self, phase: str) -> FrozenTrial | None:
        """A trial the sampler chooses. A config another worker is measuring is waited for, then answered."""
        trial = self.ask(self.req.distributions)
        self.progress.asked += 1
        self.absorb()
        cand = candidate(self.req, dict(trial.params))
        s = self.screener(cand)
        if cand.key not in self._done and s.feasible:
            stop_heartbeat = self._heartbeat(trial)  # waiting for another worker's run of it may take minutes
            try:
                self._held_elsewhere(cand.key, wait=True)
            finally:
                stop_heartbeat()
        return self._settle(trial, cand, s, phase)

    def _settle(self, trial: optuna.Trial, cand: Candidate, s: Screen, phase: str) -> FrozenTrial:
        prior = self._done.get(cand.key)
        if prior is not None:
            self._answer_from_storage(trial, cand, prior, phase)
        elif not s.feasible:
            self._tell_screened(trial, cand, s, phase)
        else:
            self.launch(trial, cand, s, phase)
        return frozen(self.study, trial)

    def _held_elsewhere(self, what: str, wait: bool) -> bool:
        """Claim `what` (a config's key) for this worker. True: another worker holds it and `wait` is False. Else this
        worker holds it, or another finished it (then it is answered from storage); waiting, a claim whose holder
        dies is taken over."""
        while True:
            c = self.claim(what)
            if c.granted:
                return False
            if c.done:
                self.absorb()
                return False
            if not wait:
                return True
            time.sleep(1.0)
            self.absorb()
            if what in self._done:
                return False

    def claim(self, what: str) -> Claim:
        """Claim `what` for this worker now; granted over a dead worker's claim, its trial is failed first."""
        c = self.claims.claim(what, self.worker.name)
        if c.granted:
            self.fail_stale(c)
        return c

    def fail_stale(self, c: Claim) -> None:
        """A claim taken over from a worker that stopped beating: fail the trial it left RUNNING (Optuna's heartbeat
        does this for RDB storages, but not before its own grace, and a journal has none)."""
        if c.stale_holder is None:
            return
        self.log(f"fitter: worker {c.stale_holder} stopped beating; {self.worker.name} takes its claim over"
                 + (f" and fails its trial {c.stale_trial}" if c.stale_trial is not None else ""))
        if c.stale_trial is not None:
            fail_trial(self.study, c.stale_trial, f"its worker {c.stale_holder} stopped beating (killed?); failed by "
                       f"{self.worker.name}")

    def wait_for_others(self) -> None:
        """Until no other worker's launched trial is RUNNING (fitter.storage.fleet.wait_for_others)."""
        wait_for_others(self.study, self.claims, self.worker.name, self.stop, self.log)

    def run(self) -> None:
        """Baseline is run by the caller (it is not in the space); then the structured start, neighbours, TPE."""
        for planned in structured_start(self.req, self.screener):
            self.run_candidate(planned.params, planned.phase)
        self._walk_neighbours()
        self._tpe()

    def _walk_neighbours(self) -> None:
        """Greedy one-parameter moves from the best decode and best prefill trial until none is left untried."""
        tried: set[str] = set()
        while not self._out_of_budget():
            moved = False
            for objective in ("tg", "pp"):
                best = self.best(objective)
                if best is None:
                    continue
                for params in neighbours(self.req, self.screener, dict(best.params)):
                    key = candidate(self.req, params).key
                    if key in tried or key in self._done:
                        continue
                    tried.add(key)
                    self.run_candidate(params, "neighbour")
                    moved = True
                    break
                if self._out_of_budget():
                    return
            if not moved:
                return

    def _tpe(self) -> None:
        max_asks = 40 * self.req.n_trials  # screening is cheap, but a converged sampler repeats itself
        asks = 0
        while not self._out_of_budget() and asks < max_asks:
            asks += 1
            self._ask_and_run("tpe")
            if self._space_exhausted():
                return

    def _space_exhausted(self) -> bool:
        size = 1
        for d in self.req.distributions.values():
            size *= len(_choices(d))
        return len({t.user_attrs.get("key") for t in self.study.get_trials(deepcopy=False)}) >= size

    def best(self, objective: str) -> FrozenTrial | None:
        """The COMPLETE feasible trial of the space with the best measured value of one objective."""
        best: tuple[float, FrozenTrial] | None = None
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if not t.params or any(v > 0 for v in t.constraints.values()):
                continue
            value = objective_value(t.user_attrs["measurement"], objective, t.user_attrs.get("vram_bytes", 0),
                                    quality=t.user_attrs.get(QUALITY))
            score = -value if objective in ("vram", QUALITY) else value
            if best is None or score > best[0]:
                best = (score, t)
        return best[1] if best else None


def _oom_device(buft: str | None, devices: tuple[Device, ...]) -> str | None:
    if buft is None:
        return None
    for d in devices:
        if buft == d.name or buft.startswith(d.name):
            return d.name
    return None
