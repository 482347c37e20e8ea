"""Several `fitter tune` workers on one study (fitter.storage.fleet): the claim rule, the claims of each storage under
races, and whole fleets of real `fitter tune` processes on SQLite, Optuna's journal file and a real PostgreSQL server
(tests/storage/postgres.py), with kill -9 of a worker mid-trial."""

from __future__ import annotations

import collections
import dataclasses
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy
from optuna.trial import TrialState

from fitter.flags import parse_launch_flags
from fitter.storage.fleet import (
    Claim,
    Claims,
    FileClaims,
    MemoryClaims,
    Row,
    SqlClaims,
    Worker,
    claims_for,
    decide,
    gone,
    measured,
)
from fitter.storage.studies import GRACE_S
from tests.conftest import BUILT_TOOLS
from tests.storage.postgres import PostgresServer, server_binaries, start_postgres

HOST = socket.gethostname()
STUDY = "fitter-fitter-demo-gpt-oss"  # the study name of the demo model in a shared storage


# -- the rule (pure) --------------------------------------------------------------------------------------------


def test_who_gets_a_claim() -> None:
    assert decide(None, "a:1", 100.0, 30.0) == Claim(True, "a:1")
    assert decide(Row("k", "a:1", 4, 10.0, False), "a:1", 100.0, 30.0) == Claim(True, "a:1")  # its own, even stale
    assert decide(Row("k", "b:2", 4, 80.0, False), "a:1", 100.0, 30.0) == Claim(False, "b:2", 4)
    assert decide(Row("k", "b:2", 4, 10.0, True), "a:1", 100.0, 30.0) == Claim(False, "b:2", 4, done=True)
    # not beaten for more than the grace: taken over, and the trial it left running named for failing
    assert decide(Row("k", "b:2", 4, 69.9, False), "a:1", 100.0, 30.0) == Claim(True, "a:1", stale_holder="b:2",
                                                                               stale_trial=4)
    assert decide(Row("k", "b:2", None, 70.0, False), "a:1", 100.0, 30.0) == Claim(False, "b:2")
    # a holder known gone (a process of this host that no longer runs) is stale at once
    assert decide(Row("k", "b:2", None, 99.0, False), "a:1", 100.0, 30.0, dead=True) == Claim(
        True, "a:1", stale_holder="b:2")
    assert decide(Row("k", "b:2", 4, 10.0, True), "a:1", 100.0, 30.0, dead=True) == Claim(False, "b:2", 4, done=True)


def test_a_worker_is_gone_only_when_it_is_a_process_of_this_host_that_no_longer_runs() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert gone(f"{HOST}:{child.pid}")  # reaped: its pid is free (unless reused within this test, far from likely)
    assert not gone(f"{HOST}:{os.getpid()}")
    assert not gone(f"another-host:{child.pid}")  # only its beat can tell
    assert not gone("no pid here")


# -- the claims of each storage ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL server for this module's tests (one start, a database per test)."""
    if server_binaries() is None and os.environ.get("FITTER_REQUIRE_TOOLS") != "1":
        pytest.skip("no PostgreSQL server binaries (.ci/setup installs Debian's postgresql)")
    server = start_postgres()
    yield server
    server.stop()


def _database(postgres: PostgresServer, request: pytest.FixtureRequest) -> str:
    name = "t_" + "".join(c if c.isalnum() else "_" for c in request.node.name.lower())[:50]
    return postgres.create_database(f"{name}_{os.getpid()}_{time.monotonic_ns() % 10**6}")


def storage_url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'fleet.db'}"
    if kind == "journal":
        return f"journal:{tmp_path / 'fleet.log'}"
    return _database(request.getfixturevalue("postgres"), request)


def open_claims(url: str, study: str = "s") -> Claims:
    from fitter.storage.studies import _storage, journal_path

    return claims_for(_storage(url, 5, 20), study, journal_path(url))


STORAGES = ["sqlite", "journal", "postgres"]
# the long fleet tests run on SQLite by default; their journal and PostgreSQL variants under -m slow (.ci/run runs them)
SLOW_STORAGES = ["sqlite", pytest.param("journal", marks=pytest.mark.slow),
                 pytest.param("postgres", marks=pytest.mark.slow)]


