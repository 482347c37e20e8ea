"""`fitter report` on studies built without running llama.cpp (trials made with optuna.trial.create_trial, with the
attributes fitter's tune writes), and once on a real `fitter tune` result."""

from __future__ import annotations

import argparse
import csv
import errno
import importlib.util
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from fitter.cli.results import cmd_report
from fitter.errors import FitterError
from fitter.report import dashboard_command, load_study_result, write_report
from fitter.report.figures import FEW_TRIALS
from fitter.results.trials import write_trials_csv
from tests.disks import refused_writes

MIB = 1024 * 1024
GPU = "CUDA0"
PNG = b"\x89PNG\r\n\x1a\n"
DISTRIBUTIONS = {"n-cpu-moe": IntDistribution(0, 8), "ubatch-size": CategoricalDistribution((256, 512, 1024)),
                 "cache-type-k": CategoricalDistribution(("f16", "q8_0"))}
DIRECTIONS = {"tg": "maximize", "pp": "maximize", "vram": "minimize"}


def measurement(pp: float, tg: float, vram_mib: float | None, outcome: str = "ok") -> dict[str, Any]:
    """A bench JSON as fitter records it (CONTRACTS.md); no pp/tg on a failed outcome."""
    m: dict[str, Any] = {"outcome": outcome, "reason": "", "flags": [], "emulated": False, "backend": "sim"}
    if outcome == "ok":
        m["pp"] = {"n": 32, "avg_ts": pp, "stddev_ts": 1.0, "samples_ts": [pp, pp]}
        m["tg"] = {"n": 8, "depth": 0, "avg_ts": tg, "stddev_ts": 1.0, "samples_ts": [tg, tg]}
    if vram_mib is not None:
        m["peak_vram"] = {GPU: {"bytes": int(vram_mib * MIB), "source": "nvml"}}
        m["devices"] = {GPU: {"total": int(vram_mib * MIB), "estimated_total": int(vram_mib * MIB)},
                        "CPU": {"total": 100 * MIB, "estimated_total": 100 * MIB}}
    return m


def new_study(folder: Path, objectives: list[str]) -> optuna.Study:
    folder.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(storage=f"sqlite:///{folder / 'study.db'}", study_name="fitter",
                                directions=[DIRECTIONS[o] for o in objectives])
    for k, v in {"model_identity": "abc", "machine_fingerprint": "def", "llama_cpp_commit": "0c1e570",
                 "objectives": objectives}.items():
        study.set_user_attr(k, v)
    return study


def add(study: optuna.Study, state: TrialState, phase: str, *, m: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None, launched: bool = True, predicted_mib: float | None = None,
        constraint: float | None = None, reason: str = "", **attrs: Any) -> None:
    """One trial as fitter's Tuner tells it: objective values from the measurement, constraints as system attrs."""
    objectives = study.user_attrs["objectives"]
    params = params or {}
    ua: dict[str, Any] = {"phase": phase, "launched": launched, "reason": reason,
                          "flags": ["-c", "4096", *(f for k, v in params.items() for f in (f"--{k}", str(v))),
                                    "-t", "1", "-tb", "1"], "key": " ".join(f"{k}={v}" for k, v in params.items()),
                          **attrs}
    if m is not None:
        ua["measurement"] = m
        if launched:
            ua["outcome"] = m["outcome"]
    if predicted_mib is not None:
        ua["predicted_bytes"] = {GPU: int(predicted_mib * MIB), "CPU": 50 * MIB}
    values = None
    if state == TrialState.COMPLETE:
        assert m is not None
        vram = m["peak_vram"][GPU]["bytes"] if "peak_vram" in m else 0
        if "same_as" not in attrs:  # an answer from storage copies the measurement only (fitter/tune/study.py)
            ua["vram_bytes"] = vram
        values = [{"tg": m["tg"]["avg_ts"], "pp": m["pp"]["avg_ts"], "vram": round(vram / MIB, 3)}[o]
                  for o in objectives]
    system = {f"constraints:vram:{GPU}": constraint} if constraint is not None else {}
    study.add_trial(create_trial(state=state, values=values, params=params,
                                 distributions={k: DISTRIBUTIONS[k] for k in params}, user_attrs=ua,
                                 system_attrs=system))


