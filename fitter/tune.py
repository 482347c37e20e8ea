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

import itertools
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from fitter.devices import CpuProfile, Device
from fitter.errors import FitterError, LaunchConfigError
from fitter.launch_config import LaunchConfig, parse_launch_flags, split_process_flags
from fitter.model_spec import ModelSpec
from fitter.screen import Budgets, Screen, cpu_bytes_per_token, device_totals, screen
from fitter.search_space import is_valid_combination, params_to_flags
from fitter.trial_runner import TrialResult, TrialRunner
from fitter.worker import BenchSpec

MIB = 1024 * 1024
OBJECTIVES: dict[str, str] = {"tg": "maximize", "pp": "maximize", "vram": "minimize"}
PLACEMENT_KEYS = ("n-cpu-moe", "n-gpu-layers")
THREAD_KEYS = ("threads", "threads-batch")
MODEL_LEVEL_KEYS = PLACEMENT_KEYS  # a change here reloads the model (llama-bench's rule, fitter/worker.py)
# llama-server's own defaults, the tie-breaker when the physics prior cannot tell two combos apart
SERVER_DEFAULTS: dict[str, Any] = {"batch-size": 2048, "ubatch-size": 512, "cache-type-k": "f16",
                                   "cache-type-v": "f16", "flash-attn": "auto"}


class TuneError(FitterError):
    pass


@dataclass(frozen=True)
class TuneRequest:
    model: str
    spec: ModelSpec
    fixed_flags: tuple[str, ...]  # the user's llama.cpp flags: context, slots, anything not searched
    distributions: dict[str, BaseDistribution]  # the resolved search space, llama.cpp long flag names
    devices: tuple[Device, ...]
    budgets: Budgets
    cpu: CpuProfile
    objectives: tuple[str, ...] = ("tg", "pp", "vram")
    bench: BenchSpec = field(default_factory=BenchSpec)
    n_trials: int = 12  # launched trials, the baseline included, in the whole study (a resumed one too)
    timeout_s: float | None = None
    trial_timeout_s: float | None = None
    seed: int = 0
    rpc: tuple[str, ...] = ()

    @property
    def default_threads(self) -> int:
        """Threads of a trial whose params do not choose them: the bench spec's."""
        return self.bench.threads


@dataclass
class Candidate:
    params: dict[str, Any]
    config: LaunchConfig
    spec: BenchSpec
    flags: tuple[str, ...]  # the llama.cpp flags of this trial (fixed flags, then the searched ones)
    error: str | None = None  # llama.cpp refuses these flags (e.g. a quantized V cache without flash attention)

    @property
    def key(self) -> str:
        return " ".join(self.flags)


@dataclass
class TuneProgress:
    launched: int = 0
    pruned: int = 0
    answered: int = 0
    failed: int = 0
    asked: int = 0
    model_loads: int = 0
    started: float = field(default_factory=time.monotonic)


# -- candidates -------------------------------------------------------------------------------------------------


def candidate(req: TuneRequest, params: dict[str, Any]) -> Candidate:
    """The config and bench spec a param dict stands for. Threads go to the bench spec (-t/-tb), the rest to flags."""
    searched = {k: v for k, v in params.items() if k not in THREAD_KEYS}
    flags = [*req.fixed_flags, *params_to_flags(searched)]
    if req.spec.n_expert and "n-gpu-layers" not in params and not _has_flag(req.fixed_flags, "-ngl"):
        flags += ["-ngl", "all"]  # experts placed explicitly: every layer on the GPU, as the seeds' recipe
    if req.rpc and not _has_flag(req.fixed_flags, "--rpc"):
        flags += ["--rpc", ",".join(req.rpc)]
    threads = int(params.get("threads", req.default_threads))
    threads_batch = int(params.get("threads-batch", req.bench.threads_batch or threads))
    flags += ["-t", str(threads), "-tb", str(threads_batch)]
    spec = replace(req.bench, threads=threads, threads_batch=threads_batch)
    try:
        config = parse_launch_flags(split_process_flags(flags, 'the trial')[0])
    except LaunchConfigError as e:  # llama.cpp would refuse it: screened out like a config that does not fit
        return Candidate(dict(params), LaunchConfig(), spec, tuple(flags), error=str(e))
    return Candidate(dict(params), config, spec, tuple(flags))


