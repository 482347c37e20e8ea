"""A measured quality record as results read it: what a pick's KV types cost, and a record that is not one."""

from __future__ import annotations

import pytest

from fitter.results.measurement import ResultError
from fitter.results.pareto import Entry
from fitter.results.quality_record import describe, kv_note, kv_of_flags, quality_beyond_noise, record_problem

Q8 = {"kv": "q8_0/q8_0", "kld": 0.0012, "kld_interval": [0.001, 0.0014], "kld_p99": 0.0113, "same_top_pct": 99.61}
Q4 = {"kv": "q4_0/q4_0", "kld": 0.0151, "kld_interval": [0.0139, 0.0163], "kld_p99": 0.12, "same_top_pct": 96.2}


def test_a_pick_says_what_its_kv_types_cost_and_save() -> None:
    saved = {"this": 557056, "f16": 1048576}
    assert kv_note("q8_0/q8_0", Q8, saved) == ("q8_0/q8_0 KV: KLD 0.0012 [0.001–0.0014], 99 % KLD 0.0113, 99.6 % "
                                               "same top token; saves 0.5 MiB of KV cache against f16")
    assert kv_note("q8_0/f16", None, None) == ("q8_0/f16 KV: its cost in quality was not measured (--objectives "
                                               "...,quality measures it with llama-perplexity)")
    assert kv_note("f16/f16", None, saved) is None  # llama.cpp's own cache: nothing to say


def test_the_kv_class_of_a_pinned_line() -> None:
    assert kv_of_flags(["-c", "4096", "-ctk", "q8_0", "--cache-type-v", "q4_0", "-fa", "on"]) == "q8_0/q4_0"
    assert kv_of_flags(["-c", "4096"]) == "f16/f16"


def test_quality_differs_beyond_noise_only_where_the_intervals_part() -> None:
    assert quality_beyond_noise(Q8, Q4) and not quality_beyond_noise(Q4, Q8)
    near = {**Q8, "kld": 0.0013, "kld_interval": [0.0012, 0.0015]}
    assert not quality_beyond_noise(Q8, near)
    assert describe(Q4) == "KLD 0.0151 [0.0139–0.0163], 99 % KLD 0.12, 96.2 % same top token"


def test_a_result_with_a_broken_quality_record_is_refused_naming_the_trial() -> None:
    assert record_problem(Q8) is None
    assert record_problem({"kld": "low"}) == "lacks the numbers kld, kld_p99, same_top_pct, kld_interval"
    with pytest.raises(ResultError, match=r'trial 3: "quality" lacks the numbers kld_interval$'):
        Entry.from_json({"trial": 3, "quality": {**Q8, "kld_interval": [0.1]}}, "r/pareto.json")
    e = Entry.from_json({"trial": 3, "quality": Q8, "kv_bytes": {"this": 1, "f16": 2}}, "r/pareto.json")
    assert e.quality == Q8 and e.kv_bytes == {"this": 1, "f16": 2}