def p(ncmoe: int, ub: int = 512, ctk: str = "f16") -> dict[str, Any]:
    return {"n-cpu-moe": ncmoe, "ubatch-size": ub, "cache-type-k": ctk}


def check_files(out: Path, names: list[str]) -> None:
    for name in names:
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, name
        if name.endswith(".png"):
            assert path.read_bytes()[:8] == PNG, name
    page = (out / "report.html").read_text()
    assert "plotly" in page and '<script src="http' not in page  # plotly.js inlined: works offline
    assert page.count("Plotly.newPlot") >= 1


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


# -- a finished study: failures, screened-out and out-of-memory trials, answers from storage, pareto.json ---------


def finished_study(folder: Path) -> None:
    s = new_study(folder, ["tg", "pp", "vram"])
    add(s, TrialState.COMPLETE, "baseline", m=measurement(600, 120, 78), predicted_mib=78, constraint=0.0)
    add(s, TrialState.COMPLETE, "decode-first", m=measurement(400, 150, 70), params=p(5), predicted_mib=70,
        constraint=-10.0)
    add(s, TrialState.PRUNED, "prefill-first", params=p(1, 1024), launched=False, predicted_mib=92.5,
        constraint=12.5, reason="predicted over budget: CUDA0 by 12.5 MiB")
    add(s, TrialState.FAIL, "min-vram", m=measurement(0, 0, None, "crash"), params=p(8), predicted_mib=41,
        reason="crash: signal 11")
    add(s, TrialState.PRUNED, "neighbour", m=measurement(0, 0, None, "oom"), params=p(4), predicted_mib=79,
        constraint=3.0, reason="oom: CUDA0 buffer of 4 MiB", oom_margin_bytes=2 * MIB)
    add(s, TrialState.COMPLETE, "tpe", m=measurement(650, 130, 75), params=p(6, 256), predicted_mib=75,
        constraint=-5.0)
    add(s, TrialState.COMPLETE, "tpe", m=measurement(650, 130, 75), params=p(6, 256), predicted_mib=75,
        constraint=-5.0, same_as=5)
    add(s, TrialState.COMPLETE, "tpe", m=measurement(300, 100, 79), params=p(7, 512, "q8_0"), predicted_mib=79.5,
        constraint=-0.5)
    doc = {"objectives": ["tg", "pp", "vram"], "fit_target_mib": [1024],
           "baseline": {"name": "llama.cpp --fit", "trial": 0, "flags": ["-ngl", "99", "-t", "1", "-tb", "1"],
                        "measurement": measurement(500, 100, 78)},
           "pareto": [{"trial": 1, "phase": "decode-first", "flags": ["-ncmoe", "5", "-ub", "512"],
                       "measurement": measurement(420, 140, 70), "vram_bytes": 70 * MIB,
                       "ratios": {"pp": 0.84, "tg": 1.4}},
                      {"trial": 5, "phase": "tpe", "flags": ["-ncmoe", "6", "-ub", "256"],
                       "measurement": measurement(640, 125, 75), "vram_bytes": 75 * MIB,
                       "ratios": {"pp": 1.28, "tg": 1.25}}],
           "dropped": [{"trial": 7, "flags": [], "outcome": "dominated",
                        "reason": "its confirm run is dominated by trial 1's"}],
           "picks": {"max-decode": 1, "max-prefill": 5, "balanced": 5, "min-vram": 1},
           "study": {"trials": 8}}
    (folder / "pareto.json").write_text(json.dumps(doc))


