"""Recorded landscapes (fitter/grid/landscape.py): the file round-trips, bad files are one line naming the file and
the rule, the summary and which configs are within noise of the best."""

from __future__ import annotations

import copy
import errno
import json
from pathlib import Path
from typing import Any

import pytest

from fitter.grid.landscape import (
    LandscapeError,
    best_within_noise,
    load_landscape,
    param_key,
    parse_landscape,
    write_landscape,
)
from fitter.paths import WriteError
from tests.disks import refused_writes


def _run(tg: list[float], pp: list[float], round_index: int, outcome: str = "ok") -> dict[str, Any]:
    run: dict[str, Any] = {"outcome": outcome, "reason": "" if outcome == "ok" else "out of memory", "flags": [],
                           "round": round_index, "at": 1700000000.0 + round_index, "loadavg": [1.5, 1.2, 1.0],
                           "load_s": 0.5, "wall_s": 2.0, "buffers": [], "peak_vram": {}}
    if outcome == "ok":
        for test, samples in (("tg", tg), ("pp", pp)):
            run[test] = {"n": 8, "depth": 0, "avg_ts": sum(samples) / len(samples), "stddev_ts": 0.0,
                         "samples_ts": samples}
    return run


def _point(ub: int, tg_runs: list[list[float]], screened: str | None = None) -> dict[str, Any]:
    return {"params": {"ubatch-size": ub}, "flags": ["-ub", str(ub), "-t", "2", "-tb", "2"], "screened": screened,
            "baseline": False,
            "runs": [] if screened else [_run(tg, [x * 10 for x in tg], i) for i, tg in enumerate(tg_runs)]}


def doc() -> dict[str, Any]:
    return {
        "landscape": 1,
        "model": {"name": "demo", "identity": "abc123", "arch": "gpt-oss", "path": "/m/demo.gguf"},
        "machine": {"fingerprint": "f00d", "cpu": "test"}, "llama_cpp": {"commit": "0c1e570", "source": "test"},
        "emulated_gpu_mib": None, "devices": [], "rpc": [], "fit_target_mib": [1024],
        "bench": {"p": 64, "n": 8, "d": 0, "r": 2}, "threads": {"t": None, "tb": None},
        "target": {"physical_cores": 2, "performance_cores": 2, "default_threads": 2, "host_budget": 1 << 30},
        "cpu_profile": {"repack_types": [["Q4_0", 8]], "description": "x86-64 AVX2"},
        "space": "shipped:cpu", "distributions": {"ubatch-size": [256, 512, 1024, 2048]},
        "fixed_flags": ["-c", "4096"], "for": "llama-server", "rounds": 3, "seed": 0,
        "points": [
            _point(256, [[100.0, 101.0], [99.0, 100.0], [101.0, 100.0]]),  # mean 100.1667: the best
            _point(512, [[100.0, 100.0], [99.0, 99.5], [100.5, 100.5]]),  # mean 99.9167: within noise
            _point(1024, [[80.0, 81.0], [79.0, 80.0], [80.0, 80.0]]),  # mean 80: clearly slower
            _point(2048, [], screened="RPC0 over budget by 3.0 MiB"),
        ],
    }


def test_a_landscape_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "l.json"
    land = parse_landscape(doc(), "mem")
    write_landscape(path, land)
    again = load_landscape(path)
    assert again.to_json() == land.to_json()
    assert [f.name for f in path.parent.iterdir()] == ["l.json"]  # written beside, then moved over
    p = again.point({"ubatch-size": 512})
    assert p is not None and p.flags == ("-ub", "512", "-t", "2", "-tb", "2") and len(p.runs) == 3
    assert p.runs[1]["loadavg"] == [1.5, 1.2, 1.0] and p.rounds_done() == {0, 1, 2}
    screened = again.point({"ubatch-size": 2048})
    assert screened is not None and screened.screened == "RPC0 over budget by 3.0 MiB" and screened.runs == ()
    assert again.point({"ubatch-size": 4096}) is None and again.baseline is None
    assert again.bench == {"p": 64, "n": 8, "d": 0, "r": 2} and again.fixed_flags == ("-c", "4096")


