"""Interleaved confirm rounds, the drift monitor and pooling by physics, on the study tests' fake runner (speeds are
a deterministic function of the config; a drift factor per call stands for a machine whose speed moves)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from fitter.flags import LaunchConfig
from fitter.flags.pin import pin
from fitter.measure.types import BenchSpec, Measurement, SpeedStats, TrialResult
from fitter.search.pooling import RULES, pool_key
from fitter.search.request import candidate
from fitter.tune.baseline import Baseline
from fitter.tune.confirm import Contender, annotate, drift_record, final_front, pooled, run_rounds
from fitter.tune.study import Tuner
from tests.tune.test_study import FakeRunner, _request, _study, speeds


@dataclass
class DriftingRunner(FakeRunner):
    """The fake machine with a speed that moves per call (another job starting and stopping beside the tune)."""

    drift: list[float] = field(default_factory=list)
    specs: list[BenchSpec] = field(default_factory=list)

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None,
            plan: Any = None) -> TrialResult:
        self.specs.append(spec)
        result = super().run(model, config, spec, timeout, plan)
        factor = self.drift[(len(self.runs) - 1) % len(self.drift)] if self.drift else 1.0
        m = result.measurement

        def scaled(s: SpeedStats | None) -> SpeedStats | None:
            return None if s is None else SpeedStats.from_ns(s.n, s.depth, [round(x / factor) for x in s.samples_ns])

        pp = scaled(m.pp) if spec.n_prompt else None
        tg = scaled(m.tg) if spec.n_gen else None
        return replace(result, measurement=replace(m, pp=pp, tg=tg))


@pytest.fixture(scope="module")
def demo_spec() -> Any:
    from fitter.gguf.model_spec import load_model_spec
    from tests.models import model_file

    return load_model_spec(str(model_file("gpt-oss-tiny")))


def _contenders(req: Any, n: int) -> list[Contender]:
    out = []
    for i, ncmoe in enumerate(range(n)):
        params = {"n-cpu-moe": ncmoe, "ubatch-size": 512, "batch-size": 2048, "cache-type-k": "f16",
                  "cache-type-v": "f16", "threads": 4, "flash-attn": "on"}
        out.append(Contender(i + 1, "neighbour", candidate(req, params), None))
    return out


def test_each_round_runs_every_contender_once_in_a_fresh_seeded_order(demo_spec: Any) -> None:
    req = _request(demo_spec)
    runner = DriftingRunner(demo_spec)
    pool = _contenders(req, 3)
    run_rounds(req, runner, pool, 4, lambda _: None)
    order = [[c.trial for c in sorted(pool, key=lambda c: c.positions[k])] for k in range(4)]
    assert all(sorted(o) == [1, 2, 3] for o in order)
    assert len({tuple(o) for o in order}) > 1  # not the same order every round
    assert all(len(c.runs) == 4 and [m["round"] for m in c.runs] == [1, 2, 3, 4] for c in pool)
    again = _contenders(req, 3)
    run_rounds(req, DriftingRunner(demo_spec), again, 4, lambda _: None)
    assert [c.positions for c in again] == [c.positions for c in pool]  # seeded: the same orders again


def test_a_contender_failing_a_round_is_dropped_and_not_run_again(demo_spec: Any) -> None:
    req = _request(demo_spec)

    @dataclass
    class FailsOnce(DriftingRunner):
        def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None,
                plan: Any = None) -> TrialResult:
            if len(self.runs) >= 3 and "crash" not in self.runs and "-ncmoe 1" in " ".join(pin(config, given=True)):
                self.runs.append("crash")
                return TrialResult(Measurement("crash", "exit 139", spec, ()))
            return super().run(model, config, spec, timeout, plan)

    pool = _contenders(req, 3)
    runner = FailsOnce(demo_spec)
    run_rounds(req, runner, pool, 3, lambda _: None)
    failed = [c for c in pool if c.failed]
    assert [c.trial for c in failed] == [2]
    assert failed[0].failed is not None and failed[0].failed["reason"] == "round 2: exit 139"
    assert len(runner.runs) == 3 + 3 + 2  # round 3 runs the two left


def test_the_pooled_measurement_keeps_every_round_and_the_highest_peak() -> None:
    def run(tg: list[float], peak: int, k: int) -> dict[str, Any]:
        return {"outcome": "ok", "round": k, "tg": {"n": 16, "depth": 0, "avg_ts": sum(tg) / len(tg),
                                                    "stddev_ts": 0.0, "samples_ts": tg},
                "peak_vram": {"RPC0": {"bytes": peak, "source": "emulator"}}}

    m = pooled([run([10.0, 12.0], 100, 1), run([8.0, 8.0], 120, 2)], 2)
    assert m["tg"]["samples_ts"] == [10.0, 12.0, 8.0, 8.0] and m["tg"]["avg_ts"] == 9.5
    assert m["tg"]["stddev_ts"] == pytest.approx(math.sqrt(11 / 3))
    assert m["peak_vram"]["RPC0"]["bytes"] == 120 and "round" not in m
    assert m["confirm"] == {"rounds": 2, "repetitions": 2, "round_avg_ts": {"tg": [11.0, 8.0], "pp": []}}


def _entry(trial: int, tg: list[float], pp: list[float], vram: int, phase: str = "neighbour") -> dict[str, Any]:
    return {"trial": trial, "phase": phase, "flags": [], "vram_bytes": vram,
            "measurement": {"outcome": "ok", "tg": {"avg_ts": sum(tg) / len(tg)}, "pp": {"avg_ts": sum(pp) / len(pp)},
                            "confirm": {"rounds": len(tg), "round_avg_ts": {"tg": tg, "pp": pp}}}}


def test_only_a_config_dominated_beyond_noise_leaves_the_front() -> None:
    base = _entry(0, [100.0, 90.0, 110.0], [500.0, 450.0, 550.0], 80, "baseline")
    tied_but_higher = _entry(1, [101.0, 89.0, 112.0], [505.0, 452.0, 560.0], 80)  # ≥ the baseline, within noise
    clearly = _entry(2, [130.0, 117.0, 143.0], [600.0, 540.0, 660.0], 70)  # faster beyond noise, less VRAM
    front, dropped = final_front(("tg", "pp", "vram"), [base, tied_but_higher, clearly], [])
    assert [e["trial"] for e in front] == [2]
    assert [d["trial"] for d in dropped] == [1]  # the baseline is never reported as dropped
    assert dropped[0]["reason"] == "its confirm runs are dominated by trial 2's"
    front, _ = final_front(("tg", "pp"), [base, tied_but_higher], [])
    assert [e["trial"] for e in front] == [0, 1]  # neither beats the other beyond noise: both stay


def test_ratios_carry_their_interval_and_ties_name_the_configs_within_noise() -> None:
    base = _entry(0, [100.0, 90.0, 110.0], [500.0, 450.0, 550.0], 80, "baseline")
    a = _entry(1, [101.0, 93.0, 108.0], [505.0, 452.0, 560.0], 80)
    b = _entry(2, [120.0, 108.0, 132.0], [400.0, 360.0, 440.0], 60)
    front = [base, a, b]
    annotate(("tg", "pp", "vram"), front, base["measurement"])
    assert b["ratios"] == {"tg": 1.2, "pp": 0.8} and b["intervals"] == {"tg": [1.2, 1.2], "pp": [0.8, 0.8]}
    assert a["ties"] == [0] and base["ties"] == [1] and b["ties"] == []
    lo, hi = a["intervals"]["tg"]
    assert lo < 1.0 < hi


def test_the_drift_monitor_says_when_the_baseline_moved_more_than_the_configs_differ() -> None:
    front = [{"phase": "neighbour", "ratios": {"tg": 1.05, "pp": 0.98}}]
    start = {"outcome": "ok", "tg": {"avg_ts": 100.0}, "pp": {"avg_ts": 500.0}}
    middle = {"outcome": "ok", "launched": 6, "tg": {"avg_ts": 80.0}, "pp": {"avg_ts": 495.0}}
    end = {"outcome": "ok", "tg": {"avg_ts": 90.0}, "pp": {"avg_ts": 505.0}}
    d = drift_record(start, middle, end, front)
    assert [p["at"] for p in d["baseline"]] == ["start", "middle", "end"] and d["baseline"][1]["launched"] == 6
    assert d["spread"] == {"tg": round(20 / 90, 4), "pp": round(10 / 500, 4)}
    assert d["differences"] == {"tg": 0.05, "pp": 0.02} and d["exceeds_differences"]
    assert d["note"].startswith("the baseline's tg moved 22% during the study, more than the front's configs differ")
    calm = drift_record(start, {**middle, "tg": {"avg_ts": 101.0}}, {**end, "tg": {"avg_ts": 99.0}}, front)
    assert not calm["exceeds_differences"] and "note" not in calm
    assert drift_record(start, None, None, front)["note"] == "no drift monitor: the baseline was measured once"


def test_a_tune_confirms_in_rounds_and_its_intervals_cover_the_true_ratio_under_drift(tmp_path: Path,
                                                                                      demo_spec: Any) -> None:
    from fitter.tune.baseline import run_baseline
    from fitter.tune.confirm import confirm, result_doc

    req = _request(demo_spec, n_trials=8)
    drift = [1.0, 0.8, 1.15, 0.9, 1.05, 0.75, 1.1]  # ±20 %: far more than the configs' differences
    runner = DriftingRunner(demo_spec, drift=drift)
    study = _study(tmp_path)
    tuner = Tuner(req, study, runner)
    base_params = {"n-cpu-moe": 2, "ubatch-size": 512, "batch-size": 2048, "cache-type-k": "f16",
                   "cache-type-v": "f16", "threads": 4, "flash-attn": "on"}
    base_cand = candidate(req, base_params)
    trial = tuner.ask()
    tuner.launch(trial, base_cand, tuner.screener(base_cand), "baseline")
    t = study.trials[0]
    baseline = Baseline({"name": "llama.cpp --fit", "trial": 0, "flags": t.user_attrs["flags"],
                         "measurement": t.user_attrs["measurement"]}, base_cand)
    assert run_baseline  # the session's path; here the baseline is placed by hand
    tuner.drift_probe = base_cand
    tuner.run()
    assert "drift_middle" in study.user_attrs and study.user_attrs["drift_middle"]["launched"] == 4
    entries, dropped, baseline = confirm(req, tuner, runner, baseline, lambda _: None, rounds=5)
    doc = result_doc(req, {}, {"commit": "fake"}, (16,), True, baseline, entries, dropped, tuner, 1.0, "sqlite://",
                     "pareto.json", rounds=5)
    base_true = speeds(base_cand.config, base_cand.spec, demo_spec)
    assert doc.data["confirm"]["rounds"] == 5 and doc.data["baseline"]["intervals"] == {"tg": [1.0, 1.0],
                                                                                        "pp": [1.0, 1.0]}
    assert len(doc.pareto) >= 2
    for e in doc.pareto:
        if e.phase == "baseline":
            continue
        cand = candidate(req, dict(study.trials[e.trial].params))
        true = speeds(cand.config, cand.spec, demo_spec)
        for i, k in enumerate(("pp", "tg")):
            lo, hi = e.intervals[k]
            assert lo <= true[i] / base_true[i] <= hi, (e.trial, k, e.intervals, true[i] / base_true[i])
    assert [p["at"] for p in doc.data["drift"]["baseline"]] == ["start", "middle", "end"]


def test_pooling_rules_name_llama_cpp_and_ignore_exactly_their_parameters(demo_spec: Any) -> None:
    assert {r.speed: r.ignores for r in RULES} == {"tg": ("batch-size", "ubatch-size", "threads-batch"),
                                                    "pp": ("threads",)}
    assert all("llama_context::graph_compute" in r.why for r in RULES)
    req = _request(demo_spec)
    p = {"n-cpu-moe": 1, "ubatch-size": 512, "batch-size": 2048, "cache-type-k": "f16", "cache-type-v": "f16",
         "threads": 4, "flash-attn": "on"}
    k = candidate(req, p)
    assert pool_key(candidate(req, {**p, "ubatch-size": 256}), "tg") == pool_key(k, "tg")
    assert pool_key(candidate(req, {**p, "ubatch-size": 256}), "pp") != pool_key(k, "pp")
    assert pool_key(candidate(req, {**p, "cache-type-k": "q8_0"}), "tg") != pool_key(k, "tg")
    assert pool_key(candidate(req, {**p, "n-cpu-moe": 2}), "tg") != pool_key(k, "tg")
    # -tb follows -t when it is neither searched nor given: then -t changes prefill and is kept in its key
    assert pool_key(candidate(req, {**p, "threads": 2}), "pp") != pool_key(k, "pp")
    assert pool_key(candidate(req, {**p, "threads": 2, "threads-batch": 4}), "pp") == pool_key(
        candidate(req, {**p, "threads-batch": 4}), "pp")


def test_a_config_whose_decode_class_was_measured_measures_prefill_only_and_pools_decode(tmp_path: Path,
                                                                                          demo_spec: Any) -> None:
    req = _request(demo_spec)
    runner = DriftingRunner(demo_spec)
    tuner = Tuner(req, _study(tmp_path), runner)
    p = {"n-cpu-moe": 1, "ubatch-size": 512, "batch-size": 2048, "cache-type-k": "f16", "cache-type-v": "f16",
         "threads": 4, "flash-attn": "on"}
    first = tuner.run_candidate(p, "test")
    second = tuner.run_candidate({**p, "ubatch-size": 256}, "test")
    assert first is not None and second is not None
    assert [s.n_gen for s in runner.specs] == [16, 0]  # the second launch measured prefill only
    tg = second.user_attrs["measurement"]["tg"]
    assert tg["pooled"]["trials"] == [first.number] and tg["pooled"]["own"] == 0
    assert tg["samples_ts"] == first.user_attrs["measurement"]["tg"]["samples_ts"]
    assert second.values[0] == first.values[0] and second.user_attrs["pooled"] == {"tg": [first.number]}
    pp = second.user_attrs["measurement"]["pp"]
    assert "pooled" not in pp and pp["avg_ts"] != first.user_attrs["measurement"]["pp"]["avg_ts"]
