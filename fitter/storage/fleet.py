"""Several `fitter tune` workers on one study: identical machines each run `fitter tune MODEL --storage URL` against
one Optuna study, and its launches spread over the fleet (issue 15).

Optuna's storage shares trials, but it cannot say "this config is being measured": two workers that plan the same
config would both launch it, and a trial one worker enqueues goes to whichever worker asks next. So fitter keeps a
claim per config beside the study. The first worker to claim a config launches it; another finds it claimed and moves
on (a planned config) or waits for its result (a sampled one), then answers it from storage. The holder of a claim
beats while it works on it; a claim whose holder has not beaten for GRACE_S (a worker killed with -9) is stale, and
the next worker to claim it fails the trial the dead worker left RUNNING and launches the config again. The baseline,
the drift probe and the confirm rounds are claims too, so each runs once per study, by the worker that claimed it.

Claims live where the study lives: a table in the study's database (SQLite or PostgreSQL: an INSERT on the primary key
is the atomic step, and a takeover is an UPDATE conditioned on the stale row), or a file beside a journal (read,
checked and rewritten under Optuna's own journal file lock). Beats are wall-clock seconds: a fleet's clocks must
agree to well within GRACE_S (NTP does).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from fitter.paths import write_atomic

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

GRACE_S = 30.0  # a claim not beaten for this long is stale (the holder beats every few seconds)
TABLE = "fitter_claims"


@dataclass(frozen=True)
class Worker:
    """One `fitter tune` process of a fleet, as its trials and the results name it."""

    host: str
    pid: int

    @property
    def name(self) -> str:
        return f"{self.host}:{self.pid}"

    @classmethod
    def this(cls) -> Worker:
        return cls(socket.gethostname(), os.getpid())


@dataclass(frozen=True)
class Row:
    """A claim as stored: who holds it, the trial it launched (once known), its last beat, whether its work ended."""

    what: str
    worker: str
    trial: int | None
    beat_at: float
    done: bool


@dataclass(frozen=True)
class Claim:
    """The answer to a claim: `granted` to this worker, or held by `holder` (still working, or `done`). A claim
    granted over a stale one carries the dead holder and the trial it left RUNNING (`stale_trial`), for the new holder
    to fail."""

    granted: bool
    holder: str
    trial: int | None = None
    done: bool = False
    stale_holder: str | None = None
    stale_trial: int | None = None


def claim_id(what: str) -> str:
    """A fixed-width key for any claim (config keys run to hundreds of characters)."""
    return hashlib.sha256(what.encode()).hexdigest()[:40]


def decide(row: Row | None, worker: str, now: float, grace_s: float, dead: bool = False) -> Claim:
    """Who gets a claim, given its stored row (pure): nobody holds it → this worker; this worker holds it → still
    this worker; its holder finished → held, done; its holder stopped beating before finishing, or is `dead` (a
    process of this host that is gone: a killed tune run again at once) → this worker takes it over; else held."""
    if row is None or row.worker == worker:
        return Claim(True, worker)
    if row.done:
        return Claim(False, row.worker, row.trial, done=True)
    if dead or now - row.beat_at > grace_s:
        return Claim(True, worker, stale_holder=row.worker, stale_trial=row.trial)
    return Claim(False, row.worker, row.trial)


def gone(worker: str) -> bool:
    """A worker of this host whose process no longer runs (a pid reused since reads as running: the beat's grace
    decides then). Another host's worker is never known gone: only its beat says."""
    host, _, pid = worker.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: it runs
        return False
    return False


def stale(row: Row, now: float, grace_s: float) -> bool:
    """An unfinished claim whose holder stopped beating or is gone."""
    return not row.done and (now - row.beat_at > grace_s or gone(row.worker))


