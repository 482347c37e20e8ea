"""`fitter grid` (fitter/grid/record.py) on a simulated machine, and its landscapes replayed (fitter/grid/replay.py):
interleaved rounds, resumption, refusals, replay drawing only recorded samples, a replayed tune end to end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fitter.errors import FitterError
from fitter.flags import parse_flags, parse_launch_flags
from fitter.gguf.demo_models import demo_model_path
from fitter.gguf.model_spec import load_model_spec
from fitter.grid import NotRecorded, ReplayRunner, load_landscape, param_key
from fitter.grid.landscape import Landscape, Point
from fitter.grid.record import _label, record_landscape, round_order
from fitter.grid.replay_tune import run_replay
from fitter.measure.types import BenchSpec
from fitter.tune.options import TuneOptions
from fitter.workload import Workload
from tests.tune.options import tune_options, with_options

LANDSCAPES = Path(__file__).resolve().parents[2] / "landscapes"


def _options(**kw: Any) -> TuneOptions:
    model = str(demo_model_path())
    base: dict[str, Any] = {"model": model, "spec": load_model_spec(model), "base": parse_launch_flags(["-c", "4096"]),
                            "backend": "sim", "machine": "cpu-16c", "workload": Workload(n_prompt=64, n_gen=8),
                            "repetitions": 2}
    return tune_options(**{**base, **kw})


def _run_lines(logs: list[str]) -> list[tuple[int, str]]:
    """(round, config label) of each `grid: round i/K, run n/N: LABEL: speeds` line."""
    out = []
    for line in logs:
        if line.startswith("grid: round "):
            _, where, label, _ = line.split(": ")
            out.append((int(where.split()[1].split("/")[0]) - 1, label))
    return out


def test_each_round_is_a_fresh_permutation_of_every_feasible_config(tmp_path: Path) -> None:
    logs: list[str] = []
    land, path = record_landscape(_options(), None, rounds=3, out=tmp_path / "l.json", log=logs.append)
    assert path == tmp_path / "l.json" and load_landscape(path).to_json() == land.to_json()
    feasible = [p for p in land.points if p.screened is None]
    # the cpu space: 32 combinations, 8 refused by llama.cpp (a q8_0 V cache without flash attention); + the baseline
    assert len(land.points) == 33 and len(feasible) == 25 and land.baseline is not None
    assert {p.screened for p in land.points if p.screened} == {
        "-ctv q8_0 with -fa off: a quantized V cache requires flash attention (src/llama-context.cpp); use -fa on or "
        "-ctv f16"}
    lines = _run_lines(logs)
    assert len(lines) == 75
    label = {p.key: _label(p) for p in land.points}
    orders = []
    for i in range(3):
        order = [label[k] for k in round_order([p.key for p in feasible], 0, i)]
        assert [lab for r, lab in lines if r == i] == order and sorted(order) == sorted(label[p.key] for p in feasible)
        orders.append(order)
    assert orders[0] != orders[1] != orders[2] != orders[0]
    for p in feasible:
        assert [r["round"] for r in p.runs] == [0, 1, 2] and all(r["outcome"] == "ok" for r in p.runs)
        assert all(len(r["tg"]["samples_ts"]) == 2 and len(r["loadavg"]) == 3 for r in p.runs)
    assert land.baseline.flags == ("-c", "4096", "-t", "16", "-tb", "16") and land.baseline.params == {}


def test_an_interrupted_grid_continues_where_it_stopped(tmp_path: Path) -> None:
    out = tmp_path / "l.json"
    first, _ = record_landscape(_options(), None, rounds=2, out=out, max_runs=10)
    kept = {p.key: p.runs for p in first.points if p.runs}
    assert sum(len(r) for r in kept.values()) == 10
    logs: list[str] = []
    land, _ = record_landscape(_options(), None, rounds=2, out=out, log=logs.append)
    assert "fitter: continuing " + str(out) + ": 10 runs recorded" in logs
    assert len(_run_lines(logs)) == 40  # 25 configs × 2 rounds, less the 10 already there
    for p in land.points:
        assert p.runs[:len(kept.get(p.key, ()))] == kept.get(p.key, ())  # the recorded runs are kept as they were
        assert [r["round"] for r in p.runs] == ([] if p.screened else [0, 1])
    # a third round later: only the round each config lacks
    logs.clear()
    land, _ = record_landscape(_options(), None, rounds=3, out=out, log=logs.append)
    assert len(_run_lines(logs)) == 25 and land.rounds == 3


def test_a_landscape_of_other_settings_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "l.json"
    record_landscape(_options(), None, rounds=1, out=out, max_runs=1)
    before = out.read_bytes()
    with pytest.raises(FitterError) as e:
        record_landscape(_options(repetitions=3), None, rounds=1, out=out)
    assert str(e.value) == (f"{out}: recorded for another bench settings ({{'p': 64, 'n': 8, 'd': 0, 'r': 2}}), this "
                            "run has {'p': 64, 'n': 8, 'd': 0, 'r': 3}: give another --out, or the settings it was "
                            "recorded with")
    with pytest.raises(FitterError, match=r"recorded for another machine \(32750b196347ca49\), this run has "):
        record_landscape(_options(machine="gpu-8gb"), None, rounds=1, out=out)
    with pytest.raises(FitterError, match=r"recorded for another flags \(\['-c', '4096'\]\), this run has "
                                          r"\['-c', '8192'\]"):
        record_landscape(_options(base=parse_launch_flags(["-c", "8192"])), None, rounds=1, out=out)
    assert out.read_bytes() == before


# -- replay -----------------------------------------------------------------------------------------------------


def _distinct(land: Landscape) -> Landscape:
    """`land` with every run's samples made distinct (the simulator repeats a config's noise exactly)."""
    points = []
    for pi, p in enumerate(land.points):
        runs = []
        for ri, run in enumerate(p.runs):
            run = json.loads(json.dumps(run))
            for t, base in (("tg", 1000.0), ("pp", 5000.0)):
                run[t]["samples_ts"] = [base + pi + 0.1 * ri + 0.01 * j for j in range(len(run[t]["samples_ts"]))]
                run[t]["avg_ts"] = sum(run[t]["samples_ts"]) / len(run[t]["samples_ts"])
            runs.append(run)
        points.append(replace(p, runs=tuple(runs)))
    return replace(land, points=tuple(points))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Landscape:
    land, _ = record_landscape(_options(), None, rounds=3, out=tmp_path_factory.mktemp("grid") / "l.json")
    return _distinct(land)


def _trial(land: Landscape, p: Point, reps: int) -> tuple[Any, BenchSpec]:
    config, process = parse_flags(p.flags)
    b = land.bench
    return config, BenchSpec(b["p"], b["n"], b["d"], reps, threads=process.threads or 1,
                             threads_batch=process.threads_batch)


def test_replay_draws_whole_recorded_runs_seeded(recorded: Landscape) -> None:
    p = recorded.point({"ubatch-size": 512, "batch-size": 2048, "cache-type-k": "f16", "cache-type-v": "f16",
                        "threads": 16, "flash-attn": "on"})
    assert p is not None and len(p.runs) == 3
    config, spec = _trial(recorded, p, 2)
    runs = {(tuple(r["tg"]["samples_ts"]), tuple(r["pp"]["samples_ts"])) for r in p.runs}
    runner = ReplayRunner(recorded, seed=1)
    drawn = [runner.run("m", config, spec, None).measurement for _ in range(30)]
    assert all(m.outcome == "ok" and (m.tg.samples_ts, m.pp.samples_ts) in runs for m in drawn)  # type: ignore[union-attr]
    assert len({m.tg.samples_ts for m in drawn}) == 3  # type: ignore[union-attr]  # every run comes up
    # one model load: the first trial's (the drawn run's load time, or the landscape's median when it had reused its
    # model), then the loaded model is reused
    assert runner.model_loads == 1 and drawn[0].load_s and {m.load_s for m in drawn[1:]} == {0.0}
    again = ReplayRunner(recorded, seed=1)
    assert [again.run("m", config, spec, None).measurement.tg for _ in range(30)] == [m.tg for m in drawn]
    other = ReplayRunner(recorded, seed=2)
    assert [other.run("m", config, spec, None).measurement.tg for _ in range(30)] != [m.tg for m in drawn]


def test_more_repetitions_than_recorded_are_drawn_from_the_configs_recorded_ones(recorded: Landscape) -> None:
    p = recorded.baseline
    assert p is not None
    config, spec = _trial(recorded, p, 5)
    pool = {x for r in p.runs for x in r["tg"]["samples_ts"]}
    own = {tuple(r["tg"]["samples_ts"]) for r in p.runs}
    runner = ReplayRunner(recorded)
    for _ in range(10):
        tg = runner.run("m", config, spec, None).measurement.tg
        assert tg is not None and len(tg.samples_ts) == 5 and tg.samples_ts[:2] in own and set(tg.samples_ts) <= pool
    config, spec = _trial(recorded, p, 1)
    tg = runner.run("m", config, spec, None).measurement.tg
    assert tg is not None and len(tg.samples_ts) == 1 and tg.samples_ts[0] in {s[0] for s in own}


def test_a_recorded_failure_replays_as_itself(recorded: Landscape) -> None:
    p = recorded.points[1]
    oom = {**p.runs[0], "outcome": "oom", "reason": "out of memory allocating the kv buffer",
           "oom": {"stage": "kv", "buft": "CPU", "bytes": 1024}}
    del oom["tg"], oom["pp"]
    land = replace(recorded, points=(recorded.points[0], replace(p, runs=(oom,)), *recorded.points[2:]))
    config, spec = _trial(land, p, 2)
    m = ReplayRunner(land).run("m", config, spec, None).measurement
    assert (m.outcome, m.reason, m.pp, m.tg) == ("oom", "out of memory allocating the kv buffer", None, None)
    assert m.oom is not None and (m.oom.stage, m.oom.buft, m.oom.requested_bytes) == ("kv", "CPU", 1024)


def test_a_config_never_measured_is_named_not_invented(recorded: Landscape) -> None:
    screened = next(p for p in recorded.points if p.screened)
    config, spec = _trial(recorded, recorded.points[1], 2)
    runner = ReplayRunner(recorded)
    with pytest.raises(NotRecorded, match=r"is not a config of .*l\.json \(outside its space shipped:cpu\)"):
        runner.run("m", replace(config, ubatch_size=64), spec, None)
    with pytest.raises(NotRecorded, match=r"-t 3 -tb 3 is not a config of"):
        runner.run("m", config, replace(spec, threads=3, threads_batch=3), None)
    with pytest.raises(FitterError, match=r"recorded with -p 64 -n 8 -d 0, this trial asks for -p 512"):
        runner.run("m", config, replace(spec, n_prompt=512), None)
    assert screened.key == param_key(screened.params)


def test_a_replayed_tune_writes_its_result_from_recorded_runs_only(recorded: Landscape, tmp_path: Path) -> None:
    from fitter.grid.landscape import write_landscape

    path = tmp_path / "l.json"
    write_landscape(path, recorded)
    o = _options(backend="replay", landscape=str(path), machine=None, base=parse_launch_flags([]), trials=6,
                 results=tmp_path / "r", repetitions=3)
    outcome = run_replay(o)
    assert outcome.folder is not None and (outcome.folder / "pareto.json").is_file()
    doc = json.loads((outcome.folder / "pareto.json").read_text())
    assert doc["study"]["launched"] == 6 and doc["machine"]["replay"] == str(path)
    assert outcome.folder.parts[-2:] == (f"replay-fitter-demo-gpt-oss-{doc['machine']['fingerprint'][:8]}",
                                         "sim-cpu-16c")
    recorded_tg = {x for p in recorded.points for r in p.runs for x in r["tg"]["samples_ts"]}
    for m in [doc["baseline"]["measurement"], *(e["measurement"] for e in doc["pareto"])]:
        assert m["backend"] == "replay" and len(m["tg"]["samples_ts"]) == 4 * 2  # 4 confirm rounds × r
        assert set(m["tg"]["samples_ts"]) <= recorded_tg
    with pytest.raises(FitterError, match=r"l\.json: recorded with the flags '-c 4096', this tune gives '-c 8192'"):
        run_replay(replace(o, base=parse_launch_flags(["-c", "8192"])))
    with pytest.raises(FitterError, match=r"recorded with the space shipped:cpu, this tune gives other\.toml"):
        run_replay(with_options(o, space="other.toml"))


@pytest.mark.parametrize("name", ["demo-cpu.json", "demo-emulated-96mib.json"])
def test_the_recorded_landscapes_replay_end_to_end(name: str, tmp_path: Path) -> None:
    model = str(demo_model_path())
    land = load_landscape(LANDSCAPES / name)
    assert land.model["identity"] == load_model_spec(model).identity  # the demo model is the recorded one
    o = tune_options(model=model, spec=load_model_spec(model), base=parse_launch_flags([]), backend="replay",
                    landscape=str(LANDSCAPES / name), trials=6, results=tmp_path)
    outcome = run_replay(o)
    assert outcome.folder is not None and (outcome.folder / "pareto.json").is_file()
    doc = json.loads((outcome.folder / "pareto.json").read_text())
    assert doc["study"]["launched"] == 6 and doc["baseline"]["measurement"]["outcome"] == "ok" and doc["pareto"]
