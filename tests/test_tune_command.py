"""`fitter tune` end to end on the demo model and the emulated GPU, and its refusals of bad input."""

from __future__ import annotations

import csv
import json
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.llama_tools import tools_dir

FIT_TOOL = tools_dir() / "llama-fit-params"  # resolved before the autouse fixture moves FITTER_HOME
FAST = ["-p", "32", "-n", "8", "-r", "2", "--llama-fit-params", str(FIT_TOOL)]


def tune(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fitter.cli", "tune", *args], capture_output=True, text=True,
                          timeout=900, cwd=cwd)


def _result_dir(root: Path) -> Path:
    (pareto,) = root.glob("*/*/*/pareto.json")
    return pareto.parent


@pytest.mark.llama
@pytest.mark.skipif(not FIT_TOOL.is_file(), reason="llama-fit-params not built (python -m fitter.llama_tools)")
def test_tune_on_the_demo_model_writes_a_confirmed_pareto_front_and_resumes(tmp_path: Path) -> None:
    proc = tune("--trials", "5", "--results", str(tmp_path / "results"), "-c", "4096", *FAST, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "emulated GPU" in proc.stderr and "llama-server -m " in proc.stdout
    folder = _result_dir(tmp_path / "results")
    doc = json.loads((folder / "pareto.json").read_text())
    assert doc["emulated"] and doc["objectives"] == ["tg", "pp", "vram"] and doc["fit_target_mib"] == [16]
    assert doc["baseline"]["name"] == "llama.cpp --fit" and doc["baseline"]["measurement"]["outcome"] == "ok"
    assert doc["study"]["launched"] == 5 and doc["pareto"]
    for e in doc["pareto"]:  # confirmed, pinned, with ratios over the re-measured baseline
        assert e["measurement"]["outcome"] == "ok" and "-fit" in e["flags"] and "-np" in e["flags"]
        base = doc["baseline"]["measurement"]
        assert e["ratios"]["tg"] == round(e["measurement"]["tg"]["avg_ts"] / base["tg"]["avg_ts"], 3)
    assert set(doc["picks"]) == {"max-decode", "max-prefill", "balanced", "min-vram"}
    rows = list(csv.DictReader((folder / "trials.csv").open()))
    launched = [r for r in rows if r["launched"] == "True"]
    assert len(launched) == 5 and rows[0]["phase"] == "baseline"
    budget = 96 - 16  # MiB: the emulated cap less the fit target
    for r in launched[1:]:  # nothing the estimator predicted over budget was launched
        assert float(r["predicted_vram_mib"]) <= budget, r
    # every export parses back to the picked config
    for fmt in ("server", "preset-ini", "llama-swap", "python", "json"):
        out = subprocess.run([sys.executable, "-m", "fitter.cli", "export", str(folder), "--format", fmt],
                             capture_output=True, text=True, check=True).stdout
        assert out.strip()
    server = subprocess.run([sys.executable, "-m", "fitter.cli", "export", str(folder), "--policy", "max-decode"],
                            capture_output=True, text=True, check=True).stdout
    argv = shlex.split(next(ln for ln in server.splitlines() if ln.startswith("llama-server")))
    picked = next(e for e in doc["pareto"] if e["trial"] == doc["picks"]["max-decode"])
    rpc_at = picked["flags"].index("--rpc")  # the emulated device is left out of exports
    assert argv[3:] == picked["flags"][:rpc_at] + picked["flags"][rpc_at + 2:]
    # resume: the same command with more trials adds launches, measures nothing twice
    proc = tune("--trials", "7", "--results", str(tmp_path / "results"), "-c", "4096", *FAST, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc2 = json.loads((folder / "pareto.json").read_text())
    assert doc2["study"]["launched"] == 7
    rows = list(csv.DictReader((folder / "trials.csv").open()))
    keys = [r["flags"] for r in rows if r["launched"] == "True"]
    assert len(keys) == len(set(keys)) == 7


def test_dry_run_shows_the_space_and_plan_and_launches_nothing(tmp_path: Path) -> None:
    proc = tune("--dry-run", "-c", "4096", "--results", str(tmp_path / "r"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "space shipped:moe:" in proc.stdout and "decode-first: " in proc.stdout
    assert "combinations fit" in proc.stdout
    assert not (tmp_path / "r").exists()


def test_a_model_that_cannot_fit_starts_no_trial_and_says_by_how_much(tmp_path: Path) -> None:
    proc = tune("--emulated-gpu", "20", "--fit-target", "16", "-c", "4096", "--results", str(tmp_path / "r"),
                "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2
    assert "no configuration of the search space fits" in proc.stderr
    assert "the lightest configuration is over budget on vram:RPC0[127.0.0.1:50052] by " in proc.stderr
    assert "-ncmoe 8" in proc.stderr and "fitter fit finds a placement outside the space: -ngl " in proc.stderr
    assert "nothing was launched" in proc.stderr


def _study_db(tmp_path: Path) -> Path:
    """Where a demo tune on the default emulated GPU keeps its study (found by a dry run's folder rules)."""
    from fitter.bench import machine_record
    from fitter.demo_models import demo_model_path
    from fitter.probe import build_cpu_info, detect_nvidia, detect_ram, read_cpu_snapshot
    from fitter.results import machine_dir_name, result_dir
    from fitter.worker import Worker

    cpu = build_cpu_info(read_cpu_snapshot())
    gpus, nvidia = detect_nvidia()
    machine = machine_record(cpu, detect_ram().total, [g.name for g in gpus], nvidia.driver)
    with Worker() as w:
        commit = w.start().build_info["commit"]
    return result_dir(tmp_path / "r", str(demo_model_path()), machine_dir_name(machine, 96), commit) / "study.db"


@pytest.mark.llama
def test_a_corrupt_study_db_is_an_error_and_left_as_it_was(tmp_path: Path) -> None:
    db = _study_db(tmp_path)
    db.parent.mkdir(parents=True)
    db.write_bytes(b"not a database at all")
    proc = tune("--results", str(tmp_path / "r"), *FAST, cwd=tmp_path)
    assert proc.returncode == 2 and "not an SQLite database" in proc.stderr and "nothing was changed" in proc.stderr
    assert db.read_bytes() == b"not a database at all"


@pytest.mark.llama
def test_a_study_of_another_model_is_refused(tmp_path: Path) -> None:
    import optuna

    db = _study_db(tmp_path)
    db.parent.mkdir(parents=True)
    study = optuna.create_study(storage=f"sqlite:///{db}", study_name="fitter",
                                directions=["maximize", "maximize", "minimize"])
    study.set_user_attr("model_identity", "someone-else")
    size = db.stat().st_size
    proc = tune("--results", str(tmp_path / "r"), *FAST, cwd=tmp_path)
    assert proc.returncode == 2 and "another model identity" in proc.stderr and "nothing was changed" in proc.stderr
    assert db.stat().st_size == size
    with sqlite3.connect(db) as con:
        assert con.execute("select count(*) from trials").fetchone() == (0,)


def test_an_unwritable_results_folder_is_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    from fitter.errors import FitterError
    from fitter.results import ensure_writable

    with pytest.raises(FitterError, match=r"results folder .*file/sub: cannot create it"):
        ensure_writable(blocker / "sub")


def test_bad_objectives_and_space_are_refused_before_anything_starts(tmp_path: Path) -> None:
    proc = tune("--objectives", "tg,speed", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2 and "--objectives 'tg,speed'" in proc.stderr
    space = tmp_path / "my.toml"
    space.write_text('[params]\nubatch-size = [0]\n')
    proc = tune("--space", str(space), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2 and "my.toml" in proc.stderr and "ubatch-size" in proc.stderr


def test_a_foreign_sqlite_file_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    import optuna

    from fitter.errors import FitterError
    from fitter.results import StudyKey, open_study

    db = tmp_path / "study.db"
    with sqlite3.connect(db) as con:
        con.execute("create table notes (text)")
    before = db.read_bytes()
    with pytest.raises(FitterError, match=r"without Optuna's tables \(it has: notes\); move it away or give "
                                          r"--results DIR; nothing was changed"):
        open_study(f"sqlite:///{db}", StudyKey("id", "fp", "b"), ["maximize"], optuna.samplers.RandomSampler(), {})
    assert db.read_bytes() == before
