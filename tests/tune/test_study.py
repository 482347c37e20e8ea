"""The study logic on a fake runner: a deterministic speed function of the estimator's plan, so the grid optimum is
known and every outcome (ok, oom, crash, timeout) can be scripted."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from fitter.flags import LaunchConfig, parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.types import BenchSpec, Measurement, OomInfo, SpeedStats, TrialResult
from fitter.memory.backends.devices import CPU_AVX2, RPC, Device
from fitter.memory.plan.estimator import estimate
from fitter.results.measurement import MeasurementRecord
from fitter.results.pareto import Entry, picks
from fitter.search.request import OBJECTIVES, TuneRequest, _choices, candidate
from fitter.search.screen import Budgets, cpu_bytes_per_token, device_totals
from fitter.search.space import resolve, shipped_space
from fitter.storage.fleet import MemoryClaims, Row, Worker
from fitter.storage.studies import StudyKey, open_study
from fitter.tune.study import Tuner
from tests.models import model_file

MIB = 1024 * 1024
DEVICE = Device("RPC0[127.0.0.1:50052]", RPC, 96 * MIB, 96 * MIB)


def speeds(config: LaunchConfig, spec: BenchSpec, model: Any) -> tuple[float, float]:
    """A made-up but physical machine: decode limited by CPU bytes per token, prefill growing with -ub and
    falling with CPU-resident bytes, both scaled by threads; q8_0 K costs decode 3 %."""
    plan = estimate(model, config, (DEVICE,), CPU_AVX2)
    cpu = cpu_bytes_per_token(plan)
    tg = 2e9 / (cpu + 2e6) * (0.97 if config.cache_type_k == "q8_0" else 1.0) * min(spec.threads, 4) / 4
    pp = 400 * (config.ubatch_size / 512) ** 0.5 / (1 + cpu / 2e7) * min(spec.threads_batch or spec.threads, 4) / 4
    return pp, tg


@dataclass
class FakeRunner:
    model: Any
    backend: str = "fake"
    emulated: bool = True
    script: dict[str, str] = field(default_factory=dict)  # flag substring → outcome to force
    runs: list[str] = field(default_factory=list)

    def build(self) -> dict[str, str]:
        return {"commit": "fake", "source": "test"}

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None,
            plan: Any = None) -> TrialResult:
        key = f"ub{config.ubatch_size} b{config.batch_size} ctk{config.cache_type_k} ctv{config.cache_type_v} " \
              f"fa{config.flash_attn} ov{config.overrides} t{spec.threads} " \
              f"lm{config.load_mode} nkvo{config.no_kv_offload}"
        self.runs.append(key)
        plan = estimate(self.model, config, (DEVICE,), CPU_AVX2)
        for needle, outcome in self.script.items():
            if needle in key:
                if outcome == "oom":
                    used = device_totals(plan)[DEVICE.name]
                    return TrialResult(Measurement("oom", f"{DEVICE.name}: failed to allocate", spec, (),
                                                   oom=OomInfo("compute", DEVICE.name, used + 8 * MIB)))
                return TrialResult(Measurement(outcome, f"scripted {outcome}", spec, ()))
        pp, tg = speeds(config, spec, self.model)
        stats_pp = SpeedStats.from_ns(spec.n_prompt, 0, [round(spec.n_prompt * 1e9 / pp)] * 2)
        stats_tg = SpeedStats.from_ns(spec.n_gen, 0, [round(spec.n_gen * 1e9 / tg)] * 2)
        peak = {DEVICE.name: {"bytes": device_totals(plan)[DEVICE.name], "source": "emulator"}}
        return TrialResult(Measurement("ok", "", spec, (), stats_pp, stats_tg), peak)


@pytest.fixture(scope="module")
def demo_spec() -> Any:
    return load_model_spec(str(model_file("gpt-oss-tiny")))


def _request(spec: Any, n_trials: int = 12, objectives: tuple[str, ...] = ("tg", "pp", "vram"),
             threads: tuple[str, ...] = ("performance-cores",)) -> TuneRequest:
    space = shipped_space("moe")
    dists = resolve(space, n_layer=spec.n_layer, physical_cores=4, performance_cores=4)
    dists.pop("split-mode")  # one GPU: plan_request leaves -sm to llama.cpp (fitter.tune.targets)
    return TuneRequest(model="m.gguf", spec=spec, base=parse_launch_flags(["-c", "4096", "-np", "1"]),
                       distributions=dists,
                       devices=(DEVICE,), budgets=Budgets({DEVICE.name: 40 * MIB}, 64 * 1024 * MIB, {}),
                       cpu=CPU_AVX2, objectives=objectives, bench=BenchSpec(n_prompt=64, n_gen=16, threads=4),
                       n_trials=n_trials, rpc=("127.0.0.1:50052",))


def _study(tmp_path: Path, objectives: tuple[str, ...] = ("tg", "pp", "vram"), name: str = "s.db") -> optuna.Study:
    sampler = optuna.samplers.TPESampler(seed=0, multivariate=True, constant_liar=True)
    return open_study(f"sqlite:///{tmp_path / name}", StudyKey("id", "fp", "fake"),
                      [OBJECTIVES[o] for o in objectives], sampler, {"objectives": list(objectives)})


def grid_best_tg(req: TuneRequest, runner: FakeRunner) -> float:
    best = 0.0
    keys = list(req.distributions)
    for values in itertools.product(*(_choices(req.distributions[k]) for k in keys)):
        params = dict(zip(keys, values, strict=True))
        from fitter.search.plan import Screener

        cand = candidate(req, params)
        if not Screener(req)(cand).feasible:
            continue
        best = max(best, speeds(cand.config, cand.spec, runner.model)[1])
    return best


def test_the_search_reaches_the_grid_optimum_and_never_launches_a_predicted_misfit(tmp_path: Path,
                                                                                   demo_spec: Any) -> None:
    req = _request(demo_spec)
    runner = FakeRunner(demo_spec)
    study = _study(tmp_path)
    tuner = Tuner(req, study, runner)
    tuner.run()
    launched = [t for t in study.trials if t.user_attrs.get("launched")]
    assert len(launched) == len(runner.runs) <= 12
    for t in launched:  # every launched config was predicted to fit
        assert all(v <= 0 for v in t.constraints.values()), t.user_attrs["flags"]
    screened = [t for t in study.trials if t.state == TrialState.PRUNED and not t.user_attrs.get("launched")]
    assert all(any(v > 0 for v in t.constraints.values()) for t in screened)
    best = max(t.user_attrs["measurement"]["tg"]["avg_ts"] for t in launched if t.state == TrialState.COMPLETE)
    assert best >= 0.98 * grid_best_tg(req, runner)
    assert launched[0].user_attrs["phase"] == "decode-first"


def test_a_measured_config_is_answered_from_storage_and_a_resumed_study_adds_only_new_launches(
        tmp_path: Path, demo_spec: Any) -> None:
    runner = FakeRunner(demo_spec)
    Tuner(_request(demo_spec, n_trials=4), _study(tmp_path), runner).run()
    assert len(runner.runs) == 4
    study = _study(tmp_path)  # resume: same storage, same key
    tuner = Tuner(_request(demo_spec, n_trials=7), study, runner)
    assert tuner.progress.launched == 4
    tuner.run()
    assert len(runner.runs) == 7 and len(set(runner.runs)) == 7  # nothing measured twice
    answered = [t for t in study.trials if "same_as" in t.user_attrs]
    for t in answered:
        prior = study.trials[t.user_attrs["same_as"]]
        assert prior.user_attrs["key"] == t.user_attrs["key"] and prior.values == t.values


def test_oom_prunes_and_teaches_the_device_margin(tmp_path: Path, demo_spec: Any) -> None:
    runner = FakeRunner(demo_spec, script={"ub256 b2048 ctkf16": "oom"})
    study = _study(tmp_path)
    tuner = Tuner(_request(demo_spec, n_trials=6), study, runner)
    tuner.run()
    ooms = [t for t in study.trials if t.user_attrs.get("outcome") == "oom"]
    assert ooms and all(t.state == TrialState.PRUNED for t in ooms)
    assert all(t.constraints[f"vram:{DEVICE.name}"] > 0 for t in ooms)
    assert study.user_attrs["margins"] == {DEVICE.name: 8 * MIB}  # measured need − predicted
    assert tuner.screener.budgets.margins == {DEVICE.name: 8 * MIB}
    # later screening adds the margin: no launched trial after the first oom is within 8 MiB of the budget
    first = ooms[0].number
    for t in study.trials:
        if t.number > first and t.user_attrs.get("launched") and "predicted_bytes" in t.user_attrs:
            assert t.user_attrs["predicted_bytes"][DEVICE.name] + 8 * MIB <= 40 * MIB


def test_crash_and_timeout_are_failed_trials_with_their_reason(tmp_path: Path, demo_spec: Any) -> None:
    runner = FakeRunner(demo_spec, script={"ctkq8_0": "crash", "ub1024": "timeout"})
    study = _study(tmp_path)
    Tuner(_request(demo_spec, n_trials=8), study, runner).run()
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert failed and {t.user_attrs["reason"] for t in failed} <= {"scripted crash", "scripted timeout"}
    assert all(t.values is None for t in failed)  # never a zero


def test_a_single_objective_study_runs(tmp_path: Path, demo_spec: Any) -> None:
    runner = FakeRunner(demo_spec)
    study = _study(tmp_path, objectives=("tg",))
    Tuner(_request(demo_spec, n_trials=5, objectives=("tg",)), study, runner).run()
    assert len(runner.runs) == 5 and all(len(t.values) == 1 for t in study.trials if t.values)


def _entry(trial: int, pp: float, tg: float, vram: int) -> Entry:
    return Entry(trial, (), MeasurementRecord.of({"pp": {"avg_ts": pp}, "tg": {"avg_ts": tg}}), vram_bytes=vram)


def test_picks_balanced_is_the_best_worse_ratio_never_a_sum() -> None:
    entries = [_entry(1, 1000, 10, 900), _entry(2, 400, 30, 800), _entry(3, 800, 27, 700), _entry(4, 300, 29, 100)]
    # sums would pick 1 (1010); ratios: 1 → min(1, .33), 2 → min(.4, 1), 3 → min(.8, .9) = .8, 4 → .3
    assert picks(entries) == {"max-decode": 2, "max-prefill": 1, "balanced": 3, "min-vram": 4}
    assert picks([]) == {}


class SlowRunner(FakeRunner):
    """Hangs on its fourth trial, so the parent can kill -9 the tune mid-trial."""

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None,
            plan: Any = None) -> TrialResult:
        if len(self.runs) == 3:
            import time

            time.sleep(600)
        return super().run(model, config, spec, timeout)


CHILD = """
import sys
from pathlib import Path
from fitter.gguf.model_spec import load_model_spec
from fitter.tune.study import Tuner
from fitter.storage.studies import open_study, StudyKey
from tests.tune.test_study import SlowRunner, _request, _study
from tests.models import model_file
spec = load_model_spec(str(model_file("gpt-oss-tiny")))
tmp = Path(sys.argv[1])
import optuna
study = open_study(f"sqlite:///{tmp / 's.db'}", StudyKey("id", "fp", "fake"), ["maximize", "maximize", "minimize"],
                   optuna.samplers.TPESampler(seed=0), {}, heartbeat_s=1, grace_s=2)
