"""The table `fitter tune` prints: ratios with their 95 % intervals, ties, and what each pick gains over llama.cpp's
own choice, or that it is a tie with it."""

from __future__ import annotations

from typing import Any

from fitter.results.pareto import ParetoDoc
from fitter.results.table import pareto_table, verdict_lines

MIB = 1024 * 1024


def _m(tg: float, pp: float, vram_mib: float) -> dict[str, Any]:
    return {"outcome": "ok", "tg": {"avg_ts": tg}, "pp": {"avg_ts": pp},
            "peak_vram": {"RPC0": {"bytes": int(vram_mib * MIB), "source": "emulator"}}}


def _doc(ties: list[int], intervals: dict[str, list[float]]) -> ParetoDoc:
    entry = {"trial": 3, "phase": "neighbour", "flags": ["-ub", "256", "-ncmoe", "8"], "measurement": _m(90, 400, 41.3),
             "vram_bytes": int(41.3 * MIB), "ratios": {"tg": 0.9, "pp": 0.8}, "intervals": intervals, "ties": ties}
    base = {"name": "llama.cpp --fit", "trial": 0, "flags": ["-ngl", "8"], "measurement": _m(100, 500, 78.6)}
    data = {"baseline": base, "pareto": [entry], "dropped": [],
            "picks": {"balanced": 3, "max-decode": 3, "max-prefill": 3, "min-vram": 3},
            "study": {"trials": 5, "launched": 4, "screened_out": 1, "answered_from_storage": 0, "pooled": 1,
                      "model_loads_this_run": 3, "wall_s": 12.0},
            "confirm": {"rounds": 4, "repetitions": 3},
            "drift": {"note": "the baseline's tg moved 30% during the study, more than the front's configs differ"}}
    return ParetoDoc.from_json(data, "pareto.json")


def test_the_table_shows_each_ratio_with_its_interval_and_the_ties() -> None:
    table = pareto_table(_doc([0], {"tg": [0.7, 1.15], "pp": [0.6, 1.05]}))
    row = next(line for line in table.splitlines() if line.lstrip().startswith("3 "))
    assert "0.800 [0.60–1.05]" in row and "0.900 [0.70–1.15]" in row and "(tie: base)" in row
    assert "1 pooled by physics" in table and "confirm: 4 interleaved rounds × 3 repetitions" in table
    assert table.splitlines()[-1] == ("drift: the baseline's tg moved 30% during the study, more than the front's "
                                      "configs differ")


def test_a_pick_tied_with_llama_cpps_choice_says_so_and_what_it_saves() -> None:
    lines = verdict_lines(_doc([0], {"tg": [0.7, 1.15], "pp": [0.6, 1.05]}))
    assert lines[0] == ("balanced: trial 3 is a tie with llama.cpp's own choice within noise (decode 0.90× (95 % CI "
                        "0.70–1.15), prefill 0.80× (95 % CI 0.60–1.05) of llama.cpp's own choice); it holds less VRAM "
                        "(41.3 vs 78.6 MiB)")


def test_a_pick_beyond_noise_gives_its_gain_with_the_interval() -> None:
    lines = verdict_lines(_doc([], {"tg": [0.85, 0.95], "pp": [0.7, 0.9]}))
    assert lines[0] == ("balanced: trial 3: decode 0.90× (95 % CI 0.85–0.95), prefill 0.80× (95 % CI 0.70–0.90) of "
                        "llama.cpp's own choice")


def test_a_pick_a_tie_moved_off_the_fastest_estimate_names_it_and_why() -> None:
    doc = _doc([0], {"tg": [0.7, 1.15], "pp": [0.6, 1.05]})
    fast = {"trial": 5, "phase": "neighbour", "flags": [], "measurement": _m(120, 550, 78.1),
            "vram_bytes": int(78.1 * MIB), "ratios": {"tg": 1.2, "pp": 1.1},
            "intervals": {"tg": [0.8, 1.8], "pp": [0.9, 1.3]}, "ties": [3]}
    data = {**doc.data, "pareto": [*doc.data["pareto"], fast]}
    lines = verdict_lines(ParetoDoc.from_json(data, "pareto.json"))
    assert lines[1].endswith("— within noise of trial 5, the fastest estimate (decode 1.20× (95 % CI 0.80–1.80), "
                             "prefill 1.10× (95 % CI 0.90–1.30)); the tie went to less VRAM")