class Claims:
    """Claims of one study. Subclasses store the rows; the decision is `decide`'s."""

    grace_s = GRACE_S

    def claim(self, what: str, worker: str) -> Claim:
        raise NotImplementedError

    def settle(self, what: str, worker: str, trial: int) -> None:
        """Record the trial the holder launched for the claim (so a takeover can fail it)."""
        self._update(what, worker, trial=trial)

    def finish(self, what: str, worker: str, trial: int | None = None) -> None:
        """The holder's work on the claim ended (its trial is told): others answer it from storage from now on."""
        self._update(what, worker, trial=trial, done=True)

    def release(self, what: str, worker: str) -> None:
        """The holder gives the claim up unfinished (e.g. it was stopped): the next worker may take it at once."""
        raise NotImplementedError

    def beat(self, worker: str) -> None:
        """Every unfinished claim of `worker` is alive now."""
        raise NotImplementedError

    def row(self, what: str) -> Row | None:
        raise NotImplementedError

    def _update(self, what: str, worker: str, trial: int | None = None, done: bool = False) -> None:
        raise NotImplementedError


class MemoryClaims(Claims):
    """Claims of an in-memory study (one process): a dict under a lock."""

    def __init__(self) -> None:
        self._rows: dict[str, Row] = {}
        self._lock = threading.Lock()

    def claim(self, what: str, worker: str) -> Claim:
        with self._lock:
            r = self._rows.get(what)
            c = decide(r, worker, time.time(), self.grace_s, r is not None and gone(r.worker))
            if c.granted:
                self._rows[what] = Row(what, worker, None, time.time(), False)
            return c

    def release(self, what: str, worker: str) -> None:
        with self._lock:
            if (r := self._rows.get(what)) is not None and r.worker == worker and not r.done:
                del self._rows[what]

    def beat(self, worker: str) -> None:
        with self._lock:
            for k, r in self._rows.items():
                if r.worker == worker and not r.done:
                    self._rows[k] = Row(r.what, r.worker, r.trial, time.time(), r.done)

    def row(self, what: str) -> Row | None:
        return self._rows.get(what)

    def _update(self, what: str, worker: str, trial: int | None = None, done: bool = False) -> None:
        with self._lock:
            r = self._rows.get(what)
            if r is not None and r.worker == worker:
                self._rows[what] = Row(what, worker, trial if trial is not None else r.trial, time.time(),
                                       done or r.done)


class SqlClaims(Claims):
    """Claims in a table of the study's own database (SQLite or PostgreSQL), through the storage's SQLAlchemy engine.
    A new claim is an INSERT (the primary key refuses a second one); a takeover an UPDATE that matches only the
    stale row it read, so of two workers taking over the same claim one gets it."""

    def __init__(self, engine: Any, study: str) -> None:
        import sqlalchemy as sa

        self._sa = sa
        self._engine = engine
        self._study = study
        meta = sa.MetaData()
        self._t = sa.Table(
            TABLE, meta,
            sa.Column("study", sa.String(512), primary_key=True),
            sa.Column("claim", sa.String(40), primary_key=True),
            sa.Column("what", sa.Text, nullable=False),
            sa.Column("worker", sa.String(512), nullable=False),
            sa.Column("trial", sa.Integer, nullable=True),
            sa.Column("beat_at", sa.Float, nullable=False),
            sa.Column("done", sa.Boolean, nullable=False))
        for attempt in range(5):  # workers starting together race to create the table: the loser finds it made
            try:
                meta.create_all(engine, checkfirst=True)
                return
            except sa.exc.SQLAlchemyError:
                if sa.inspect(engine).has_table(TABLE):
                    return
                if attempt == 4:
                    raise
                time.sleep(0.1 * (attempt + 1))

    def _where(self, what: str) -> Any:
        t = self._t
        return self._sa.and_(t.c.study == self._study, t.c.claim == claim_id(what))

    def row(self, what: str) -> Row | None:
        t = self._t
        with self._engine.connect() as con:
            r = con.execute(self._sa.select(t.c.what, t.c.worker, t.c.trial, t.c.beat_at, t.c.done)
                            .where(self._where(what))).first()
        return None if r is None else Row(r.what, r.worker, r.trial, float(r.beat_at), bool(r.done))

    def claim(self, what: str, worker: str) -> Claim:
        sa, t = self._sa, self._t
        for _ in range(10):
            now = time.time()
            try:
                with self._engine.begin() as con:
                    con.execute(sa.insert(t).values(study=self._study, claim=claim_id(what), what=what[:4000],
                                                    worker=worker, trial=None, beat_at=now, done=False))
                return Claim(True, worker)
            except sa.exc.IntegrityError:
                pass
            row = self.row(what)
            if row is None:  # released between the INSERT and the SELECT: try again
                continue
            c = decide(row, worker, now, self.grace_s, gone(row.worker))
            if not c.granted or row.worker == worker:
                return c
            with self._engine.begin() as con:
                taken = con.execute(sa.update(t).where(self._where(what), t.c.worker == row.worker,
                                                       t.c.beat_at == row.beat_at, t.c.done.is_(False))
                                    .values(worker=worker, trial=None, beat_at=now)).rowcount
            if taken == 1:
                return c
        raise RuntimeError(f"claim {what!r}: no answer after 10 tries")

    def release(self, what: str, worker: str) -> None:
        t = self._t
        with self._engine.begin() as con:
            con.execute(self._sa.delete(t).where(self._where(what), t.c.worker == worker, t.c.done.is_(False)))

    def beat(self, worker: str) -> None:
        t = self._t
        with self._engine.begin() as con:
            con.execute(self._sa.update(t).where(t.c.study == self._study, t.c.worker == worker,
                                                 t.c.done.is_(False)).values(beat_at=time.time()))

    def _update(self, what: str, worker: str, trial: int | None = None, done: bool = False) -> None:
        t = self._t
        values: dict[str, Any] = {"beat_at": time.time()}
        if trial is not None:
            values["trial"] = trial
        if done:
            values["done"] = True
        with self._engine.begin() as con:
            con.execute(self._sa.update(t).where(self._where(what), t.c.worker == worker).values(**values))


