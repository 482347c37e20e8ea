"""Faults a tune survives (fitter.storage.faults, the Ctrl-C of fitter.cli.tune): a real `fitter tune --backend sim`
on a paced simulated machine (each run takes its simulated time, times PACE, in real time), stopped or starved at a
known trial; then the same command again. Full and read-only disks are real (tests.disks) where mounting is allowed;
twins below inject the same errors where it is not."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy
from optuna.trial import TrialState

from fitter.errors import FitterError
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.paths import SOURCE_ROOT
from fitter.sim import MACHINES_DIR
from fitter.storage.faults import study_writes
from fitter.tune.options import TuneOptions
from fitter.tune.session import run_tune
from tests.disks import fill, read_only, refused_writes, tmpfs
from tests.tune.options import tune_options

PACE = 4  # real seconds per simulated second: the first two trials of the demo take about 1.1 s each


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model, once for the module (every command below names it, so each is the same command again)."""
    path = tmp_path_factory.mktemp("model") / "demo.gguf"
    subprocess.run([sys.executable, "-m", "fitter.cli", "demo-model", "--out", str(path)], check=True,
                   capture_output=True)
    return path


def paced(folder: Path, pace: float = PACE) -> Path:
    path = folder / "paced.toml"
    path.write_text((MACHINES_DIR / "cpu-16c.toml").read_text().replace("seed = 16016", f"seed = 16016\npace = {pace}"))
    return path


def _ctrl_c_enabled() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the child's Python then turns it into KeyboardInterrupt


class Tune:
    """`fitter tune` in a subprocess, its stderr (progress lines end in \\r, not \\n) collected as it comes."""

    def __init__(self, model: Path, machine: Path, results: Path, trials: int) -> None:
        self.argv = [sys.executable, "-m", "fitter.cli", "tune", str(model), "--backend", "sim", "--machine",
                     str(machine), "--trials", str(trials), "--confirm-rounds", "1", "--results", str(results)]
        # Ctrl-C as a terminal gives it, whatever this suite was started with: a background shell starts everything
        # with SIGINT ignored, a child inherits that, and fitter rightly keeps an ignored Ctrl-C ignored
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**os.environ, "PYTHONPATH": str(SOURCE_ROOT)}, preexec_fn=_ctrl_c_enabled)
        self.err = b""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        while chunk := os.read(self.proc.stderr.fileno(), 4096):
            self.err += chunk

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text.encode() not in self.err:
            assert self.proc.poll() is None and time.monotonic() < deadline, (text, self.stderr)
            time.sleep(0.01)

    def finish(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join()
        return rc

    @property
    def stderr(self) -> str:
        return self.err.decode()

    def last_line(self) -> str:
        return self.stderr.rstrip("\n").rsplit("\n", 1)[-1]


def tune(model: Path, machine: Path, results: Path, trials: int) -> tuple[int, str]:
    t = Tune(model, machine, results, trials)
    return t.finish(), t.stderr


def study_db(results: Path) -> Path:
    (db,) = results.glob("*/*/*/study.db")
    return db


def trials(db: Path) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="fitter", storage=f"sqlite:///{db}").trials


def launched(db: Path) -> dict[int, tuple[TrialState, str, Any]]:
    return {t.number: (t.state, t.user_attrs["key"], t.values) for t in trials(db) if t.user_attrs.get("launched")}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- Ctrl-C ------------------------------------------------------------------------------------------------------


def test_the_first_ctrl_c_ends_the_running_trial_and_the_same_command_resumes(tmp_path: Path, demo: Path) -> None:
    results, machine = tmp_path / "r", paced(tmp_path)
    run = Tune(demo, machine, results, trials=4)
    run.wait_for("tune: trial 2/4 (running)")
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == 130
    db = study_db(results)
    assert run.stderr.count("\nfitter: Ctrl-C: stopping after the running trial (Ctrl-C again stops at once)\n") == 1
    assert run.last_line() == (f"fitter: stopped: 2 of 4 trials launched, each finished one kept in sqlite:///{db}; "
                               "the same command resumes the tune")
    assert "Traceback" not in run.stderr and not (db.parent / "pareto.json").exists()
    before = launched(db)
    assert [s for s, _, _ in before.values()] == [TrialState.COMPLETE] * 2  # the running trial ended and was told
    assert all(t.state != TrialState.RUNNING for t in trials(db))

    rc, err = tune(demo, machine, results, trials=4)  # the same command
    assert rc == 0, err
    after = launched(db)
    assert len(after) == 4 and all(after[n] == v for n, v in before.items())  # kept, as they were
    keys = [k for _, k, _ in after.values()]
    assert len(set(keys)) == 4  # nothing launched twice
    assert (db.parent / "pareto.json").is_file() and (db.parent / "trials.csv").is_file()


