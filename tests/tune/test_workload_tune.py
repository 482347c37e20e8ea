"""`fitter tune` under a workload: every trial measured at each depth and stream count, pareto.json recording the
workload and each config's speeds against depth, `fitter check` repeating it; refused before anything starts where
the target cannot serve it or the context cannot hold it. On a simulated machine (seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.errors import FitterError
from fitter.flags import parse_launch_flags
from fitter.gguf.demo_models import demo_model_path
from fitter.gguf.model_spec import load_model_spec
from fitter.results.table import pareto_table
from fitter.tune.options import TuneOptions
from fitter.tune.session import run_tune
from fitter.workload import Workload, load_workload, serving_config
from tests.tune.options import tune_options

ROUNDS, REPS = 2, 2


def _options(tmp_path: Path, workload: Workload, flags: list[str], **kw: object) -> TuneOptions:
    model = str(demo_model_path())
    base = serving_config(workload, parse_launch_flags(flags))
    return tune_options(model=model, spec=load_model_spec(model), base=base, workload=workload, trials=4,
                       repetitions=REPS, confirm_rounds=ROUNDS, results=tmp_path / "r", **kw)  # type: ignore[arg-type]


def fitter(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fitter.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("deep")
    w = Workload(n_prompt=256, n_gen=32, depths=(0, 8192), weights=(1.0, 3.0))
    outcome = run_tune(_options(tmp, w, ["-c", "16384"], backend="sim", machine="gpu-8gb"), None)
    assert outcome.folder is not None
    return outcome.folder


def test_the_result_records_the_workload_and_each_configs_speeds_at_each_depth(deep: Path) -> None:
    doc = json.loads((deep / "pareto.json").read_text())
    assert doc["workload"] == {"prompt": 256, "gen": 32, "depths": [0, 8192], "weights": [1.0, 3.0],
                               "concurrency": 1, "source": "flags", "description": ""}
    for m in [e["measurement"] for e in doc["pareto"]]:
        assert m["workload"] == doc["workload"]
        assert [d["depth"] for d in m["depths"]] == [0, 8192]
        for test in ("pp", "tg"):
            per_depth = [d[test] for d in m["depths"]]
            # every depth pooled over the confirm rounds like the combination itself
            assert [len(s["samples_ts"]) for s in per_depth] == [ROUNDS * REPS] * 2
            assert len(m[test]["samples_ts"]) == ROUNDS * REPS
            # a quarter of the tokens at depth 0, three quarters at 8192: the combination of the pooled samples
            combined = [1 / (0.25 / a + 0.75 / b) for a, b in zip(*(s["samples_ts"] for s in per_depth), strict=True)]
            assert m[test]["samples_ts"] == pytest.approx(combined, rel=1e-6)
            assert per_depth[1]["avg_ts"] < per_depth[0]["avg_ts"]  # attention reads grow with the cache


def test_the_table_shows_speed_against_depth(deep: Path) -> None:
    from fitter.results.pareto import load_result

    text = pareto_table(load_result(deep))
    assert "workload flags — pp and tg are their tokens over their time at the depths" in text
    assert f"{'trial':>5}  {'test':<5}{'d 0':>11}{'d 8192':>11}" in text


def test_check_repeats_the_workload(deep: Path) -> None:
    proc = fitter("check", str(deep), "--json", cwd=deep)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    verdict = json.loads(proc.stdout)
    assert "workload: -p 256 -n 32 -d 0,8192 (weights 1,3), as recorded (flags)" in verdict["lines"]
    new = verdict["measurement"]
    assert [d["depth"] for d in new["depths"]] == [0, 8192] and new["workload"]["weights"] == [1.0, 3.0]


def test_a_served_team_is_measured_as_concurrent_streams(tmp_path: Path) -> None:
    w = load_workload("team-server")
    outcome = run_tune(_options(tmp_path, w, ["-c", "32768"], backend="sim", machine="gpu-8gb"), None)
    assert outcome.result is not None
    doc = outcome.result.data
    assert doc["workload"]["concurrency"] == 4
    for e in doc["pareto"]:
        assert e["flags"][e["flags"].index("-np") + 1] == "4"  # a slot per stream, pinned
        m = e["measurement"]
        assert m["tg_stream"]["avg_ts"] == pytest.approx(m["tg"]["avg_ts"] / 4, rel=1e-6)
        assert len(m["ttft"]["samples_ms"]) == ROUNDS * REPS
    text = pareto_table(outcome.result)
    assert f"{'trial':>5}  {'tg t/s':>9} {'per stream':>10} {'TTFT ms':>9}" in text


def test_per_stream_decode_and_time_to_first_token_are_objectives_of_their_own(tmp_path: Path) -> None:
    w = Workload(n_prompt=128, n_gen=32, concurrency=4)
    outcome = run_tune(_options(tmp_path, w, ["-c", "8192"], backend="sim", machine="gpu-8gb",
                                objectives=("tg", "tg-stream", "ttft")), None)
    assert outcome.result is not None and outcome.folder is not None
    doc = outcome.result.data
    assert doc["objectives"] == ["tg", "tg-stream", "ttft"]
    import optuna

    study = optuna.load_study(study_name="fitter", storage=f"sqlite:///{outcome.folder / 'study.db'}")
    done = [t for t in study.trials if t.values is not None]
    assert done and all(len(t.values) == 3 for t in done)
    for t in done:  # the study's values are the measured aggregate, per-stream decode and time to first token
        m = t.user_attrs["measurement"]
        assert t.values == [m["tg"]["avg_ts"], m["tg_stream"]["avg_ts"], m["ttft"]["avg_ms"]]
    for e in doc["pareto"]:  # each round's per-stream decode and time to first token, for the front's noise test
        confirm = e["measurement"]["confirm"]
        assert len(confirm["round_avg_ts"]["tg_stream"]) == len(confirm["round_avg_ms"]["ttft"]) == ROUNDS


def test_stream_objectives_without_streams_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FitterError, match=r"^--objectives tg-stream,ttft: measured with several streams served at "
                                          r"once: give --concurrency N \(N >= 2\) or a workload with concurrency$"):
        run_tune(_options(tmp_path, Workload(), [], backend="sim", machine="gpu-8gb",
                          objectives=("tg", "tg-stream", "ttft")), None)


def test_streams_on_fitters_worker_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(FitterError, match=r"^shipped:team-server: 4 concurrent streams are served by llama-server: "
                                          r"give your build with --llama-cpp DIR"):
        run_tune(_options(tmp_path, load_workload("team-server"), ["-c", "32768"]), None)
    assert not (tmp_path / "r").exists()


def test_a_context_that_cannot_hold_the_deepest_test_is_refused_before_anything_starts(tmp_path: Path) -> None:
    w = Workload(depths=(0, 8192))
    with pytest.raises(FitterError, match=r"^flags: depth 8192 \+ max\(prompt 512, gen 128\) = 8704 cells, but a "
                                          r"slot of -c 8192 holds 8192; give a larger -c$"):
        run_tune(_options(tmp_path, w, ["-c", "8192"], backend="sim", machine="gpu-8gb"), None)
    assert not (tmp_path / "r").exists()


def test_a_workload_file_and_the_flags_it_sets_are_refused_together(tmp_path: Path) -> None:
    proc = fitter("tune", "--backend", "sim", "--machine", "gpu-8gb", "--workload", "long-chat", "-d", "0",
                  "--results", str(tmp_path / "r"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("fitter: error: --workload long-chat and -d: the workload file sets them; give one "
                                   "or the other")


def test_bench_measures_a_workload_and_shows_each_depth(tmp_path: Path) -> None:
    args = ("bench", "--backend", "sim", "--machine", "gpu-8gb", "-c", "16384", "-d", "0,4096", "--concurrency", "2")
    proc = fitter(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tokens over depths 0,4096, 2 streams aggregate, 3 runs)" in proc.stdout
    assert "first token of 2 prompts sent at once" in proc.stdout and "  depth   4096: pp " in proc.stdout
    out = json.loads(fitter(*args, "--json", cwd=tmp_path).stdout)
    assert [d["depth"] for d in out["depths"]] == [0, 4096] and out["workload"]["concurrency"] == 2
    assert "-np" in out["flags"] and out["flags"][out["flags"].index("-np") + 1] == "2"


def test_the_dry_run_names_the_workload(tmp_path: Path) -> None:
    proc = fitter("tune", "--backend", "sim", "--machine", "gpu-8gb", "--workload", "team-server", "-c", "32768",
                  "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("workload: -p 512 -n 128 -d 0,4096 ×4 streams (shipped:team-server)\nspace ")