def test_finished_study_with_failures_and_screened_trials(tmp_path: Path) -> None:
    folder = tmp_path / "results" / "model" / "machine" / "build"
    finished_study(folder)
    report = write_report(load_study_result(folder), folder / "report")
    out = folder / "report"
    check_files(out, ["trials.csv", "pareto.csv", "decode-vs-vram.png", "history-tg.png", "history-pp.png",
                      "history-vram.png", "importance-tg.png", "importance-pp.png", "importance-vram.png",
                      "memory.png", "report.html"])
    trials = rows(out / "trials.csv")
    assert [r["number"] for r in trials] == [str(i) for i in range(8)]  # one row per trial
    assert [r["outcome"] for r in trials] == ["ok", "ok", "screened", "crash", "oom", "ok", "ok", "ok"]
    assert [r["state"] for r in trials][2:5] == ["PRUNED", "FAIL", "PRUNED"]
    assert trials[2]["launched"] == "False" and trials[2]["violation_mib"] == "12.5"
    assert trials[2]["predicted_vram_mib"] == "92.5" and trials[2]["reason"].startswith("predicted over budget")
    assert trials[3]["reason"] == "crash: signal 11" and trials[3]["tg_ts"] == ""
    assert trials[6]["same_as"] == "5" and trials[5]["same_as"] == "" and trials[6]["vram_mib"] == "75.0"
    # the front of pareto.json: the baseline's confirm run, then each entry with its ratios, exactly
    front = rows(out / "pareto.csv")
    assert [r["trial"] for r in front] == ["base", "1", "5"]
    assert [(r["pp_ratio"], r["tg_ratio"]) for r in front] == [("1.0", "1.0"), ("0.84", "1.4"), ("1.28", "1.25")]
    assert [r["picks"] for r in front] == ["", "max-decode,min-vram", "max-prefill,balanced"]
    assert [r["tg_ts"] for r in front] == ["100.0", "140.0", "125.0"]  # confirm runs, not the trials
    assert report.front.source == "pareto.json" and report.front.dropped[0]["trial"] == 7
    # 3 distinct complete trials of the space (no baseline, no answer from storage): importances are noise
    assert any("only 3 distinct complete trials" in n and str(FEW_TRIALS) in n for n in report.notes)
    assert "WARNING: 3 trials" in (out / "report.html").read_text()


def test_cmd_report_prints_tables_and_where_the_files_went(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "r"
    finished_study(folder)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "optuna_dashboard" else find_spec(name, *a))
    out = tmp_path / "elsewhere"
    assert cmd_report(argparse.Namespace(result=str(folder / "pareto.json"), out=str(out), json=False)) == 0
    stdout, stderr = capsys.readouterr()
    assert "Pareto front (confirm runs, pareto.json)" in stdout and "max-decode,min-vram" in stdout
    assert "crash: signal 11" in stdout and "screened" in stdout
    assert f"report: {out}" in stdout and "decode-vs-vram.png" in stdout
    assert f"optuna-dashboard sqlite:///{(folder / 'study.db').resolve()}" in stdout
    assert "fitter: warning: parameter importances: only 3" in stderr
    assert (out / "memory.png").is_file() and not (folder / "report").exists()
    assert cmd_report(argparse.Namespace(result=str(folder), out=None, json=True)) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["out"] == str(folder / "report") and len(doc["trials"]) == 8
    assert [r["trial"] for r in doc["pareto"]] == ["base", 1, 5] and doc["dashboard"].startswith("optuna-dashboard")



def test_a_report_the_disk_refuses_keeps_the_old_files_and_names_the_one(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    finished_study(folder)
    out = folder / "report"
    write_report(load_study_result(folder), out)
    page = (out / "report.html").read_bytes()
    # the page's temporary file (.report.html.*.tmp): the last of the report's writes
    with refused_writes(out / ".report.html", errno.ENOSPC), pytest.raises(FitterError) as e:
        write_report(load_study_result(folder), out)
    assert str(e.value) == f"{out / 'report.html'}: disk full (No space left on device)"
    assert (out / "report.html").read_bytes() == page and not list(out.glob(".*"))  # the old page, no temporary file

def test_dashboard_command_only_when_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    finished_study(tmp_path)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "optuna_dashboard" else find_spec(name, *a))
    assert dashboard_command(load_study_result(tmp_path)) is None


