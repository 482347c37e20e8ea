"""`fitter tune` end to end on the demo model and the emulated GPU, and its refusals of bad input."""

from __future__ import annotations

import csv
import json
import os
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.errors import FitterError
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.machine.snapshot import take_snapshot
from fitter.noise import ratio_interval
from fitter.sim import MACHINES_DIR
from fitter.storage.studies import machine_dir_name, result_dir
from fitter.tune.options import TuneOptions
from fitter.tune.session import run_tune
from fitter.workload import Workload
from tests.conftest import BUILT_TOOLS
from tests.models import golden_arch_model, model_file, unknown_arch_model
from tests.tune.options import tune_options

FAST = ["-p", "32", "-n", "8", "-r", "2", "--llama-fit-params", str(BUILT_TOOLS / "llama-fit-params")]


def tune(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fitter.cli", "tune", *args], capture_output=True, text=True,
                          timeout=900, cwd=cwd)


def _result_dir(root: Path) -> Path:
    (pareto,) = root.glob("*/*/*/pareto.json")
    return pareto.parent


@pytest.mark.llama
@pytest.mark.tools("llama-fit-params")
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
        rounds, base_rounds = (m["confirm"]["round_avg_ts"]["tg"] for m in (e["measurement"], base))
        point, lo, hi = ratio_interval(rounds, base_rounds)  # type: ignore[misc]
        assert len(rounds) == 4 and e["ratios"]["tg"] == round(point, 3)
        assert e["intervals"]["tg"] == [round(lo, 3), round(hi, 3)] and isinstance(e["ties"], list)
    # the drift monitor: the baseline's trial, its run half-way through the launches, its confirm rounds
    assert [p["at"] for p in doc["drift"]["baseline"]] == ["start", "middle", "end"]
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
    # the recorded baseline named the first run's emulated GPU: its confirm run is on this run's fresh one
    assert doc2["baseline"]["measurement"]["outcome"] == "ok", doc2["baseline"]["measurement"]["reason"]
    rows = list(csv.DictReader((folder / "trials.csv").open()))
    keys = [r["flags"] for r in rows if r["launched"] == "True"]
    assert len(keys) == len(set(keys)) == 7


