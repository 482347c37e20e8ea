"""Intervals of ratios from paired rounds, ties, and the picks they resolve."""

from __future__ import annotations

import math
from typing import Any

import pytest

from fitter.noise import better_beyond_noise, between_run_sd, ratio_interval, relative_spread, t975, tied
from fitter.results.pareto import Entry, picks


def test_t975_is_students_quantile_and_the_normal_beyond_the_table() -> None:
    assert t975(1) == 12.706 and t975(3) == 3.182 and t975(30) == 2.042 and t975(31) == 1.96
    with pytest.raises(ValueError, match="at least 1"):
        t975(0)


def test_the_interval_is_a_t_interval_over_the_rounds_paired_log_ratios() -> None:
    a, b = [110.0, 121.0, 99.0, 115.0], [100.0, 110.0, 90.0, 100.0]
    logs = [math.log(x / y) for x, y in zip(a, b, strict=True)]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    point, lo, hi = ratio_interval(a, b)  # type: ignore[misc]
    assert point == pytest.approx(math.exp(mean), rel=1e-12)
    assert lo == pytest.approx(math.exp(mean - 3.182 * sd / 2), rel=1e-12)
    assert hi == pytest.approx(math.exp(mean + 3.182 * sd / 2), rel=1e-12)
    # the first three rounds are exactly 1.1×: no spread, so a zero-width interval
    assert ratio_interval(a[:3], b[:3]) == pytest.approx((1.1, 1.1, 1.1))


def test_drift_that_moves_every_config_of_a_round_alike_cancels_in_the_ratio() -> None:
    drift = [1.0, 0.7, 1.3, 0.9]  # a job beside the tune: every round's speed scaled, each config alike
    a, b = [120 * d for d in drift], [100 * d for d in drift]
    assert ratio_interval(a, b) == pytest.approx((1.2, 1.2, 1.2))
    assert better_beyond_noise(a, b) and not better_beyond_noise(b, a)
    assert relative_spread(b) == pytest.approx(0.6 / 0.975)


def test_one_round_or_a_failed_value_has_no_interval_and_so_no_tie() -> None:
    assert ratio_interval([100.0], [100.0]) is None
    assert ratio_interval([100.0, 0.0], [100.0, 90.0]) is None
    assert not tied({"tg": [100.0]}, {"tg": [100.0]})
    with pytest.raises(ValueError, match="differ in number"):
        ratio_interval([1.0, 2.0], [1.0])


def test_a_tie_needs_every_speed_within_noise() -> None:
    a = {"tg": [100.0, 104.0, 97.0], "pp": [500.0, 510.0, 490.0]}
    b = {"tg": [101.0, 100.0, 99.0], "pp": [400.0, 405.0, 395.0]}
    assert tied(a, b, ("tg",)) and not tied(a, b, ("tg", "pp"))
    assert between_run_sd([1.0, 3.0]) == pytest.approx(math.sqrt(2)) and between_run_sd([5.0]) == 0.0


def _entry(trial: int, tg: list[float], pp: list[float], vram: int, distance: int = 1,
           phase: str = "neighbour") -> Entry:
    m: dict[str, Any] = {"outcome": "ok", "tg": {"avg_ts": sum(tg) / len(tg)}, "pp": {"avg_ts": sum(pp) / len(pp)},
                         "confirm": {"rounds": len(tg), "repetitions": 3, "round_avg_ts": {"tg": tg, "pp": pp}}}
    return Entry.from_json({"trial": trial, "flags": [], "measurement": m, "vram_bytes": vram, "phase": phase,
                            "defaults_distance": distance}, "pareto.json")


def test_a_tie_in_decode_goes_to_less_vram_then_to_llama_cpps_defaults() -> None:
    fast = _entry(1, [130.0, 120.0, 140.0], [500.0, 500.0, 500.0], 80)
    close = _entry(2, [125.0, 126.0, 128.0], [450.0, 450.0, 450.0], 60)  # within noise of 1's decode, less VRAM
    slow = _entry(3, [100.0, 101.0, 99.0], [600.0, 600.0, 600.0], 70)  # beyond noise: no tie
    p = picks([fast, close, slow])
    assert p["max-decode"] == 2
    assert p["max-prefill"] == 3 and p["min-vram"] == 2
    # the same VRAM: llama.cpp's own choice wins the tie (defaults_distance -1), then the fewest changed flags
    base = _entry(0, [126.0, 127.0, 127.0], [450.0, 450.0, 450.0], 60, distance=-1, phase="baseline")
    assert picks([fast, close, base, slow])["max-decode"] == 0
    assert picks([fast, _entry(4, [125.0, 126.0, 128.0], [450.0] * 3, 60, 2), close])["max-decode"] == 2


def test_without_rounds_the_picks_are_the_estimates_as_before() -> None:
    one = [_entry(1, [130.0], [500.0], 80), _entry(2, [129.0], [450.0], 60)]
    assert picks(one)["max-decode"] == 1


def test_bad_intervals_or_ties_in_a_result_are_one_line_errors() -> None:
    from fitter.results.measurement import ResultError

    with pytest.raises(ResultError, match=r"pareto\.json: trial 3: \"intervals\" must map tg/pp to \[low, high\]"):
        Entry.from_json({"trial": 3, "intervals": {"tg": [1.0]}}, "pareto.json")
    with pytest.raises(ResultError, match=r"pareto\.json: trial 3: \"ties\" must be a list of trial numbers"):
        Entry.from_json({"trial": 3, "ties": ["x"]}, "pareto.json")


def test_one_hiccup_round_is_clipped_so_a_config_does_not_tie_with_everything() -> None:
    from fitter.noise import hampel_clipped

    # the README run's trials 1 and 27: 27 ran at 39 t/s in round 3 while the rest of that round ran normally
    one, other = [142.5, 160.5, 150.3, 153.1], [128.0, 132.8, 38.9, 134.6]
    logs = [math.log(x / y) for x, y in zip(one, other, strict=True)]
    med = sorted(logs)[1] / 2 + sorted(logs)[2] / 2
    mad = sorted(abs(x - med) for x in logs)[1] / 2 + sorted(abs(x - med) for x in logs)[2] / 2
    clipped = hampel_clipped(logs)
    assert clipped[:2] == logs[:2] and clipped[3] == logs[3] and clipped[2] == pytest.approx(med + 3 * 1.4826 * mad)
    # trial 1 decodes faster beyond noise (the whole interval above 1); unclipped, the interval was 0.59-4.09
    assert ratio_interval(one, other) == pytest.approx((1.21147, 1.02371, 1.43366), abs=1e-5)
    assert not tied({"tg": one}, {"tg": other}, ("tg",))
    assert hampel_clipped([0.1, 0.1, 0.1, 0.5]) == [0.1, 0.1, 0.1, 0.5]  # MAD 0: nothing to scale by
    assert hampel_clipped([0.1, 5.0]) == [0.1, 5.0]  # two rounds: no median to trust