def test_a_second_ctrl_c_stops_at_once_and_leaves_the_running_trial_to_the_next_run(tmp_path: Path,
                                                                                     demo: Path) -> None:
    run = Tune(demo, paced(tmp_path, pace=40), tmp_path / "r", trials=4)  # the first trial takes about 11 s
    run.wait_for("tune: trial 1/4 (running)")
    run.proc.send_signal(signal.SIGINT)
    run.wait_for("fitter: Ctrl-C: stopping after the running trial")
    run.proc.send_signal(signal.SIGINT)
    second = time.monotonic()
    assert run.finish() == 130
    assert time.monotonic() - second < 5  # at once, not after the trial
    assert run.last_line() == ("fitter: interrupted: the running trial is left unfinished; the same command resumes "
                               "the tune (it fails that trial and keeps every finished one)")
    assert "Traceback" not in run.stderr
    db = study_db(tmp_path / "r")
    (trial,) = trials(db)
    assert trial.state == TrialState.RUNNING and trial.user_attrs["phase"] == "baseline"
    with sqlite3.connect(db) as con:  # a heartbeat: the next run fails it as stale (fail_stale_trials)
        assert con.execute("select count(*) from trial_heartbeats where trial_id = ?",
                           (trial._trial_id,)).fetchone() == (1,)


def test_a_stop_during_the_confirm_runs_writes_no_result_and_the_same_call_does(tmp_path: Path, demo: Path) -> None:
    stop, lines = threading.Event(), []

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("fitter: confirm round 1/"):
            stop.set()  # as a Ctrl-C would: the confirm runs end before their next run

    options = _options(demo, tmp_path / "r", trials=4, confirm_rounds=2)
    outcome = run_tune(options, None, log, stop=stop)
    assert [x.split(":")[1].strip() for x in lines if "confirm round" in x] == ["confirm round 1/2"]  # no round 2
    db = study_db(tmp_path / "r")
    assert outcome.result is None and outcome.stopped == (
        f"4 of 4 trials launched, each finished one kept in sqlite:///{db}; the same command resumes the tune")
    assert [p.name for p in db.parent.iterdir()] == ["study.db"]
    before = launched(db)
    outcome = run_tune(options, None)
    assert outcome.result is not None and outcome.result.data["confirm"]["rounds"] == 2
    assert launched(db) == before and (db.parent / "pareto.json").is_file()


# -- a full disk -------------------------------------------------------------------------------------------------


def test_a_disk_full_mid_study_is_one_line_and_the_same_command_resumes(tmp_path: Path, demo: Path) -> None:
    machine = paced(tmp_path)
    with tmpfs(tmp_path / "disk", 4096) as disk:
        run = Tune(demo, machine, disk / "r", trials=4)
        run.wait_for("tune: trial 2/4 (running)")
        fill(disk)  # the running trial cannot be told
        assert run.finish() == 2
        db = study_db(disk / "r")
        assert run.last_line() == (f"fitter: error: sqlite:///{db}: disk full: SQLite refused a write (database or "
                                   "disk is full); the study keeps every trial finished before it; free space and "
                                   "rerun the same command to resume")
        assert "Traceback" not in run.stderr
        with sqlite3.connect(db) as con:
            assert con.execute("pragma integrity_check").fetchone() == ("ok",)
        before = {n: v for n, v in launched(db).items() if v[0] == TrialState.COMPLETE}
        assert len(before) == 1  # the first trial; the second was running when the disk filled

        (disk / "filler").unlink()
        rc, err = tune(demo, machine, disk / "r", trials=4)
        assert rc == 0, err
        after = launched(db)
        assert all(after[n] == v for n, v in before.items())
        done = [k for s, k, _ in after.values() if s == TrialState.COMPLETE]
        assert len(done) == len(set(done)) >= 3 and (db.parent / "pareto.json").is_file()


