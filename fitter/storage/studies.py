"""Where a tune keeps its study: `results/<model>/<machine>/<llama.cpp build>/study.db` (Optuna, SQLite) or any
Optuna storage URL, beside `trials.csv` and `pareto.json` (fitter.results.trials, fitter.results.pareto).

A study is keyed by the model identity (sha256 of its GGUF headers), the machine fingerprint and the llama.cpp
build; opening a study whose key differs is an error that names both values, and nothing is overwritten.
"""

from __future__ import annotations

import os
import sqlite3
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from fitter.errors import FitterError
from fitter.paths import WriteError, safe_name
from fitter.storage.faults import check_refused
from fitter.storage.fleet import TABLE as CLAIMS_TABLE

STUDY_NAME = "fitter"
HEARTBEAT_S = 5
GRACE_S = 20
KEY_ATTRS = ("model_identity", "machine_fingerprint", "llama_cpp_commit")


class ResultsError(FitterError):
    pass


def slug(text: str) -> str:
    return safe_name(text)


def machine_dir_name(machine: dict[str, Any], emulated_mib: int | tuple[int, ...] | None) -> str:
    """GPUs (or cpu-only / an emulated cap, or caps: 96+48) plus the fingerprint, so two machines never share a
    folder."""
    if emulated_mib is not None:
        kind = f"{machine['emulated_gpu_kind']}-" if machine.get("emulated_gpu_kind") in ("cuda", "vulkan") else ""
        caps = "+".join(map(str, emulated_mib)) if isinstance(emulated_mib, tuple) else emulated_mib
        gpus = f"emulated-{kind}{caps}MiB"
    elif machine.get("gpus"):
        gpus = "+".join(slug(g) for g in machine["gpus"])
    else:
        gpus = "cpu-only"
    return f"{gpus}-{machine['fingerprint'][:8]}"


def result_dir(root: Path, model_path: str, machine_dir: str, commit: str) -> Path:
    """Three folder names under `root`, none of which can leave it (fitter.paths.safe_name)."""
    return root / slug(Path(model_path).stem) / safe_name(machine_dir, keep="+") / slug(commit)


@dataclass(frozen=True)
class StudyKey:
    model_identity: str
    machine_fingerprint: str
    llama_cpp_commit: str

    def attrs(self) -> dict[str, str]:
        return {"model_identity": self.model_identity, "machine_fingerprint": self.machine_fingerprint,
                "llama_cpp_commit": self.llama_cpp_commit}


def storage_url(folder: Path) -> str:
    return f"sqlite:///{folder / 'study.db'}"


