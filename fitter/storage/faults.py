"""A disk that refuses the study or the results (full, read-only) as one line that says what is kept and how to go
on, instead of a traceback. SQLite rolls a refused write back, so the study keeps every trial finished before it;
pareto.json and trials.csv are written whole or not at all (fitter.paths.write_atomic), so the old ones stay. Either
way the same command, once the disk allows, resumes the study or writes the results."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

import optuna

from fitter.errors import FitterError
from fitter.paths import WriteError

# SQLite's messages for a disk that refuses a write: what it means and what to do
_SQLITE = (("disk is full", "disk full", "free space"), ("readonly", "read-only", "make it writable"),
           ("unable to open database file", "read-only or gone", "make it writable"),
           ("disk i/o error", "disk I/O error", "check the disk"))


class RefusedWrite(FitterError):
    """The disk refused the study or the results; nothing finished is lost."""


def check_refused(e: BaseException, url: str) -> None:
    """Raise RefusedWrite when `e` (Optuna's or SQLAlchemy's) is SQLite refusing a write to the study at `url`."""
    reason = _sqlite_error(e)
    known = next((k for k in _SQLITE if reason and k[0] in reason.lower()), None)
    if known is not None:
        raise RefusedWrite(f"{url}: {known[1]}: SQLite refused a write ({reason}); the study keeps every trial "
                           f"finished before it; {known[2]} and rerun the same command to resume") from None


@contextmanager
def study_writes(url: str) -> Iterator[None]:
    """A study write the disk refused, as one line (RefusedWrite); any other storage error as it was."""
    import sqlalchemy.exc

    try:
        yield
    except (optuna.exceptions.StorageInternalError, sqlalchemy.exc.OperationalError) as e:
        check_refused(e, url)
        raise


@contextmanager
def result_writes(url: str) -> Iterator[None]:
    """pareto.json or trials.csv refused by the disk, as one line that says the study is intact."""
    try:
        yield
    except WriteError as e:
        raise RefusedWrite(f"{e}; the study is intact at {url}; {e.remedy} and rerun the same command to write the "
                           "results (finished trials are not run again)") from None


def _sqlite_error(e: BaseException) -> str | None:
    """The sqlite3 error under Optuna's and SQLAlchemy's wrappers, as SQLite put it."""
    seen: BaseException | None = e
    while seen is not None:
        orig = getattr(seen, "orig", None)  # sqlalchemy.exc.DBAPIError: the driver's own exception
        if isinstance(orig, sqlite3.Error):
            return str(orig)
        if isinstance(seen, sqlite3.Error):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return None