# -- a running study: a RUNNING trial, no pareto.json yet ----------------------------------------------------------


def test_running_study_reports_the_studys_own_front_over_the_baseline_trial(tmp_path: Path) -> None:
    s = new_study(tmp_path, ["tg", "pp", "vram"])
    add(s, TrialState.COMPLETE, "baseline", m=measurement(500, 100, 78), predicted_mib=78, constraint=0.0)
    add(s, TrialState.COMPLETE, "decode-first", m=measurement(400, 150, 70), params=p(5), predicted_mib=70,
        constraint=-10.0)
    add(s, TrialState.COMPLETE, "prefill-first", m=measurement(600, 90, 60), params=p(3, 1024), predicted_mib=60,
        constraint=-20.0)
    add(s, TrialState.COMPLETE, "neighbour", m=measurement(300, 80, 79), params=p(7), predicted_mib=79,
        constraint=-1.0)
    # measured, but over budget (the baseline is launched whatever the estimate): never on the front
    add(s, TrialState.COMPLETE, "tpe", m=measurement(900, 200, 50), params=p(2, 256), predicted_mib=50,
        constraint=5.0)
    add(s, TrialState.RUNNING, "tpe", params=p(4))
    report = write_report(load_study_result(tmp_path), tmp_path / "report")
    assert report.front.source == "study"
    front = rows(tmp_path / "report" / "pareto.csv")
    assert [r["trial"] for r in front] == ["base", "0", "1", "2"]
    assert [(r["pp_ratio"], r["tg_ratio"]) for r in front] == [("1.0", "1.0"), ("1.0", "1.0"), ("0.8", "1.5"),
                                                               ("1.2", "0.9")]
    assert front[2]["picks"] == "max-decode,min-vram" and "max-prefill" in front[3]["picks"]
    trials = rows(tmp_path / "report" / "trials.csv")
    assert len(trials) == 6 and trials[5]["state"] == "RUNNING" and trials[5]["outcome"] == "running"
    assert any("RUNNING" in n for n in report.notes) and any("no pareto.json" in n for n in report.notes)
    check_files(tmp_path / "report", ["decode-vs-vram.png", "history-tg.png", "memory.png", "importance-pp.png"])


def test_a_study_with_no_finished_trial_skips_every_figure(tmp_path: Path) -> None:
    s = new_study(tmp_path, ["tg", "pp", "vram"])
    add(s, TrialState.RUNNING, "baseline")
    report = write_report(load_study_result(tmp_path), tmp_path / "report")
    assert not list((tmp_path / "report").glob("*.png")) and report.front.rows == []
    assert len(rows(tmp_path / "report" / "trials.csv")) == 1
    assert any(n.startswith("decode vs VRAM: skipped") for n in report.notes)
    assert any(n.startswith("parameter importances: skipped, 0 distinct") for n in report.notes)
    assert "plotly" not in (tmp_path / "report" / "report.html").read_text()  # no figure, no 4 MB of JS


# -- a single objective, CPU only -----------------------------------------------------------------------------


def test_single_objective_study(tmp_path: Path) -> None:
    s = new_study(tmp_path, ["tg"])
    add(s, TrialState.COMPLETE, "baseline", m=measurement(500, 100, None))
    for i, (pp, tg) in enumerate([(400, 110), (450, 130), (300, 120)]):
        add(s, TrialState.COMPLETE, "tpe", m=measurement(pp, tg, None), params=p(i + 2, (256, 512, 1024)[i]))
    add(s, TrialState.FAIL, "tpe", m=measurement(0, 0, None, "timeout"), params=p(8), reason="timeout after 60 s")
    report = write_report(load_study_result(tmp_path), tmp_path / "report")
    out = tmp_path / "report"
    check_files(out, ["decode-vs-vram.png", "history-tg.png", "importance-tg.png", "report.html"])
    assert not (out / "history-pp.png").exists() and not (out / "memory.png").exists()
    assert any(n.startswith("predicted vs measured memory: skipped") for n in report.notes)
    front = rows(out / "pareto.csv")
    assert [r["trial"] for r in front] == ["base", "2"] and front[1]["tg_ratio"] == "1.3"
    assert len(rows(out / "trials.csv")) == 5