@pytest.mark.llama
@pytest.mark.slow
@pytest.mark.tools("llama-fit-params")
def test_tune_on_two_emulated_gpus_searches_each_devices_placement_and_checks_on_fresh_ones(tmp_path: Path) -> None:
    results = tmp_path / "results"
    proc = tune("--emulated-gpu", "64,32", "--fit-target", "4", "--trials", "4", "--results", str(results),
                "-c", "4096", *FAST, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    folder = _result_dir(results)
    assert folder.parent.name.startswith("emulated-64+32MiB-")
    doc = json.loads((folder / "pareto.json").read_text())
    assert doc["machine"]["emulated_gpu_mib"] == [64, 32]
    assert doc["baseline"]["measurement"]["outcome"] == "ok"
    rows = list(csv.DictReader((folder / "trials.csv").open()))
    searched = [r for r in rows if r["launched"] == "True" and r["phase"] != "baseline"]
    assert searched and all("-ts" in r["flags"] or "-sm none" in r["flags"] for r in searched)
    budgets = doc["budgets"]["devices"]
    assert sorted(budgets.values()) == [(32 - 4) * 2**20, (64 - 4) * 2**20]
    # the exports name the i-th emulated GPU CUDA<i> and drop its --rpc
    server = subprocess.run([sys.executable, "-m", "fitter.cli", "export", str(folder), "--policy", "max-decode"],
                            capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in server.splitlines() if ln.startswith("llama-server"))
    assert "--rpc" not in line and "RPC0[" not in line
    # fitter check starts two fresh emulated GPUs of the recorded caps and moves the endpoints to them
    check = subprocess.run([sys.executable, "-m", "fitter.cli", "check", str(folder), "--policy", "max-decode",
                            "--tolerance", "90%"], capture_output=True, text=True, cwd=tmp_path)
    assert "on a fresh emulated GPU of 64+32 MiB at 127.0.0.1:" in check.stdout, check.stdout + check.stderr
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.llama
@pytest.mark.tools("llama-fit-params")
def test_a_guessed_model_on_the_emulated_gpu_is_said_guessed_then_projected_and_checked_so(tmp_path: Path) -> None:
    # phi2's compute is fitter's guess until the emulated GPU runs, then llama-fit-params projects each config on it:
    # the tune warns as `fitter estimate` does at each step, and no longer hangs on the second trial's projection
    # (the worker's child held the emulated GPU's one RPC connection; ggml's server accepts one client at a time)
    from fitter.memory.plan.projected import guess_warning, projection_warning

    model = golden_arch_model("phi2-dense")
    spec = load_model_spec(str(model))
    results = tmp_path / "results"
    proc = tune(str(model), "--emulated-gpu", "64", "--trials", "3", "--confirm-rounds", "1", "-c", "2048",
                "--results", str(results), *FAST, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    source = f"llama-fit-params --fit-print on of {BUILT_TOOLS}"
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("fitter: warning: phi2")]
    assert said == [f"fitter: warning: {guess_warning(spec)}",
                    f"fitter: warning: phi2: before the emulated GPU starts, the feasible region is fitter's guess of "
                    f"its compute memory; every trial is screened by {source}",
                    f"fitter: warning: {projection_warning(spec, (), source)}"]
    rows = list(csv.DictReader((_result_dir(results) / "trials.csv").open()))
    # trials after the first were screened by a projection made while the worker had run: the ones that hung
    assert sum(r["launched"] == "True" and r["phase"] != "baseline" for r in rows) >= 2
    env = {**os.environ, "PATH": f"{BUILT_TOOLS}{os.pathsep}{os.environ['PATH']}"}  # where check finds the tool
    check = subprocess.run([sys.executable, "-m", "fitter.cli", "check", str(_result_dir(results)), "--tolerance",
                            "90%"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"fitter: warning: {projection_warning(spec, (), source)}" in check.stderr


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


def test_two_emulated_gpus_given_take_a_fit_target_that_fits_and_a_refusal_names_one(tmp_path: Path) -> None:
    # --emulated-gpu 64,48 alone was refused: llama.cpp's 1024 MiB target left budgets of -960 and -976 MiB
    proc = tune("--emulated-gpu", "64,48", "--results", str(tmp_path / "r"), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "fitter: fit target 10,8 MiB on the emulated GPU" in proc.stderr
    assert "budgets: RPC0[127.0.0.1:50052] 54 MiB, RPC0[127.0.0.1:50053] 40 MiB" in proc.stdout
    # a target given that leaves no room: the refusal names the largest targets the lightest configuration fits
    refused = tune("--emulated-gpu", "64,48", "--fit-target", "1024", "--results", str(tmp_path / "r"), "--dry-run",
                   cwd=tmp_path)
    assert refused.returncode == 2 and "--fit-target 42,32 would fit it;" in refused.stderr, refused.stderr
    suggested = tune("--emulated-gpu", "64,48", "--fit-target", "42,32", "--results", str(tmp_path / "r"),
                     "--dry-run", cwd=tmp_path)
    assert suggested.returncode == 0 and "budgets: RPC0[127.0.0.1:50052] 22 MiB, RPC0[127.0.0.1:50053] 16 MiB" \
        in suggested.stdout, suggested.stderr


def _study_db(tmp_path: Path) -> Path:
    """Where a demo tune on the default emulated GPU keeps its study (the folder rules a tune uses)."""
    from fitter.gguf.demo_models import demo_model_path
    from fitter.machine.llama_cpp import llama_cpp_python_build
    from fitter.machine.snapshot import take_snapshot
    from fitter.storage.studies import machine_dir_name, result_dir

    machine = take_snapshot().record()
    commit = llama_cpp_python_build()["commit"]
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
    from fitter.storage.studies import ensure_writable

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
    from fitter.storage.studies import StudyKey, open_study

    db = tmp_path / "study.db"
    with sqlite3.connect(db) as con:
        con.execute("create table notes (text)")
    before = db.read_bytes()
    with pytest.raises(FitterError, match=r"without Optuna's tables \(it has: notes\); move it away or give "
                                          r"--results DIR; nothing was changed"):
        open_study(f"sqlite:///{db}", StudyKey("id", "fp", "b"), ["maximize"], optuna.samplers.RandomSampler(), {})
    assert db.read_bytes() == before


def test_a_study_another_worker_is_creating_is_joined_not_refused(tmp_path: Path) -> None:
    """Optuna creates its tables one at a time: a worker starting beside the creator sees only some of them (CI saw
    "it has: studies") and joins, where a file with a table of its own is refused."""
    import optuna

    from fitter.storage.studies import StudyKey, open_study

    db = tmp_path / "study.db"
    with sqlite3.connect(db) as con:
        con.execute("create table studies (study_id integer primary key, study_name varchar(512))")
    study = open_study(f"sqlite:///{db}", StudyKey("id", "fp", "b"), ["maximize"], optuna.samplers.RandomSampler(),
                       {})
    assert study.user_attrs["model_identity"] == "id"


# -- the order of a tune: refuse bad input before anything starts or is created ----------------------------------


class NeverStarted:
    """A runner that must not start: the tune refuses its input before it would."""

    backend, emulated, deployed_context, rpc = "llama-cpp-python", False, True, ()
    entered = 0

    def __init__(self, **_: object) -> None:
        pass

    def build(self) -> dict[str, str]:
        return {"commit": "0c1e570", "source": "test"}

    def devices(self) -> tuple[()]:
        return ()

    def __enter__(self) -> NeverStarted:
        NeverStarted.entered += 1
        raise AssertionError("the runner started")

    def __exit__(self, *_: object) -> None:
        pass


def _options(model: Path, **kw: object) -> TuneOptions:
    return tune_options(model=str(model), spec=load_model_spec(str(model)), base=parse_launch_flags(["-c", "2048"]),
                       **kw)  # type: ignore[arg-type]


def test_a_corrupt_study_db_is_refused_before_the_runner_starts(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fitter.tune.targets.WorkerRunner", NeverStarted)
    model = model_file("gpt-oss-tiny")
    snapshot = take_snapshot()
    if snapshot.gpus:
        pytest.skip("the folder this test corrupts is the CPU-only machine's")
    folder = result_dir(tmp_path, str(model), machine_dir_name(snapshot.record(), None), "0c1e570")
    folder.mkdir(parents=True)
    (folder / "study.db").write_bytes(b"not a database at all")
    NeverStarted.entered = 0
    with pytest.raises(FitterError, match=r"study\.db: not an SQLite database .*nothing was changed"):
        run_tune(_options(model, results=tmp_path, trials=2), snapshot)
    assert NeverStarted.entered == 0 and (folder / "study.db").read_bytes() == b"not a database at all"


def test_a_simulated_baseline_without_llama_cpp_python_is_skipped_before_anything_is_created(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fitter.measure.emulator.capdev.llama_cpp_python_lib_dir", lambda: None)  # not installed
    ran = tmp_path / "fit-tool-ran"
    tool = tmp_path / "llama-fit-params"
    tool.write_text(f"#!/bin/sh\ntouch {ran}\nexit 1\n")
    tool.chmod(0o755)
    model = model_file("gpt-oss-20b", sparse=True)
    outcome = run_tune(_options(model, backend="sim", machine="gpu-8gb", results=tmp_path / "r", trials=3,
                                llama_fit_params=str(tool), workload=Workload(n_prompt=128, n_gen=16),
                                repetitions=1), None)
    assert outcome.result is not None and outcome.folder is not None
    baseline = outcome.result.data["baseline"]
    assert baseline["measurement"] is None and baseline["reason"].endswith(
        f"the emulated GPU serves llama.cpp's RPC backend from a shared llama.cpp build or from llama-cpp-python: "
        f"{tmp_path} has no shared ggml with RPC (libggml-base.so.0, libggml.so.0, libggml-rpc.so.0), and "
        "llama-cpp-python is not installed (python -m fitter.measure.llamacpp.tools --llama-cpp-python builds both)")
    assert not ran.exists()  # llama.cpp's fit needs the emulated GPU: never started without it
    assert outcome.result.study["launched"] == 3 and (outcome.folder / "pareto.json").is_file()


def test_a_local_tune_without_llama_cpp_python_is_refused_before_anything_is_created(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fitter.machine.llama_cpp.llama_cpp_python_lib_dir", lambda: None)  # not installed
    monkeypatch.setattr("fitter.tune.targets.WorkerRunner", NeverStarted)
    NeverStarted.entered = 0
    with pytest.raises(FitterError) as e:
        run_tune(_options(model_file("gpt-oss-tiny"), results=tmp_path / "r", trials=2), take_snapshot())
    assert str(e.value) == ("fitter tune measures with llama.cpp: give your build's bin/ folder with --llama-cpp DIR, "
                            "or install llama-cpp-python (python -m fitter.measure.llamacpp.tools --llama-cpp-python "
                            "builds llama.cpp and installs it on that build); here llama-cpp-python is not installed")
    assert NeverStarted.entered == 0 and not (tmp_path / "r").exists()


def test_a_fit_target_list_must_match_the_gpus(tmp_path: Path) -> None:
    profile = tmp_path / "three.toml"
    profile.write_text((MACHINES_DIR / "gpu-8gb.toml").read_text().replace("[gpu]", "[gpu]\ncount = 3"))
    model = model_file("gpt-oss-20b", sparse=True)
    for targets, message in (((512, 1024), r"--fit-target 512,1024: 2 values for 3 GPUs \(CUDA0, CUDA1, CUDA2\)"),
                             ((1, 2, 3, 4), r"--fit-target 1,2,3,4: 4 values for 3 GPUs \(CUDA0, CUDA1, CUDA2\)")):
        with pytest.raises(FitterError, match=message):
            run_tune(_options(model, backend="sim", machine=str(profile), fit_targets=targets, results=tmp_path),
                     None, dry_run=True)
    assert not list(tmp_path.glob("*/*/*/study.db"))


def test_every_command_prints_the_models_warnings(tmp_path: Path) -> None:
    model = unknown_arch_model(tmp_path)
    warning = f"fitter: warning: {model}: architecture 'llamb' has no memory rules in fitter"
    refused = tune(str(model), "--backend", "sim", "--machine", "cpu-16c", "--dry-run", "-c", "512", cwd=tmp_path)
    assert refused.returncode == 2 and warning in refused.stderr, refused.stderr  # no build here to project with
    assert "fitter has no rules for the kv and compute memory of architecture 'llamb' and will not guess it" \
        in refused.stderr
    dry = tune(str(model), "--backend", "sim", "--machine", "cpu-16c", "--dry-run", "-c", "512", "--projection",
               "never", cwd=tmp_path)
    assert dry.returncode == 0 and warning in dry.stderr, dry.stderr
    assert "llamb: fitter guesses its KV cache as a plain cache over every layer" in dry.stderr
    bench = subprocess.run([sys.executable, "-m", "fitter.cli", "bench", str(model), "--backend", "sim", "--machine",
                            "cpu-16c", "-c", "512", "-p", "16", "-n", "4", "-r", "1"], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)
    assert bench.returncode == 0 and warning in bench.stderr, bench.stderr