class FileClaims(Claims):
    """Claims beside a journal file (Optuna's JournalFileBackend on a shared filesystem without a database): one JSON
    file, read, decided and replaced whole (fitter.paths.write_atomic) under Optuna's journal file lock (a symlink
    lock, safe on NFS), so the whole claim is one atomic step."""

    def __init__(self, path: Path, study: str) -> None:
        from optuna.storages.journal import JournalFileSymlinkLock

        self.path = path
        self._study = study
        self._lock = JournalFileSymlinkLock(str(path), grace_period=int(GRACE_S))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        self._lock.acquire()
        try:
            try:
                doc = json.loads(self.path.read_text())
            except FileNotFoundError:
                doc = {}
            before = json.dumps(doc, sort_keys=True)
            yield doc
            if json.dumps(doc, sort_keys=True) != before:
                write_atomic(self.path, json.dumps(doc))
        finally:
            self._lock.release()

    def _rows(self, doc: dict[str, Any]) -> dict[str, Any]:
        rows: dict[str, Any] = doc.setdefault(self._study, {})
        return rows

    @staticmethod
    def _row(r: dict[str, Any] | None) -> Row | None:
        return None if r is None else Row(r["what"], r["worker"], r["trial"], float(r["beat_at"]), bool(r["done"]))

    def row(self, what: str) -> Row | None:
        with self._locked() as doc:
            return self._row(doc.get(self._study, {}).get(claim_id(what)))

    def claim(self, what: str, worker: str) -> Claim:
        with self._locked() as doc:
            rows = self._rows(doc)
            now = time.time()
            row = self._row(rows.get(claim_id(what)))
            c = decide(row, worker, now, self.grace_s, row is not None and gone(row.worker))
            if c.granted:
                rows[claim_id(what)] = {"what": what, "worker": worker, "trial": None, "beat_at": now, "done": False}
            return c

    def release(self, what: str, worker: str) -> None:
        with self._locked() as doc:
            rows = self._rows(doc)
            r = rows.get(claim_id(what))
            if r is not None and r["worker"] == worker and not r["done"]:
                del rows[claim_id(what)]

    def beat(self, worker: str) -> None:
        with self._locked() as doc:
            for r in self._rows(doc).values():
                if r["worker"] == worker and not r["done"]:
                    r["beat_at"] = time.time()

    def _update(self, what: str, worker: str, trial: int | None = None, done: bool = False) -> None:
        with self._locked() as doc:
            r = self._rows(doc).get(claim_id(what))
            if r is not None and r["worker"] == worker:
                r["beat_at"] = time.time()
                if trial is not None:
                    r["trial"] = trial
                r["done"] = r["done"] or done