@pytest.mark.load
@pytest.mark.parametrize("kind", STORAGES)
def test_claims_hold_settle_finish_and_go_stale(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = storage_url(kind, tmp_path, request)
    claims = open_claims(url)
    assert isinstance(claims, {"sqlite": SqlClaims, "journal": FileClaims, "postgres": SqlClaims}[kind])
    assert claims.claim("-ub 512", "a:1") == Claim(True, "a:1")
    assert claims.claim("-ub 512", "b:2") == Claim(False, "a:1")
    claims.settle("-ub 512", "a:1", 7)
    assert claims.claim("-ub 512", "b:2") == Claim(False, "a:1", 7)
    claims.finish("-ub 512", "a:1", 7)
    assert claims.claim("-ub 512", "b:2") == Claim(False, "a:1", 7, done=True)
    # a holder that stops beating loses its claim to the next worker, which is told the trial to fail
    assert claims.claim("-ub 1024", "a:1").granted
    claims.settle("-ub 1024", "a:1", 8)
    claims.grace_s = 0.2
    time.sleep(0.3)
    assert claims.claim("-ub 1024", "b:2") == Claim(True, "b:2", stale_holder="a:1", stale_trial=8)
    assert claims.claim("-ub 1024", "a:1") == Claim(False, "b:2")  # the one that took it over holds it now
    claims.grace_s = GRACE_S
    # beating keeps a claim alive past the grace; a released claim is free at once
    assert claims.claim("-ub 2048", "a:1").granted
    claims.beat("a:1")
    row = claims.row("-ub 2048")
    assert row is not None and row.worker == "a:1" and not row.done and time.time() - row.beat_at < 5
    claims.release("-ub 2048", "a:1")
    assert claims.row("-ub 2048") is None
    assert claims.claim("-ub 2048", "b:2") == Claim(True, "b:2")
    # claims of another study in the same storage are its own
    assert open_claims(url, "another study").claim("-ub 512", "b:2") == Claim(True, "b:2")


def _claim_all(url: str, worker: str, keys: list[str], start: float, out: Any) -> None:
    claims = open_claims(url)
    time.sleep(max(0.0, start - time.time()))
    out.put((worker, [k for k in keys if claims.claim(k, worker).granted]))


@pytest.mark.parametrize("kind", SLOW_STORAGES)
def test_each_config_is_granted_to_exactly_one_of_many_racing_processes(kind: str, tmp_path: Path,
                                                                         request: pytest.FixtureRequest) -> None:
    url = storage_url(kind, tmp_path, request)
    open_claims(url)  # the table or file exists; creating it in a race is the next test's
    keys = [f"-ncmoe {n} -ub 512" for n in range(30)]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start = time.time() + 3.0  # every process claims from the same moment
    procs = [ctx.Process(target=_claim_all, args=(url, f"w:{i}", keys, start, out)) for i in range(6)]
    for p in procs:
        p.start()
    granted = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    counts = collections.Counter(k for ks in granted.values() for k in ks)
    assert counts == collections.Counter({k: 1 for k in keys})


def test_an_in_memory_study_has_claims_of_its_own() -> None:
    assert isinstance(claims_for(optuna.storages.InMemoryStorage(), "s"), MemoryClaims)
    assert Worker("gpu-07", 4242).name == "gpu-07:4242"


def test_a_worker_joining_while_the_study_is_written_is_not_refused(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # the creator writes one attribute at a time; a second worker opening the study between two of those writes
    # found a model identity and no machine fingerprint yet and was refused ("another machine fingerprint (None, …")
    from fitter.storage.studies import StudyKey, open_study

    url, key = f"sqlite:///{tmp_path / 's.db'}", StudyKey("id", "fp", "build")
    joiner: list[optuna.Study] = []
    write, writes = optuna.Study.set_user_attr, [0]

    def write_then_let_another_join(self: optuna.Study, k: str, v: Any) -> None:
        write(self, k, v)
        writes[0] += 1
        if writes[0] == 1:  # after the creator's first write (the joiner's own writes come after it)
            joiner.append(open_study(url, key, ["maximize"], optuna.samplers.RandomSampler(), {"objectives": ["tg"]}))

    monkeypatch.setattr(optuna.Study, "set_user_attr", write_then_let_another_join)
    creator = open_study(url, key, ["maximize"], optuna.samplers.RandomSampler(), {"objectives": ["tg"]})
    assert creator.user_attrs == joiner[0].user_attrs == {**key.attrs(), "objectives": ["tg"]}


# -- fleets of real `fitter tune` processes -------------------------------------------------------------------------


def paced(folder: Path, pace: float) -> Path:
    """gpu-8gb whose trials take `pace` real seconds per simulated second, so the workers overlap as on a real fleet
    (every worker is given the same file: one machine fingerprint)."""
    from fitter.sim import MACHINES_DIR

    path = folder / "gpu-8gb-paced.toml"
    path.write_text((MACHINES_DIR / "gpu-8gb.toml").read_text().replace("seed = 8\n", f"seed = 8\npace = {pace}\n"))
    return path


def _tune(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """A worker; the simulated GPU's baseline is llama.cpp's own fit, run on an emulated GPU of its size."""
    args = [*args, "--llama-fit-params", str(BUILT_TOOLS / "llama-fit-params")]
    return subprocess.Popen([sys.executable, "-m", "fitter.cli", "tune", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env})


# a test watching a study the tunes are still creating: not there yet (KeyError), or its schema half made (the
# watcher opening the storage races the creation as a worker would, and does not retry as open_study does)
NOT_YET = (KeyError, sqlalchemy.exc.SQLAlchemyError)


def load(url: str, name: str) -> optuna.Study:
    from fitter.storage.studies import _storage

    return optuna.load_study(study_name=name, storage=_storage(url, 5, 20))


def check_fleet(study: optuna.Study, pids: list[int], trials: int, results: list[Path]) -> dict[str, Any]:
    """What every fleet must show: each launched config once and finished, the budget kept exactly (each launch takes
    one of the study's --trials launch claims), one worker's confirm and pareto.json naming every worker that launched
    a trial."""
    launched = [t for t in study.trials if t.user_attrs.get("launched")]
    told = [t for t in launched if measured(t)]
    keys = collections.Counter(t.user_attrs["key"] for t in told)
    assert [k for k, n in keys.items() if n > 1] == []
    assert len(launched) == trials
    assert {t.user_attrs["worker"] for t in launched} <= {f"{HOST}:{p}" for p in pids}
    paretos = [p for r in results for p in r.glob("*/*/*/pareto.json")]
    assert len(paretos) == 1, paretos
    doc = json.loads(paretos[0].read_text())
    by_worker = collections.defaultdict(list)
    for t in launched:
        by_worker[t.user_attrs["worker"]].append(t.number)
    assert doc["study"]["workers"] == [{"worker": w, "trials": sorted(n)} for w, n in sorted(by_worker.items())]
    assert doc["study"]["confirmed_by"] in {f"{HOST}:{p}" for p in pids}
    assert doc["baseline"]["measurement"]["outcome"] == "ok"
    assert [t.number for t in told if t.user_attrs["phase"] == "baseline"] == [doc["baseline"]["trial"]]
    return doc


@pytest.mark.tools("llama-fit-params")
# the default storage in the default run; a shared SQLite file, a journal and PostgreSQL under -m slow
@pytest.mark.parametrize("kind", ["sqlite-folder", *(pytest.param(k, marks=pytest.mark.slow) for k in STORAGES)])
def test_three_workers_share_one_study(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Three sim workers started together: whoever is first creates the study, the others join; no config runs
    twice, nothing finished is lost, one worker confirms and names the others."""
    storage = [] if kind == "sqlite-folder" else ["--storage", storage_url(kind, tmp_path, request)]
    roots = [tmp_path / "results"] * 3 if kind == "sqlite-folder" else [tmp_path / f"r{i}" for i in range(3)]
    machine = str(paced(tmp_path, 0.2))
    procs = [_tune(["--backend", "sim", "--machine", machine, "--trials", "12", "--results", str(root),
                    *storage], tmp_path, {}) for root in roots]
    outs = [p.communicate(timeout=600) for p in procs]
    # a failed worker's whole stderr, as a string (pytest shortens a list's repr to its ends)
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(
        f"worker {i} exited {p.returncode}:\n{e}" for i, (p, (_, e)) in enumerate(zip(procs, outs, strict=True))
        if p.returncode)
    url = storage[1] if storage else f"sqlite:///{next(roots[0].glob('*/*/*/study.db'))}"
    study = load(url, STUDY if storage else "fitter")
    doc = check_fleet(study, [p.pid for p in procs], 12, sorted(set(roots)))
    confirmer = next(i for i, p in enumerate(procs) if f"{HOST}:{p.pid}" == doc["study"]["confirmed_by"])
    for i, (out, err) in enumerate(outs):
        if i != confirmer:
            assert out == (f"fitter: this worker's trials are in the study; worker {doc['study']['confirmed_by']} "
                           "writes its results\n")
            assert f"fitter: worker {doc['study']['confirmed_by']} confirm" in err


def kill_mid_trial(url: str, procs: list[subprocess.Popen[str]], trials: int, results: list[Path]) -> None:
    """kill -9 a worker while a trial of its own runs (one launched after two trials finished), let the others end,
    and check: the killed trial is failed and counts as never measured, every trial finished before the kill is still
    there with its values, nothing is left running, and the fleet's result is whole.

    The victim is whichever worker launches a trial first once two have finished: one always does (no more than one
    trial per worker runs at once, and the budget outlasts two finished trials plus one running per worker). A victim
    chosen beforehand could take a long trial before two had finished and hold it while the others ran the rest of the
    budget (CI, PostgreSQL: "the victim never ran a trial", the others running trials 4 to 8)."""
    by_name = {f"{HOST}:{p.pid}": p for p in procs}
    deadline = time.monotonic() + 240  # within the test's own time limit, so a miss fails with its own words
    study = None
    seen: set[int] | None = None  # the trials seen launched by earlier polls (None: no poll yet)
    previous_read = 0.0
    while time.monotonic() < deadline:
        time.sleep(0.1)
        try:
            study = study or load(url, STUDY)
        except NOT_YET:
            continue
        read_from = time.monotonic()
        trials_now = study.get_trials(deepcopy=False)
        # a trial that this poll is the first to see launched, when the previous poll began reading the study less
        # than 3 s before this one ended: it was launched at most 3 s ago, so the kill lands while it runs (the shortest
        # trial of the sim paced 60x takes about 7.5 s). Timed by this watcher's own polls, not by the trial's
        # datetime_start: a trial is marked launched after its other attributes, one storage write each
        launched = {t.number: by_name[t.user_attrs["worker"]] for t in trials_now
                    if t.state == TrialState.RUNNING and t.user_attrs.get("launched")
                    and t.user_attrs.get("phase") != "baseline"}  # a search trial
        fresh = sorted(launched.keys() - seen) if seen is not None and time.monotonic() - previous_read < 3.0 else []
        seen, previous_read = launched.keys() | (seen or set()), read_from
        finished = {t.number: list(t.values) for t in trials_now if t.state == TrialState.COMPLETE}
        if fresh and len(finished) >= 2:
            killed, victim, finished_before = fresh[0], launched[fresh[0]], finished
            os.kill(victim.pid, signal.SIGKILL)
            break
    else:
        held = [(t.number, t.state.name, t.user_attrs.get("worker"), t.user_attrs.get("launched"))
                for t in (study.get_trials(deepcopy=False) if study else [])]
        pytest.fail(f"no worker launched a trial after two finished; the study held (trial, state, worker, launched): "
                    f"{held}")
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [-signal.SIGKILL if p is victim else 0 for p in procs], "\n".join(
        f"worker {i} exited {p.returncode}:\n{e}" for i, (p, (_, e)) in enumerate(zip(procs, outs, strict=True))
        if p is not victim and p.returncode)
    study = load(url, STUDY)
    after = {t.number: t for t in study.trials}
    assert {n: list(after[n].values) for n in finished_before} == finished_before
    assert after[killed].state == TrialState.FAIL
    assert not measured(after[killed])  # never measured: free for another worker to launch
    assert all(t.state != TrialState.RUNNING for t in study.trials)
    check_fleet(study, [p.pid for p in procs], trials, results)


@pytest.mark.slow  # ~2-3 min each: the dead worker's trial is failed after the heartbeat's grace (Optuna's 20 s, or the
# claims' 30 s on a journal, which has no heartbeat)
@pytest.mark.timeout(600)
@pytest.mark.tools("llama-fit-params")
@pytest.mark.parametrize("kind", ["sqlite", "journal", "postgres"])
def test_a_worker_killed_mid_trial_loses_nothing_finished(kind: str, tmp_path: Path,
                                                          request: pytest.FixtureRequest) -> None:
    """kill -9 of one of three sim workers while its trial runs."""
    url = storage_url(kind, tmp_path, request)
    results = [tmp_path / f"r{i}" for i in range(3)]
    machine = str(paced(tmp_path, 60))
    procs = [_tune(["--backend", "sim", "--machine", machine, "--trials", "9", "--confirm-rounds", "1",
                    "--results", str(r), "--storage", url], tmp_path, {}) for r in results]
    kill_mid_trial(url, procs, 9, results)


@pytest.mark.slow
@pytest.mark.llama
@pytest.mark.tools("llama-fit-params")
def test_two_workers_on_emulated_gpus_share_a_postgres_study_and_survive_a_kill(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Two workers tune the demo model on emulated GPUs of their own (real llama.cpp trials, each on its own RPC
    port: a config's key names the emulated GPU, not the port), first both to the end, then with one killed."""
    fast = ["-p", "32", "-n", "8", "-r", "2", "--confirm-rounds", "2"]
    url = storage_url("postgres", tmp_path, request)
    results = [tmp_path / f"r{i}" for i in range(2)]
    procs = [_tune([*fast, "--trials", "6", "--results", str(r), "--storage", url], tmp_path, {}) for r in results]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-6000:] for _, e in outs]
    doc = check_fleet(load(url, STUDY), [p.pid for p in procs], 6, results)
    assert {w["worker"] for w in doc["study"]["workers"]} == {f"{HOST}:{p.pid}" for p in procs}

    url = storage_url("postgres", tmp_path / "kill", request)
    results = [tmp_path / f"k{i}" for i in range(2)]
    procs = [_tune([*fast, "--trials", "8", "--results", str(r), "--storage", url], tmp_path, {}) for r in results]
    kill_mid_trial(url, procs, 8, results)


@pytest.mark.tools("llama-fit-params")
def test_a_worker_of_another_machine_or_model_is_refused_naming_the_difference(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    first = _tune(["--backend", "sim", "--machine", "gpu-8gb", "--trials", "2", "--confirm-rounds", "1",
                   "--storage", url], tmp_path, {})
    assert first.communicate(timeout=600) and first.returncode == 0
    study = load(url, STUDY)
    other = _tune(["--backend", "sim", "--machine", "gpu-12gb", "--trials", "2", "--storage", url], tmp_path, {})
    _, err = other.communicate(timeout=600)
    assert other.returncode == 2, err
    fingerprint = study.user_attrs["machine_fingerprint"]
    assert err.splitlines()[-1].startswith(
        f"fitter: error: {url}: study '{STUDY}' there is for another machine fingerprint ({fingerprint!r}, this run: '")
    # another model under the same study name
    from tests.models import model_file

    model = model_file("llama-tiny")
    other = _tune([str(model), "--backend", "sim", "--machine", "gpu-8gb", "--trials", "2", "--storage", url,
                   "--study-name", STUDY], tmp_path, {})
    _, err = other.communicate(timeout=600)
    assert other.returncode == 2, err
    identity = study.user_attrs["model_identity"]
    assert err.splitlines()[-1].startswith(
        f"fitter: error: {url}: study '{STUDY}' there is for another model identity ('{identity}'")
    assert len(load(url, STUDY).trials) == len(study.trials)  # nothing was changed


# -- two workers in one process (the study logic, a fake runner) ------------------------------------------------


def test_a_config_another_worker_holds_is_skipped_then_answered_from_storage(tmp_path: Path) -> None:
    from fitter.gguf.model_spec import load_model_spec
    from fitter.search.plan import Screener, structured_start
    from fitter.search.request import candidate
    from fitter.tune.study import Tuner
    from tests.models import model_file
    from tests.tune.test_study import FakeRunner, _request, _study

    spec = load_model_spec(str(model_file("gpt-oss-tiny")))
    req = _request(spec)
    study = _study(tmp_path)
    claims = claims_for(study._storage, "fitter")
    a = Tuner(req, study, FakeRunner(spec), claims=claims, worker=Worker("a", 1))
    b = Tuner(req, study, FakeRunner(spec), claims=claims, worker=Worker("b", 2))
    params = next(iter(structured_start(req, Screener(req)))).params
    key = candidate(req, params).key
    assert claims.claim(key, "a:1").granted  # a is measuring it
    assert b.run_candidate(params, "decode-first") is None
    assert (b.progress.elsewhere, b.runner.runs, len(study.trials)) == (1, [], 0)
    claims.release(key, "a:1")
    first = a.run_candidate(params, "decode-first")
    assert first is not None and first.state == TrialState.COMPLETE and len(a.runner.runs) == 1
    assert (first.user_attrs["worker"], first.user_attrs["claim"]) == ("a:1", key)
    row = claims.row(key)
    assert row is not None and (row.worker, row.trial, row.done) == ("a:1", first.number, True)
    answered = b.run_candidate(params, "decode-first")
    assert answered is not None and answered.user_attrs["same_as"] == first.number
    assert answered.values == first.values and b.runner.runs == []


def test_a_config_key_names_fitters_emulated_gpu_not_its_port() -> None:
    from fitter.gguf.model_spec import load_model_spec
    from fitter.search.request import candidate
    from tests.models import model_file
    from tests.tune.test_study import _request

    req = _request(load_model_spec(str(model_file("gpt-oss-tiny"))))
    params = {"n-cpu-moe": 2, "batch-size": 2048, "ubatch-size": 512, "cache-type-k": "f16", "cache-type-v": "f16",
              "flash-attn": "on", "threads": 4}
    here = candidate(req, params)
    there = candidate(dataclasses.replace(req, rpc=("127.0.0.1:41234",)), params)
    assert here.flags != there.flags and "127.0.0.1:41234" in there.flags
    assert here.key == there.key == (
        "-c 4096 -b 2048 -ub 512 -ctk f16 -ctv f16 -fa on -np 1 -ngl all -ncmoe 2 --rpc <emulated GPU> -t 4 -tb 4")
    # a --rpc the user gave is a device of their own, named as given
    mine = dataclasses.replace(req, base=parse_launch_flags(["-c", "4096", "-np", "1", "--rpc", "10.0.0.5:50052"]))
    assert candidate(mine, params).key.endswith("-ngl all -ncmoe 2 --rpc 10.0.0.5:50052 -t 4 -tb 4")


@pytest.mark.tools("llama-fit-params")
def test_a_killed_tune_run_again_at_once_takes_its_own_claims_over(tmp_path: Path) -> None:
    """kill -9 during the baseline, then the same command at once (well within the beats' grace): the dead process's
    claims are taken over (its pid is gone), its trial failed, and the baseline measured again."""
    machine = str(paced(tmp_path, 3))
    args = ["--backend", "sim", "--machine", machine, "--trials", "3", "--confirm-rounds", "1"]
    victim = _tune(args, tmp_path, {})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        time.sleep(0.2)
        dbs = list((tmp_path / "results").glob("*/*/*/study.db"))
        if not dbs:
            continue
        url = f"sqlite:///{dbs[0]}"
        try:
            trials = load(url, "fitter").get_trials(deepcopy=False)
        except NOT_YET:
            continue
        if any(t.state == TrialState.RUNNING and t.user_attrs.get("phase") == "baseline" for t in trials):
            os.kill(victim.pid, signal.SIGKILL)
            break
    else:
        pytest.fail("the baseline never ran")
    victim.communicate(timeout=60)
    started = time.monotonic()
    again = _tune(args, tmp_path, {})
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-2000:]
    assert f"fitter: worker {HOST}:{victim.pid} stopped beating; {HOST}:{again.pid} takes its claim over and fails " \
           "its trial 0" in err
    study = load(url, "fitter")
    assert study.trials[0].state == TrialState.FAIL and not measured(study.trials[0])
    assert study.trials[0].user_attrs["reason"] == (f"its worker {HOST}:{victim.pid} stopped beating (killed?); "
                                                    f"failed by {HOST}:{again.pid}")
    doc = json.loads(next((tmp_path / "results").glob("*/*/*/pareto.json")).read_text())
    assert doc["baseline"]["trial"] != 0 and doc["baseline"]["measurement"]["outcome"] == "ok"
    assert time.monotonic() - started < 120