# -- importances that cannot be computed --------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "why"), [
    ([p(5)], "skipped, 1 distinct COMPLETE trial"),
    ([p(5), p(5), p(5)], "skipped, every parameter took one value"),
])
def test_importances_skipped_when_meaningless(tmp_path: Path, params: list[dict[str, Any]], why: str) -> None:
    s = new_study(tmp_path, ["tg", "pp"])
    for i, x in enumerate(params):
        add(s, TrialState.COMPLETE, "tpe", m=measurement(400 + i, 100 + i, 10), params=x)
    report = write_report(load_study_result(tmp_path), tmp_path / "report")
    assert any(why in n for n in report.notes), report.notes
    assert not list((tmp_path / "report").glob("importance-*.png"))
    assert (tmp_path / "report" / "history-pp.png").is_file()


# -- what is not a fitter study ------------------------------------------------------------------------------------


def test_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FitterError, match=f"{tmp_path / 'nope'}: no such results folder"):
        load_study_result(tmp_path / "nope")
    with pytest.raises(FitterError, match=f"{tmp_path}: no study.db there"):
        load_study_result(tmp_path)
    (tmp_path / "study.db").write_text("hello")
    with pytest.raises(FitterError, match=f"{tmp_path / 'study.db'}: not an SQLite database"):
        load_study_result(tmp_path)
    (tmp_path / "study.db").unlink()
    con = sqlite3.connect(tmp_path / "study.db")
    con.execute("CREATE TABLE notes (x TEXT)")
    con.commit()
    con.close()
    before = (tmp_path / "study.db").read_bytes()
    with pytest.raises(FitterError, match=r"without Optuna's tables \(it has: notes\); not a fitter study"):
        load_study_result(tmp_path)
    assert (tmp_path / "study.db").read_bytes() == before  # nothing added to someone else's database


def test_an_optuna_study_that_is_not_fitters(tmp_path: Path) -> None:
    optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="other")
    with pytest.raises(FitterError, match=r"study 'other' is not a fitter study \(no model_identity"):
        load_study_result(tmp_path / "study.db")
    optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="another")
    with pytest.raises(FitterError, match=r"no study named 'fitter' \(studies there: "):
        load_study_result(tmp_path)
    (tmp_path / "pareto.json").write_text("{")
    new_study(tmp_path, ["tg"])
    with pytest.raises(FitterError, match=f"{tmp_path / 'pareto.json'}: not a readable pareto.json"):
        load_study_result(tmp_path)


# -- a real tune result ----------------------------------------------------------------------------------------------