def test_a_landscape_the_disk_refuses_keeps_the_last_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "l.json"
    land = parse_landscape(doc(), "mem")
    write_landscape(path, land)
    before = path.read_bytes()
    with refused_writes(tmp_path, errno.ENOSPC), pytest.raises(WriteError) as e:
        write_landscape(path, parse_landscape({**doc(), "rounds": 4}, "mem"))
    assert str(e.value) == f"{path}: disk full (No space left on device)"
    assert path.read_bytes() == before and [f.name for f in tmp_path.iterdir()] == ["l.json"]


def test_summary_is_the_mean_of_the_run_means_with_each_run() -> None:
    land = parse_landscape(doc(), "mem")
    tg = land.summary("tg")
    assert set(tg) == {param_key({"ubatch-size": u}) for u in (256, 512, 1024)}  # the screened one has no run
    mean, runs = tg[param_key({"ubatch-size": 1024})]
    assert runs == [80.5, 79.5, 80.0] and mean == 80.0
    assert land.summary("pp")[param_key({"ubatch-size": 1024})][1] == [805.0, 795.0, 800.0]


def test_best_within_noise_keeps_what_the_runs_cannot_tell_apart() -> None:
    land = parse_landscape(doc(), "mem")
    assert best_within_noise(land, "tg") == {param_key({"ubatch-size": 256}), param_key({"ubatch-size": 512})}
    assert best_within_noise(land, "pp") == {param_key({"ubatch-size": 256}), param_key({"ubatch-size": 512})}


def test_failed_runs_count_for_no_speed() -> None:
    d = doc()
    d["points"][0]["runs"].append(_run([], [], 3, outcome="oom"))
    land = parse_landscape(d, "mem")
    assert land.summary("tg")[param_key({"ubatch-size": 256})][1] == [100.5, 99.5, 100.5]


def _broken(change: Any) -> dict[str, Any]:
    d = copy.deepcopy(doc())
    change(d)
    return d


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(landscape=2), "landscape must be 1 (this fitter reads format 1) (got 2)"),
    (lambda d: d.pop("bench"), "bench is missing"),
    (lambda d: d["bench"].update(r=0), 'bench must be {p, n, d, r}: integers >= 0, r >= 1 (got {"p": 64, "n": 8, '
     '"d": 0, "r": 0})'),
    (lambda d: d["points"][1]["runs"][2].update(outcome="meh"),
     "points[1].runs[2].outcome must be one of ok, oom, crash, timeout (got \"meh\")"),
    (lambda d: d["points"][0]["runs"][0]["tg"].update(samples_ts=[]),
     "points[0].runs[0].tg.samples_ts must be a non-empty list of speeds > 0 (got [])"),
    (lambda d: d["points"][3].update(runs=[_run([1.0], [1.0], 0)]),
     "points[3].runs must be empty for a screened config (it was never launched) (got 1)"),
    (lambda d: d["points"].append(copy.deepcopy(d["points"][0])),
     'points must name each config once (got "{\\"ubatch-size\\": 256}")'),
    (lambda d: d["devices"].append({"name": "CUDA0", "kind": "metal", "total_bytes": 1, "free_bytes": 1}),
     'devices[0].kind must be "cuda" or "rpc" (got "metal")'),
])
def test_a_bad_landscape_is_one_line_naming_the_file_the_rule_and_the_value(tmp_path: Path, change: Any,
                                                                            message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_broken(change)))
    with pytest.raises(LandscapeError) as e:
        load_landscape(path)
    assert str(e.value) == f"{path}: {message}"


def test_a_file_that_is_not_json_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(LandscapeError, match=r"bad\.json: not valid JSON: Expecting property name") as e:
        load_landscape(path)
    assert "\n" not in str(e.value)
    with pytest.raises(LandscapeError, match=r"missing\.json: cannot read the landscape: No such file"):
        load_landscape(tmp_path / "missing.json")