def test_a_disk_full_at_the_results_leaves_the_study_untouched_and_the_rerun_writes_them(tmp_path: Path,
                                                                                         demo: Path) -> None:
    machine = paced(tmp_path)
    with tmpfs(tmp_path / "disk", 4096) as disk:
        run = Tune(demo, machine, disk / "r", trials=3)
        run.wait_for("fitter: confirm round 1/1")  # the search is over: the confirm runs write nothing to the study
        db = study_db(disk / "r")
        study = digest(db)
        fill(disk)
        assert run.finish() == 2
        assert run.last_line() == (f"fitter: error: {db.parent / 'pareto.json'}: disk full (No space left on device); "
                                   f"the study is intact at sqlite:///{db}; free space and rerun the same command to "
                                   "write the results (finished trials are not run again)")
        assert "Traceback" not in run.stderr
        assert digest(db) == study and [p.name for p in db.parent.iterdir()] == ["study.db"]  # no temporary file

        (disk / "filler").unlink()
        rc, err = tune(demo, machine, disk / "r", trials=3)
        assert rc == 0, err
        assert len(launched(db)) == 3 and "0 trials so far" not in err and "3 trials so far" in err
        assert (db.parent / "pareto.json").is_file() and (db.parent / "trials.csv").is_file()


# -- a read-only results folder ----------------------------------------------------------------------------------


def test_a_read_only_results_folder_is_refused_before_any_trial(tmp_path: Path, demo: Path) -> None:
    machine = paced(tmp_path, pace=0)
    rc, err = tune(demo, machine, tmp_path / "r", trials=2)
    assert rc == 0, err
    db = study_db(tmp_path / "r")
    study = digest(db)
    with read_only(db.parent):
        rc, err = tune(demo, machine, tmp_path / "r", trials=4)
    assert rc == 2
    assert err.rstrip("\n").rsplit("\n", 1)[-1] == (
        f"fitter: error: results folder {db.parent}: read-only (Read-only file system): study.db and the results go "
        "there; make it writable or give --results DIR; nothing was started")
    assert "tune: trial" not in err and digest(db) == study


def test_a_results_folder_made_read_only_mid_study_is_one_line_and_the_rerun_resumes(tmp_path: Path,
                                                                                    demo: Path) -> None:
    machine = paced(tmp_path)
    run = Tune(demo, machine, tmp_path / "r", trials=4)
    run.wait_for("tune: trial 2/4 (running)")
    db = study_db(tmp_path / "r")
    with read_only(db.parent):
        assert run.finish() == 2
    assert run.last_line() == (f"fitter: error: sqlite:///{db}: read-only or gone: SQLite refused a write (unable to "
                               "open database file); the study keeps every trial finished before it; make it "
                               "writable and rerun the same command to resume")
    assert "Traceback" not in run.stderr
    before = {n: v for n, v in launched(db).items() if v[0] == TrialState.COMPLETE}
    assert len(before) == 1
    rc, err = tune(demo, machine, tmp_path / "r", trials=4)
    assert rc == 0, err
    assert all(launched(db)[n] == v for n, v in before.items()) and (db.parent / "pareto.json").is_file()


# -- the same faults injected, where mounting is refused ----------------------------------------------------------


def _options(model: Path, results: Path, **kw: Any) -> TuneOptions:
    return tune_options(model=str(model), spec=load_model_spec(str(model)), base=parse_launch_flags([]),
                       backend="sim", machine="cpu-16c", results=results, **{"trials": 3, "confirm_rounds": 1, **kw})