def claims_for(storage: Any, study: str, journal: Path | None = None) -> Claims:
    """The claims of `study` where its storage keeps it: its database, beside its journal file, or in memory."""
    backend = getattr(storage, "_backend", storage)  # Optuna wraps an RDBStorage in its _CachedStorage
    if isinstance(backend, optuna.storages.RDBStorage):
        return SqlClaims(backend.engine, study)
    if journal is not None:
        return FileClaims(journal.with_name(journal.name + ".fitter-claims.json"), study)
    return MemoryClaims()


class Beater:
    """Beats this worker's claims every `interval` seconds on a daemon thread while it works (the trial's own
    heartbeat is Optuna's; this one keeps the claims alive, for every storage)."""

    def __init__(self, claims: Claims, worker: str, interval: float = 5.0) -> None:
        self.claims, self.worker, self.interval = claims, worker, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Beater:
        def run() -> None:
            while not self._stop.wait(self.interval):
                with contextlib.suppress(Exception):  # a storage hiccup: the next beat tries again
                    self.claims.beat(self.worker)

        self._thread = threading.Thread(target=run, name="fitter-claims", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


TOLD = {"ok": TrialState.COMPLETE, "oom": TrialState.PRUNED}  # how `launch` ends a trial of each outcome; else FAIL


def measured(t: FrozenTrial) -> bool:
    """A launched trial that its worker told as its measurement says. One whose worker died mid-run was failed by
    heartbeat (or by the claim's beat): it has no outcome, or (killed between the two) an outcome it was not told
    with. Either way it was never measured, and the config is free to launch again."""
    outcome = t.user_attrs.get("outcome")
    return bool(t.user_attrs.get("launched")) and outcome is not None and t.state == TOLD.get(outcome,
                                                                                                TrialState.FAIL)


def fail_trial(study: optuna.Study, number: int, reason: str) -> None:
    """Fail a RUNNING trial another worker left behind; a trial already finished (by its worker, or failed by a third
    one) is left as it is."""
    from fitter.storage.optuna_api import fail_running

    fail_running(study, number, reason)


def wait_for_others(study: optuna.Study, claims: Claims, worker: str, stop: threading.Event,
                    log: Callable[[str], None]) -> None:
    """Until no other worker's launched trial is RUNNING (the confirm rounds compare the whole study); a trial
    whose worker stopped beating is failed on the way."""
    said: set[int] = set()
    while not stop.is_set():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        running = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                   if t.user_attrs.get("launched") and t.user_attrs.get("worker") != worker]
        for t in running:
            row = claims.row(str(t.user_attrs.get("claim", "")))
            if row is None or row.worker != t.user_attrs.get("worker") or stale(row, time.time(), claims.grace_s):
                fail_trial(study, t.number, f"its worker {t.user_attrs.get('worker')} stopped beating "
                           f"(killed?); failed by {worker}")
        if not running:
            return
        new = [t for t in running if t.number not in said]
        if new:
            said.update(t.number for t in new)
            log("fitter: waiting for " + ", ".join(
                f"trial {t.number} ({t.user_attrs.get('worker')})" for t in new) + " before the confirm rounds")
        time.sleep(1.0)


def launch_slot(claim: Callable[[str], Claim], launched: int, n_trials: int) -> str | None:
    """One of a study's `n_trials` launches ("launch K", K from the `launched` so far), claimed, or None when the
    fleet holds them all: every worker checks the count before it screens, and workers that check at once would
    otherwise launch past it. The holder finishes its slot once its launch is told; a dead worker's goes stale and is
    taken over (its trial, launched, is counted: the scan starts past it)."""
    for k in range(launched, n_trials):
        if claim(f"launch {k}").granted:
            return f"launch {k}"
    return None


def heartbeat(storage: Any, trial_id: int, claims: Claims, worker: str, interval: float) -> Callable[[], None]:
    """Record a running trial's heartbeat (RDB storages; a journal has only the claims' beat) and beat the worker's
    claims every `interval` s until the returned function is called: a killed tune leaves a stale trial the next one
    fails (optuna.storages.fail_stale_trials), never a trial RUNNING forever."""
    stop = threading.Event()
    record = getattr(storage, "record_heartbeat", None)

    def beat() -> None:
        while True:
            try:
                if record is not None:
                    record(trial_id)
                claims.beat(worker)
            except Exception:
                return
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name="fitter-heartbeat", daemon=True)
    thread.start()

    def done() -> None:
        stop.set()
        thread.join()

    return done