def _has_flag(flags: tuple[str, ...], name: str) -> bool:
    aliases = {"-ngl": ("-ngl", "--gpu-layers", "--n-gpu-layers"), "--rpc": ("--rpc", "-rpc")}[name]
    return any(f in aliases for f in flags)


def combos(req: TuneRequest) -> list[dict[str, Any]]:
    """Every combination of the context-level choices (batch sizes, KV types, flash attention) llama.cpp accepts."""
    keys = [k for k in req.distributions if k not in PLACEMENT_KEYS and k not in THREAD_KEYS]
    choices = [_choices(req.distributions[k]) for k in keys]
    out = []
    for values in itertools.product(*choices):
        params = dict(zip(keys, values, strict=True))
        if is_valid_combination(params) is None:
            out.append(params)
    return out


def _choices(d: BaseDistribution) -> list[Any]:
    if isinstance(d, CategoricalDistribution):
        return list(d.choices)
    if isinstance(d, IntDistribution):
        return list(range(d.low, d.high + 1, d.step))
    raise TuneError(f"search space: {d!r} is not a finite distribution")


class Screener:
    """The estimator's verdicts, cached by flags; and the best placement of each combo."""

    def __init__(self, req: TuneRequest) -> None:
        self.req = req
        self._cache: dict[str, Screen] = {}
        self.budgets = req.budgets

    def learn_margin(self, device: str, margin: int) -> None:
        self.budgets = self.budgets.with_margin(device, margin)
        self._cache.clear()

    def __call__(self, cand: Candidate) -> Screen:
        key = " ".join(split_process_flags(list(cand.flags), "the trial")[0])
        if key not in self._cache:
            reason = cand.error or is_valid_combination(cand.params)
            if reason is not None:
                self._cache[key] = Screen(None, {}, reason)
            else:
                self._cache[key] = screen(self.req.spec, cand.config, self.req.devices, self.req.cpu, self.budgets)
        return self._cache[key]

    def placement(self, params: dict[str, Any]) -> dict[str, Any] | None:
        """`params` completed with the placement that reads the fewest bytes from RAM and still fits: the smallest
        `-ncmoe` or the largest `-ngl` in the space (memory is monotone in both, so bisection). None: nothing fits."""
        dists = self.req.distributions
        for key, smallest_first in (("n-cpu-moe", True), ("n-gpu-layers", False)):
            if key in dists:
                values = sorted(_choices(dists[key]), reverse=not smallest_first)
                return self._first_fitting(params, key, values)
        cand = candidate(self.req, self._with_threads(params))
        return params if self(cand).feasible else None

    def _first_fitting(self, params: dict[str, Any], key: str, values: list[int]) -> dict[str, Any] | None:
        def fits(i: int) -> bool:
            return self(candidate(self.req, self._with_threads({**params, key: values[i]}))).feasible

        if not values or not fits(len(values) - 1):
            return None
        lo, hi = 0, len(values) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return {**params, key: values[lo]}

    def _with_threads(self, params: dict[str, Any]) -> dict[str, Any]:
        out = dict(params)
        for key in THREAD_KEYS:
            if key in self.req.distributions and key not in out:
                out[key] = _default_choice(self.req.distributions[key], self.req.default_threads)
        return out


def _default_choice(d: BaseDistribution, preferred: Any) -> Any:
    choices = _choices(d)
    return preferred if preferred in choices else choices[0]


def _default_distance(params: dict[str, Any]) -> int:
    return sum(1 for k, v in SERVER_DEFAULTS.items() if k in params and params[k] != v)


# -- the structured plan ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedTrial:
    phase: str  # decode-first | prefill-first | min-vram | neighbour | tpe
    params: dict[str, Any]


def structured_start(req: TuneRequest, screener: Screener) -> list[PlannedTrial]:
    """The first trials a person would run: best decode guess, best prefill guess, the lightest placement."""
    placed = []
    for combo in combos(req):
        params = screener.placement(screener._with_threads(combo))
        if params is not None:
            cand = candidate(req, params)
            plan = screener(cand).plan
            assert plan is not None
            placed.append((params, plan))
    if not placed:
        return []
    decode = min(placed, key=lambda p: (cpu_bytes_per_token(p[1]), _default_distance(p[0])))[0]
    prefill = max(placed, key=lambda p: (p[0].get("ubatch-size", 0),
                                         -cpu_bytes_per_token(p[1]), -_default_distance(p[0])))[0]
    out = [PlannedTrial("decode-first", decode), PlannedTrial("prefill-first", prefill)]
    if "vram" in req.objectives and req.devices:
        lightest = _lightest(req, screener, [p for p, _ in placed])
        if lightest is not None:
            out.append(PlannedTrial("min-vram", lightest))
    return out