Tuner(_request(spec, n_trials=10), study, SlowRunner(spec), heartbeat_s=1).run()
"""


@pytest.mark.load
def test_kill_9_mid_study_then_resume_loses_no_finished_trial(tmp_path: Path, demo_spec: Any) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    # its temporary files (tests.models) under tmp_path: killed, it removes nothing itself
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=root, start_new_session=True,
                            stderr=subprocess.DEVNULL, env={**os.environ, "TMPDIR": str(tmp_path)})
    url = f"sqlite:///{tmp_path / 's.db'}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.5)
        try:
            trials = optuna.load_study(study_name="fitter", storage=url).trials
        except Exception:
            continue
        if sum(1 for t in trials if t.user_attrs.get("launched") and t.state.is_finished()) == 3 and \
                any(t.state == TrialState.RUNNING for t in trials):
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {t.number: (t.state, t.values, t.user_attrs.get("key")) for t in
              optuna.load_study(study_name="fitter", storage=url).trials if t.state.is_finished()}
    assert sum(1 for s, _, _ in before.values() if s == TrialState.COMPLETE) >= 3
    time.sleep(3)  # past the grace period
    study = open_study(url, StudyKey("id", "fp", "fake"), ["maximize", "maximize", "minimize"],
                       optuna.samplers.TPESampler(seed=0), {}, heartbeat_s=1, grace_s=2)
    states = {t.number: t.state for t in study.trials}
    assert TrialState.RUNNING not in states.values()  # the killed trial is failed, not left running
    after = {t.number: (t.state, t.values, t.user_attrs.get("key")) for t in study.trials}
    assert all(after[n] == v for n, v in before.items())  # every finished trial is intact
    runner = FakeRunner(demo_spec)
    Tuner(_request(demo_spec, n_trials=10), study, runner).run()
    done_keys = {k for s, _, k in before.values() if s == TrialState.COMPLETE}
    relaunched = [t for t in study.trials[len(after):] if t.user_attrs.get("launched")
                  and t.user_attrs["key"] in done_keys]
    assert relaunched == []


@pytest.mark.load
def test_a_trial_killed_before_it_launched_is_failed_when_the_study_resumes(tmp_path: Path, demo_spec: Any) -> None:
    # Optuna fails a RUNNING trial as stale only once it has a heartbeat (RDBStorage._get_stale_trial_ids): a tune
    # killed while it screened or started a trial, before the heartbeat thread ran, left that trial RUNNING forever
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = open_study(url, StudyKey("id", "fp", "fake"), ["maximize", "maximize", "minimize"],
                       optuna.samplers.TPESampler(seed=0), {}, heartbeat_s=1, grace_s=1)
    tuner = Tuner(_request(demo_spec), study, FakeRunner(demo_spec), heartbeat_s=1)
    trial = tuner.ask(tuner.req.distributions)  # then the process dies: no tell, no heartbeat thread
    time.sleep(2.5)  # past the grace period
    resumed = open_study(url, StudyKey("id", "fp", "fake"), ["maximize", "maximize", "minimize"],
                         optuna.samplers.TPESampler(seed=0), {}, heartbeat_s=1, grace_s=1)
    assert resumed.trials[trial.number].state == TrialState.FAIL


def test_workers_that_check_the_budget_at_once_never_launch_past_trials(tmp_path: Path, demo_spec: Any) -> None:
    # three workers of a fleet on one study, --trials 3: each launch takes one of the study's 3 launch claims first
    study = _study(tmp_path)
    req = _request(demo_spec, n_trials=3)
    claims = MemoryClaims()  # the study's claims, as every worker sees them
    a, b, c = (Tuner(req, study, FakeRunner(demo_spec), claims=claims, worker=Worker(f"host-{x}", 1)) for x in "abc")
    grid = _grid(req)
    first = candidate(req, next(grid))
    assert a.launch(a.ask(), first, None, "tpe") is not None  # launch 0: run and told
    assert claims.row("launch 0") == Row("launch 0", "host-a:1", 0, claims.row("launch 0").beat_at, True)
    assert b.launch_slot() == "launch 1"  # b's launch runs
    assert a.launch_slot() == "launch 2"  # and a's next one
    # c passed its budget check (one launch so far) and screened a config: no launch is left for it, and its
    # trial fails unlaunched, saying why
    cand = candidate(req, next(grid))
    trial = c.ask()
    assert c.launch(trial, cand, None, "tpe") is None
    failed = study.trials[trial.number]
    assert failed.state == TrialState.FAIL and not failed.user_attrs.get("launched")
    assert failed.user_attrs["reason"] == ("not launched: the fleet's workers launched the study's 3 trials (--trials) "
                                           "while this one screened it")
    assert c.runner.runs == [] and claims.row(cand.key) is None  # nothing ran; the config is free for whoever


class WatchedStorage(optuna.storages.InMemoryStorage):
    """A storage that notes, each time a trial is marked launched, the attributes it already holds: what another
    worker of the fleet reading the study at that moment would see."""

    def __init__(self) -> None:
        super().__init__()
        self.seen_at_launch: list[set[str]] = []

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        if key == "launched":
            self.seen_at_launch.append(set(self.get_trial(trial_id).user_attrs))
        super().set_trial_user_attr(trial_id, key, value)


def test_a_trial_is_marked_launched_only_once_its_worker_and_claim_are_there(demo_spec: Any) -> None:
    # a worker waiting for the fleet fails a launched RUNNING trial whose claim it cannot find as stale
    # (fitter.storage.fleet.wait_for_others); with "launched" written first, a fleet on a journal failed a trial a
    # live worker was starting, and that worker crashed on its next write (UpdateFinishedTrialError)
    storage = WatchedStorage()
    study = optuna.create_study(storage=storage, directions=["maximize", "maximize", "minimize"])
    Tuner(_request(demo_spec, n_trials=3), study, FakeRunner(demo_spec), claims=MemoryClaims(),
          worker=Worker("host-a", 1)).run()
    assert len(storage.seen_at_launch) == 3
    assert all({"worker", "claim"} <= seen for seen in storage.seen_at_launch)


def _grid(req: TuneRequest) -> Iterator[dict[str, Any]]:
    keys = list(req.distributions)
    for values in itertools.product(*(_choices(req.distributions[k]) for k in keys)):
        yield dict(zip(keys, values, strict=True))