def test_a_refused_result_write_keeps_the_study_and_the_rerun_writes_it(tmp_path: Path, demo: Path) -> None:
    options = _options(demo, tmp_path / "r")
    folder = tmp_path / "r"
    folder.mkdir()
    for code, line in ((errno.ENOSPC, "disk full (No space left on device)"),
                       (errno.EROFS, "read-only (Read-only file system)")):
        # write_atomic's temporary files; the folder's probe passes
        with refused_writes(folder, code, suffix=".tmp"), pytest.raises(FitterError) as e:
            run_tune(options, None)
        db = study_db(folder)
        remedy = "free space" if code == errno.ENOSPC else "make it writable"
        assert str(e.value) == (f"{db.parent / 'pareto.json'}: {line}; the study is intact at sqlite:///{db}; "
                                f"{remedy} and rerun the same command to write the results (finished trials are "
                                "not run again)")
        assert [p.name for p in db.parent.iterdir()] == ["study.db"] and len(launched(db)) == 3
    outcome = run_tune(options, None)
    assert outcome.result is not None and outcome.result.study["launched"] == 3
    assert sorted(p.name for p in db.parent.iterdir()) == ["pareto.json", "study.db", "trials.csv"]


def test_a_results_folder_that_refuses_writes_is_refused_before_the_study_opens(tmp_path: Path,
                                                                                demo: Path) -> None:
    with refused_writes(tmp_path / "r", errno.EROFS), pytest.raises(FitterError) as e:
        run_tune(_options(demo, tmp_path / "r"), None)
    (folder,) = (tmp_path / "r").glob("*/*/*")
    assert str(e.value) == (f"results folder {folder}: read-only (Read-only file system): study.db and the results go "
                            "there; make it writable or give --results DIR; nothing was started")
    assert list(folder.iterdir()) == []  # no study.db, no probe left


def test_a_study_write_sqlite_refuses_is_one_line(tmp_path: Path, demo: Path) -> None:
    # a real SQLite refusal without a mount: the study opened read-only (SQLite's own mode=ro) after a first run
    options = _options(demo, tmp_path / "r")
    run_tune(options, None)
    db = study_db(tmp_path / "r")
    study = digest(db)
    url = f"sqlite:///file:{db}?mode=ro&uri=true"
    with pytest.raises(FitterError) as e:
        run_tune(_options(demo, tmp_path / "r", storage=url, trials=5), None)
    assert str(e.value) == (f"{url}: read-only: SQLite refused a write (attempt to write a readonly database); the "
                            "study keeps every trial finished before it; make it writable and rerun the same command "
                            "to resume")
    assert digest(db) == study



def test_a_study_that_fills_its_disk_mid_study_is_one_line_and_resumes(tmp_path: Path, demo: Path) -> None:
    # a real SQLITE_FULL without a mount: SQLite's own cap on the database's pages, a page above what it holds
    options = _options(demo, tmp_path / "r")
    run_tune(options, None)
    db = study_db(tmp_path / "r")
    before = launched(db)
    pages = db.stat().st_size // 4096

    def cap(con: Any, _: Any) -> None:
        con.execute(f"pragma max_page_count = {pages + 1}")

    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "connect", cap)
    try:
        with pytest.raises(FitterError) as e:
            run_tune(_options(demo, tmp_path / "r", trials=12), None)
    finally:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "connect", cap)
    assert str(e.value) == (f"sqlite:///{db}: disk full: SQLite refused a write (database or disk is full); the study "
                            "keeps every trial finished before it; free space and rerun the same command to resume")
    with sqlite3.connect(db) as con:
        assert con.execute("pragma integrity_check").fetchone() == ("ok",)
    during = launched(db)
    assert all(during[n] == v for n, v in before.items()) and len(during) > len(before)  # it failed mid-study
    outcome = run_tune(_options(demo, tmp_path / "r", trials=12), None)
    assert outcome.result is not None and outcome.result.study["launched"] == 12

def test_other_storage_errors_are_left_as_they_are() -> None:
    engine = sqlalchemy.create_engine("sqlite://")
    with pytest.raises(sqlalchemy.exc.OperationalError, match="no such table: trials"), study_writes("sqlite://"), \
            engine.connect() as con:
        con.execute(sqlalchemy.text("select * from trials"))