def _lightest(req: TuneRequest, screener: Screener, placed: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The feasible config with the least predicted device memory: each combo with its lightest placement."""
    best: tuple[int, dict[str, Any]] | None = None
    for params in placed:
        light = dict(params)
        if "n-cpu-moe" in req.distributions:
            light["n-cpu-moe"] = max(_choices(req.distributions["n-cpu-moe"]))
        if "n-gpu-layers" in req.distributions:
            light["n-gpu-layers"] = min(_choices(req.distributions["n-gpu-layers"]))
        s = screener(candidate(req, light))
        if s.feasible and s.plan is not None:
            used = sum(v for k, v in device_totals(s.plan).items() if k != "CPU")
            if best is None or used < best[0]:
                best = (used, light)
    return best[1] if best else None


def neighbours(req: TuneRequest, screener: Screener, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Configs one context-level or thread choice away from `params`, each at its own best placement, most
    promising first (fewest CPU bytes per token, then closest to llama-server's defaults)."""
    found = []
    for key, dist in req.distributions.items():
        if key in PLACEMENT_KEYS:
            continue
        for value in _choices(dist):
            if value == params.get(key):
                continue
            base = {k: v for k, v in params.items() if k not in PLACEMENT_KEYS}
            base[key] = value
            if key == "batch-size" and "ubatch-size" in base and base["ubatch-size"] > value:
                continue
            if key == "batch-size" and min(value, params.get(key, value)) >= req.bench.n_prompt:
                continue  # both batches take the whole prompt at once: the measurement cannot tell them apart
            if key in THREAD_KEYS:
                placed = {**params, key: value}
            else:
                placed_or_none = screener.placement(base)
                if placed_or_none is None:
                    continue
                placed = {**placed_or_none, **{k: params[k] for k in THREAD_KEYS if k in params and k != key}}
            s = screener(candidate(req, placed))
            if s.feasible and s.plan is not None:
                found.append((cpu_bytes_per_token(s.plan), _default_distance(placed), placed))
    for _, _, placed in sorted(found, key=lambda f: (f[0], f[1])):
        yield placed


# -- the study --------------------------------------------------------------------------------------------------

StudyCallback = Callable[[str, TuneProgress, optuna.Study], None]


class Tuner:
    def __init__(self, req: TuneRequest, study: optuna.Study, runner: TrialRunner,
                 on_event: StudyCallback | None = None, heartbeat_s: float | None = None) -> None:
        self.req = req
        self.study = study
        self.runner = runner
        self.screener = Screener(req)
        self.progress = TuneProgress()
        self.on_event = on_event or (lambda *_: None)
        self._heartbeat_s = heartbeat_s
        self._loaded_key: tuple[Any, ...] | None = None
        for device, margin in study.user_attrs.get("margins", {}).items():
            self.screener.learn_margin(device, int(margin))
        self._done: dict[str, FrozenTrial] = {}
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)):
            key = t.user_attrs.get("key")
            if key and t.user_attrs.get("launched"):
                self._done.setdefault(key, t)
        self.progress.launched = self.launched_so_far()

    # counts over the whole study, so a resumed study continues where it stopped
    def launched_so_far(self) -> int:
        return sum(1 for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get("launched"))

    def _out_of_budget(self) -> bool:
        if self.progress.launched >= self.req.n_trials:
            return True
        timeout = self.req.timeout_s
        return timeout is not None and time.monotonic() - self.progress.started > timeout

    # -- trial bookkeeping ------------------------------------------------------------------------------------

    def _tell_screened(self, trial: optuna.Trial, cand: Candidate, s: Screen, phase: str) -> None:
        self._attrs(trial, cand, phase)
        if s.plan is not None:
            trial.set_user_attr("predicted_bytes", {k: v for k, v in device_totals(s.plan).items()})
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

    def _heartbeat(self, trial: optuna.Trial) -> Callable[[], None]:
        """Record the running trial's heartbeat while it runs, so a killed tune leaves a stale trial that the next
        one fails (optuna.storages.fail_stale_trials) instead of a trial RUNNING forever."""
        storage = self.study._storage
        interval = self._heartbeat_s
        if interval is None or not hasattr(storage, "record_heartbeat"):
            return lambda: None
        stop = threading.Event()

        def beat() -> None:
            while True:
                try:
                    storage.record_heartbeat(trial._trial_id)
                except Exception:
                    return
                if stop.wait(interval):
                    return

        thread = threading.Thread(target=beat, name="fitter-heartbeat", daemon=True)
        thread.start()

        def done() -> None:
            stop.set()
            thread.join()

        return done

    def launch(self, trial: optuna.Trial, cand: Candidate, s: Screen | None, phase: str) -> TrialResult:
        self._attrs(trial, cand, phase)
        trial.set_user_attr("launched", True)
        if s is not None and s.plan is not None:
            trial.set_user_attr("predicted_bytes", device_totals(s.plan))
        self.on_event("start", self.progress, self.study)
        stop_heartbeat = self._heartbeat(trial)
        try:
            result = self.runner.run(self.req.model, cand.config, cand.spec, self.req.trial_timeout_s)
        finally:
            stop_heartbeat()
        m = result.measurement
        self.progress.launched += 1
        self.progress.model_loads += 0 if m.reused_model else 1
        measurement = measurement_json(result, self.runner.backend, s.plan if s else None, self.runner.emulated)
        trial.set_user_attr("measurement", measurement)
        trial.set_user_attr("reason", m.reason)
        trial.set_user_attr("outcome", m.outcome)
        if m.outcome == "ok" and m.pp is not None and m.tg is not None:
            vram = sum(p["bytes"] for p in result.peak_vram.values()) if result.peak_vram else _device_sum(m)
            trial.set_user_attr("vram_bytes", vram)
            for name, value in (s.constraints if s else {}).items():
                trial.set_constraint(name, value)
            values = [objective_value(measurement, o, vram) for o in self.req.objectives]
            self.study.tell(trial, values)
        elif m.outcome == "oom":
            self._learn_from_oom(trial, m, s)
            self.study.tell(trial, state=TrialState.PRUNED)
            self.progress.pruned += 1
        else:
            self.study.tell(trial, state=TrialState.FAIL)
            self.progress.failed += 1
        frozen = self.study._storage.get_trial(trial._trial_id)
        self._done[cand.key] = frozen
        self.on_event("end", self.progress, self.study)
        return result

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
        """Ask the study for exactly these params, then screen, answer from storage or launch. None: out of budget
        or the config is not in the space."""
        if self._out_of_budget():
            return None
        self.study.enqueue_trial(params, skip_if_exists=False)
        return self._ask_and_run(phase)

    def _ask_and_run(self, phase: str) -> FrozenTrial | None:
        with warnings.catch_warnings():  # Optuna warns that heartbeats are meant for optimize(); fitter beats itself
            warnings.filterwarnings("ignore", message="Heartbeat of storage")
            trial = self.study.ask(self.req.distributions)
        self.progress.asked += 1
        params = dict(trial.params)
        cand = candidate(self.req, params)
        s = self.screener(cand)
        prior = self._done.get(cand.key)
        if prior is not None:
            self._answer_from_storage(trial, cand, prior, phase)
        elif not s.feasible:
            self._tell_screened(trial, cand, s, phase)
        else:
            self.launch(trial, cand, s, phase)
        return self.study._storage.get_trial(trial._trial_id)

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
            value = objective_value(t.user_attrs["measurement"], objective, t.user_attrs.get("vram_bytes", 0))
            score = -value if objective == "vram" else value
            if best is None or score > best[0]:
                best = (score, t)
        return best[1] if best else None


def measurement_json(result: TrialResult, backend: str, plan: Any, emulated: bool) -> dict[str, Any]:
    from fitter.bench import bench_json

    return bench_json(result.measurement, backend, plan, emulated=emulated, peak_vram=result.peak_vram)


def objective_value(measurement: dict[str, Any], objective: str, vram_bytes: int) -> float:
    if objective == "vram":
        return round(vram_bytes / MIB, 3)
    return float(measurement[objective]["avg_ts"])


def _device_sum(m: Any) -> int:
    """Device bytes as llama.cpp logged them, when no peak counter exists (CPU-only: 0)."""
    return sum(int(b.mib * MIB) for b in m.buffers if b.buft not in ("CPU", "CPU_Mapped", "CPU_REPACK", "CUDA_Host"))


def _oom_device(buft: str | None, devices: tuple[Device, ...]) -> str | None:
    if buft is None:
        return None
    for d in devices:
        if buft == d.name or buft.startswith(d.name):
            return d.name
    return None