@pytest.mark.llama
@pytest.mark.tools("llama-fit-params")
def test_report_on_a_real_tune_result(tmp_path: Path, llama_tools: dict[str, Path]) -> None:
    proc = subprocess.run([sys.executable, "-m", "fitter.cli", "tune", "--trials", "4", "-p", "32", "-n", "8", "-r",
                           "2", "-c", "4096", "--results", str(tmp_path / "results"), "--llama-fit-params",
                           str(llama_tools["llama-fit-params"])], capture_output=True, text=True, timeout=900,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (pareto,) = (tmp_path / "results").glob("*/*/*/pareto.json")
    report = write_report(load_study_result(pareto.parent), pareto.parent / "report")
    doc = json.loads(pareto.read_text())
    assert report.front.source == "pareto.json"
    assert [r.trial for r in report.front.rows] == ["base", *(e["trial"] for e in doc["pareto"])]
    assert len(report.trials) == doc["study"]["trials"]
    check_files(pareto.parent / "report", ["decode-vs-vram.png", "history-tg.png", "memory.png", "trials.csv"])
    # the emulated GPU's own peak is what the estimator predicted, trial by trial
    launched = report.trials[report.trials["outcome"] == "ok"]
    assert (launched["measured_vram_mib"] == launched["predicted_vram_mib"]).all()


def test_the_report_and_the_tune_write_one_trials_csv(tmp_path: Path) -> None:
    folder = tmp_path / "results" / "model" / "machine" / "build"
    finished_study(folder)
    result = load_study_result(folder)
    write_report(result, folder / "report")
    tuned = write_trials_csv(tmp_path, result.study)  # what `fitter tune` writes beside study.db
    assert tuned.read_text() == (folder / "report" / "trials.csv").read_text()
    header = next(csv.reader(tuned.open()))
    assert header == ["number", "state", "phase", "launched", "outcome", "reason", "pp_ts", "tg_ts", "vram_mib",
                      "predicted_vram_mib", "measured_vram_mib", "violation_mib", "same_as", "values_0", "values_1",
                      "values_2", "params_cache-type-k", "params_n-cpu-moe", "params_ubatch-size", "datetime_start",
                      "duration", "flags"]
    trials = rows(tuned)
    assert [(r["values_0"], r["params_n-cpu-moe"]) for r in trials[:2]] == [("120.0", ""), ("150.0", "5.0")]


def test_the_front_text_shows_each_ratio_with_its_interval_and_ties() -> None:
    from fitter.report.tables import pareto_text
    from fitter.results.table import Front, FrontRow

    row = FrontRow(5, "neighbour", ("balanced",), 582.8, 135.9, 78.1, None, {"pp": 0.945, "tg": 1.186},
                   {"pp": (0.83, 1.07), "tg": (0.94, 1.49)}, (0, 3), ("-c", "4096", "-ub", "256", "-ncmoe", "6"))
    line = pareto_text(Front([row], "pareto.json", baseline_trial=0)).splitlines()[2]
    assert line == ("    5      582.8    135.9      78.1  0.945 [0.83–1.07]    1.186 [0.94–1.49]    "
                    "balanced (tie: base, 3): -ub 256 -ncmoe 6")


def test_a_study_whose_objectives_are_not_fitters_is_refused(tmp_path: Path) -> None:
    # the figures are files named after the objectives: a foreign study.db must not name them
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="fitter",
                                directions=["maximize"])
    for k, v in {"model_identity": "abc", "machine_fingerprint": "def", "llama_cpp_commit": "0c1e570",
                 "objectives": ["../../../escape"]}.items():
        study.set_user_attr(k, v)
    with pytest.raises(FitterError) as e:
        load_study_result(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'study.db'}: the study records objectives ['../../../escape']; fitter's "
                            "are tg, pp, vram, ctx, tg-stream, ttft, quality")


def test_a_study_with_quality_draws_decode_against_the_kv_caches_divergence(tmp_path: Path) -> None:
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="fitter",
                                directions=["maximize", "minimize"])
    for k, v in {"model_identity": "abc", "machine_fingerprint": "def", "llama_cpp_commit": "0c1e570",
                 "objectives": ["tg", "quality"]}.items():
        study.set_user_attr(k, v)
    for i, (ctk, kld, tg) in enumerate([("f16", 0.0, 100.0), ("q8_0", 0.0002, 104.0), ("q4_0", 0.002, 110.0)]):
        q = {"kv": f"{ctk}/{ctk}", "kld": kld, "kld_interval": [kld, kld], "kld_p99": kld, "same_top_pct": 99.0}
        study.add_trial(create_trial(
            state=TrialState.COMPLETE, values=[tg, kld], params={"cache-type-k": ctk},
            distributions={"cache-type-k": CategoricalDistribution(("f16", "q8_0", "q4_0"))},
            user_attrs={"phase": "tpe", "launched": True, "measurement": measurement(500, tg, None), "quality": q,
                        "flags": ["-ctk", ctk, "-ctv", ctk], "key": f"k{i}"}))
    report = write_report(load_study_result(tmp_path), tmp_path / "report")
    check_files(tmp_path / "report", ["decode-vs-quality.png", "history-quality.png"])
    assert not any(n.startswith("decode vs quality") for n in report.notes)