def ensure_writable(folder: Path) -> None:
    """Refuse a results folder that cannot be written before anything starts: by writing a file there and removing
    it (a read-only mount refuses even root, whom permission bits do not stop; os.access would say yes)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ResultsError(f"results folder {folder}: cannot create it: {e.strerror}; give --results DIR") from None
    probe = folder / f".fitter-write-test-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"x")  # one byte: a full disk refuses it, where an empty file may still be created
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as e:
        refused = WriteError(folder, e)
        raise ResultsError(f"results folder {refused}: study.db and the results go there; {refused.remedy} or give "
                           "--results DIR; nothing was started") from None


def study_name(model_path: str, given: str | None, default_storage: bool) -> str:
    """The study's name in its storage: `fitter` in a results folder's own study.db (the folder is keyed already);
    in a storage a fleet shares, `fitter-<model file stem>` unless `--study-name` gives one. Not keyed by the machine
    or the build: a worker whose fingerprint, model or build differs must find the study and be refused, naming the
    difference, instead of silently starting a study of its own."""
    if given:
        return given
    return STUDY_NAME if default_storage else f"{STUDY_NAME}-{slug(Path(model_path).stem)}"


def journal_path(url: str) -> Path | None:
    """`journal:PATH` (or `journal:///abs/path`): Optuna's journal file storage, for a fleet on a shared filesystem
    without a database."""
    if not url.startswith("journal:"):
        return None
    rest = url.removeprefix("journal:")
    return Path(rest.removeprefix("//") if rest.startswith("///") else rest)


def _storage(url: str, heartbeat_s: int, grace_s: int) -> optuna.storages.BaseStorage:
    journal = journal_path(url)
    if journal is not None:
        from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

        if not journal.parent.is_dir():
            raise ResultsError(f"--storage {url}: the folder {journal.parent} does not exist")
        # the symlink lock works on NFS (v2 and later), where a fleet without a database shares its journal
        return optuna.storages.JournalStorage(JournalFileBackend(str(journal), JournalFileSymlinkLock(str(journal))))
    # SQLite: several local workers write one file; wait for a busy database instead of failing at 5 s
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite:") else None
    with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna since 2.9; fitter relies on them
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(url, engine_kwargs=engine, heartbeat_interval=heartbeat_s,
                                          grace_period=grace_s)


def _is_creation_race(e: Exception) -> bool:
    """Workers creating one storage together: Optuna's tables or its alembic version row made by another at the same
    moment (SQLite: 'table … already exists', 'UNIQUE constraint failed', or 'database is locked' while another
    creates it; PostgreSQL: 'already exists', 'duplicate key')."""
    text = str(e).lower()
    return any(s in text for s in ("already exists", "unique constraint failed", "duplicate key",
                                   "database is locked"))


def open_study(url: str, key: StudyKey, directions: list[Any], sampler: optuna.samplers.BaseSampler,
               settings: dict[str, Any], heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S,
               name: str = STUDY_NAME) -> optuna.Study:
    """Create or join the study `name` at `url`: whoever starts first creates it, the others join it. Heartbeats let a
    later tune fail the trial a killed one left RUNNING (optuna.storages.fail_stale_trials) and keep every finished
    one. A study of another model, machine or build is refused, naming the difference."""
    if url.startswith("sqlite:///"):
        db = Path(url.removeprefix("sqlite:///"))
        if db.exists():
            check_study_db(db, "move it away or give --results DIR; nothing was changed", require_tables=False)
    for attempt in range(8):
        try:
            storage = _storage(url, heartbeat_s, grace_s)
            study = optuna.create_study(storage=storage, study_name=name, directions=directions, sampler=sampler,
                                        load_if_exists=True)
            break
        except (ImportError, ValueError) as e:
            raise ResultsError(f"--storage {url}: cannot open it: {e}") from None
        except ResultsError:
            raise
        except Exception as e:  # sqlalchemy's errors for corrupt or foreign databases, or a creation race
            if _is_creation_race(e) and attempt < 7:
                time.sleep(0.2 * (attempt + 1))
                continue
            check_refused(e, url)  # not corrupt: a disk that refuses the write (read-only, full)
            raise ResultsError(f"{url}: not a readable Optuna study database ({type(e).__name__}: "
                               f"{str(e).splitlines()[0]}); move it away or give --storage URL; nothing was changed"
                               ) from None
    existing = study.user_attrs
    if not existing.get("model_identity"):
        # one attribute per write, so "model_identity" goes last: a worker that joins while these are written sees
        # the study as new until every key is there (it was refused for "another machine fingerprint (None…)")
        attrs = {**settings, **key.attrs()}
        for k, v in sorted(attrs.items(), key=lambda kv: kv[0] == "model_identity"):
            study.set_user_attr(k, v)
        existing = study.user_attrs  # two workers creating it together: the one whose attributes stayed decides
    for attr in KEY_ATTRS:
        if existing.get(attr) != key.attrs()[attr]:
            raise ResultsError(f"{url}: study {name!r} there is for another {attr.replace('_', ' ')} "
                               f"({existing.get(attr)!r}, this run: {key.attrs()[attr]!r}); give --results DIR, "
                               f"--study-name NAME or --storage URL for a new study; nothing was changed")
    if [d.name.lower() for d in study.directions] != directions:
        raise ResultsError(f"{url}: the study there optimizes {existing.get('objectives')}, this run "
                           f"{settings.get('objectives')}: give --results DIR for a new study")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    return study


# Optuna's tables (optuna/storages/_rdb/models.py) and the fleet's claims. Optuna creates
# them one at a time (sqlalchemy's create_all), so a worker joining a fleet that is creating its study sees a subset.
STUDY_TABLES = frozenset({"studies", "study_directions", "study_system_attributes", "study_user_attributes",
                          "trial_heartbeats", "trial_intermediate_values", "trial_params", "trial_system_attributes",
                          "trial_user_attributes", "trial_values", "trials", "version_info", "alembic_version",
                          CLAIMS_TABLE})


def check_study_db(path: Path, advice: str, require_tables: bool) -> None:
    """Refuse anything but an Optuna SQLite database before Optuna opens it: Optuna would add its tables to any
    SQLite file. Read-only (a running tune may be writing to it). An empty SQLite file, or one without tables, is a
    new study unless `require_tables`."""
    with path.open("rb") as f:
        head = f.read(16)
    if not head and not require_tables:
        return
    if head != b"SQLite format 3\x00":
        raise ResultsError(f"{path}: not an SQLite database (it starts with {head[:8]!r}); {advice}")
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.Error as e:
        raise ResultsError(f"{path}: cannot read the SQLite database ({e}); {advice}") from None
    complete = {"studies", "trials", "version_info"} <= tables
    # only Optuna's (and the fleet's) tables, some of them: a study another worker is creating right now
    if not complete and (require_tables or tables - STUDY_TABLES):
        raise ResultsError(f"{path}: an SQLite database without Optuna's tables (it has: "
                           f"{', '.join(sorted(tables)) or 'none'}); {advice}")
