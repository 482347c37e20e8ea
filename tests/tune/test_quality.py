"""Quality as an objective: measured once per KV class (a fake meter stands for llama-perplexity), told as the mean
KL divergence, kept in the study, and on the confirm runs' front beside speed and memory."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState

from fitter.errors import FitterError
from fitter.flags import KV_CACHE_TYPES, parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.search.request import candidate
from fitter.tune.confirm import final_front
from fitter.tune.quality_objective import QualityBook, kv_bytes, kv_class, widened_kv_types
from fitter.tune.study import Tuner
from tests.models import model_file
from tests.tune.test_study import FakeRunner, _request, _study

# made-up but ordered like llama.cpp's: the fewer bits per value, the larger the divergence
BITS = {"f32": 32, "f16": 16, "bf16": 16, "q8_0": 8.5, "q5_1": 6, "q5_0": 5.5, "q4_1": 5, "q4_0": 4.5, "iq4_nl": 4.5}


@pytest.fixture(scope="module")
def demo_spec() -> Any:
    return load_model_spec(str(model_file("gpt-oss-tiny")))


def fake_record(ctk: str, ctv: str) -> dict[str, Any]:
    kld = 0.0 if (ctk, ctv) == ("f16", "f16") else round(0.01 / BITS[ctk] + 0.02 / BITS[ctv], 6)
    return {"kv": f"{ctk}/{ctv}", "kld": kld, "kld_interval": [round(kld * 0.9, 6), round(kld * 1.1, 6)],
            "kld_p99": round(kld * 8, 6), "same_top_pct": round(100 - kld * 100, 3)}


class CountingMeter:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, ctk: str, ctv: str) -> dict[str, Any]:
        self.calls.append((ctk, ctv))
        return fake_record(ctk, ctv)


def test_each_kv_class_is_measured_once_and_kept_in_the_study(tmp_path: Path) -> None:
    study, meter = _study(tmp_path), CountingMeter()
    book = QualityBook(study, meter, {"tool": "llama-perplexity"})
    q8 = parse_launch_flags(["-ctk", "q8_0", "-ctv", "q8_0", "-ub", "256"])
    assert book.of(q8) == fake_record("q8_0", "q8_0")
    assert book.of(replace(q8, ubatch_size=1024, n_gpu_layers=3)) == fake_record("q8_0", "q8_0")  # pooled
    assert meter.calls == [("q8_0", "q8_0")]
    again = QualityBook(study, CountingMeter(), {})  # a resumed study, or another worker of a fleet
    assert again.of(q8)["kld"] == fake_record("q8_0", "q8_0")["kld"] and not again.meter.calls  # type: ignore[attr-defined]
    assert book.section() == {"tool": "llama-perplexity", "reference": "f16/f16",
                              "classes": {"q8_0/q8_0": fake_record("q8_0", "q8_0")}}


def test_quality_widens_the_kv_types_to_every_type_llama_cpp_takes() -> None:
    dists = {"cache-type-k": CategoricalDistribution(("f16", "q8_0")), "ubatch-size": IntDistribution(1, 4)}
    out = widened_kv_types(dists, tuple(KV_CACHE_TYPES))
    assert out["cache-type-k"] == CategoricalDistribution(
        ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"))
    assert "cache-type-v" not in out  # fixed by the user's flags: not searched, not widened
    assert out["ubatch-size"] == dists["ubatch-size"]


def test_kv_bytes_are_the_caches_bytes_with_its_types_and_with_f16(demo_spec: Any) -> None:
    config = parse_launch_flags(["-c", "4096", "-ctk", "q8_0", "-ctv", "q4_0", "-ngl", "99", "-sm", "tensor"])
    # the f16 cache: the estimator's (held to llama.cpp's logs by the goldens), half K, half V; q8_0 stores 34 bytes
    # per 32 values where f16 stores 64, q4_0 18; planned on the CPU, so -sm tensor without GPUs is no error here
    f16 = 1310720
    assert kv_bytes(demo_spec, config) == {"this": f16 // 2 * 34 // 64 + f16 // 2 * 18 // 64, "f16": f16}


def test_a_tune_with_quality_tells_each_trial_its_classes_divergence(tmp_path: Path, demo_spec: Any) -> None:
    objectives = ("tg", "pp", "vram", "quality")
    req = _request(demo_spec, n_trials=10, objectives=objectives)
    req = replace(req, distributions=widened_kv_types(req.distributions, tuple(KV_CACHE_TYPES)))
    study, meter = _study(tmp_path, objectives), CountingMeter()
    tuner = Tuner(req, study, FakeRunner(demo_spec), quality=QualityBook(study, meter, {}))
    tuner.run()
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert done
    classes = set()
    for t in done:
        kv = kv_class(candidate(req, dict(t.params)).config)
        classes.add(kv)
        assert t.values[3] == fake_record(*kv.split("/"))["kld"]
        assert t.user_attrs["quality"] == fake_record(*kv.split("/"))
    assert sorted(meter.calls) == sorted(tuple(c.split("/")) for c in classes)  # once per class, never again
    assert len(meter.calls) == len(set(meter.calls))


def _entry(trial: int, tg: float, kv: str, vram: int = 80) -> dict[str, Any]:
    return {"trial": trial, "phase": "neighbour", "flags": [], "vram_bytes": vram,
            "quality": fake_record(*kv.split("/")),
            "measurement": {"outcome": "ok", "tg": {"avg_ts": tg}, "pp": {"avg_ts": 100.0}}}


def test_the_front_keeps_a_slower_config_that_costs_less_quality() -> None:
    f16 = _entry(1, 100.0, "f16/f16")
    q4 = _entry(2, 120.0, "q4_0/q4_0")
    q4_slower = _entry(3, 110.0, "q4_0/q4_0")
    front, dropped = final_front(("tg", "pp", "quality"), [f16, q4, q4_slower], [])
    assert [e["trial"] for e in front] == [1, 2]
    assert dropped == [{"trial": 3, "flags": [], "outcome": "dominated",
                        "reason": "its confirm runs are dominated by trial 2's"}]
    front, _ = final_front(("tg", "pp"), [f16, q4, q4_slower], [])  # without quality, f16's cost is not counted
    assert [e["trial"] for e in front] == [2]


def test_quality_on_a_simulated_machine_is_refused(demo_spec: Any) -> None:
    from fitter.tune.options import MeasureOptions, SearchOptions, TuneOptions, check_workload

    o = TuneOptions(model="m.gguf", spec=demo_spec, base=parse_launch_flags([]),
                    search=SearchOptions(objectives=("tg", "quality")),
                    measure=MeasureOptions(backend="sim", machine="gpu-8gb"))
    with pytest.raises(FitterError, match=r"^--objectives quality: measured with llama.cpp's llama-perplexity on the "
                       r"model's output; --backend sim runs no model \(a simulated machine or a replayed landscape "
                       r"cannot measure quality\): tune on this machine's llama.cpp$"):
        check_workload(o)


def test_a_class_whose_quality_cannot_be_measured_fails_its_trials_and_the_study_goes_on(tmp_path: Path,
                                                                                         demo_spec: Any) -> None:
    objectives = ("tg", "pp", "vram", "quality")
    req = _request(demo_spec, n_trials=6, objectives=objectives)

    def meter(ctk: str, ctv: str) -> dict[str, Any]:
        if "q8_0" in (ctk, ctv):
            raise FitterError("-ctk q8_0: not a KV cache type of the build of /b/llama-perplexity; it takes f16")
        return fake_record(ctk, ctv)

    study = _study(tmp_path, objectives)
    Tuner(req, study, FakeRunner(demo_spec), quality=QualityBook(study, meter, {})).run()
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert failed and done
    assert {t.user_attrs["reason"] for t in failed} == {
        "quality: -ctk q8_0: not a KV cache type of the build of /b/llama-perplexity; it takes f16"}
    assert all("q8_0" not in kv_class(candidate(req, dict(t.params)).config) for t in done)


def test_a_tie_in_speed_goes_to_the_config_that_costs_less_quality_but_min_vram_to_less_vram() -> None:
    from fitter.results.pareto import Entry, picks

    def entry(trial: int, kv: str, vram: int) -> Entry:
        rounds = [100.0, 101.0, 99.0]
        m = {"outcome": "ok", "tg": {"avg_ts": 100.0}, "pp": {"avg_ts": 100.0},
             "confirm": {"rounds": 3, "round_avg_ts": {"tg": rounds, "pp": rounds}}}
        return Entry.from_json({"trial": trial, "flags": [], "vram_bytes": vram,
                                "quality": fake_record(*kv.split("/")), "measurement": m}, "p.json")

    chosen = picks([entry(1, "q4_0/q4_0", 60), entry(2, "f16/f16", 80), entry(3, "q8_0/q8_0", 70)])
    assert chosen == {"max-decode": 2, "max-prefill": 2, "balanced": 2, "min-vram": 1}
