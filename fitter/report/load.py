"""A results folder as `fitter report` reads it: the Optuna study (read-only, whether or not the tune still runs) and
its pareto.json once the tune has finished (fitter.results.pareto, the one loader)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import optuna

from fitter.errors import FitterError
from fitter.results.measurement import ResultError
from fitter.results.pareto import RESULT_FILE, ParetoDoc
from fitter.results.pareto import load_result as load_pareto
from fitter.search.request import OBJECTIVES
from fitter.storage.studies import KEY_ATTRS, STUDY_NAME, check_study_db


class ReportError(FitterError):
    pass


@dataclass(frozen=True)
class StudyResult:
    folder: Path
    db: Path
    study: optuna.Study
    objectives: tuple[str, ...]
    pareto: ParetoDoc | None  # pareto.json; None while the tune runs (or when it ended before writing it)

    @property
    def title(self) -> str:
        """model · machine · build, from the folder layout results/<model>/<machine>/<build>."""
        return " · ".join(self.folder.resolve().parts[-3:])


def result_paths(path: Path) -> tuple[Path, Path]:
    """(folder, study.db) for RESULT given as the folder, its study.db or its pareto.json."""
    folder = path.parent if path.is_file() and path.name in ("study.db", "pareto.json") else path
    if not folder.exists():
        raise ReportError(f"{path}: no such results folder (give the folder that holds study.db)")
    if not folder.is_dir():
        raise ReportError(f"{path}: not a results folder (give the folder that holds study.db, or its pareto.json)")
    db = folder / "study.db"
    if not db.is_file():
        raise ReportError(f"{folder}: no study.db there: not a fitter results folder (fitter tune writes "
                          f"results/<model>/<machine>/<build>/study.db)")
    return folder, db


def load_study_result(path: Path) -> StudyResult:
    """Open a results folder's study (whether or not the tune still runs) and its pareto.json when there is one."""
    folder, db = result_paths(path)
    check_study_db(db, "not a fitter study", require_tables=True)
    url = f"sqlite:///{db.resolve()}"
    try:
        names = optuna.get_all_study_names(storage=url)
        name = STUDY_NAME if STUDY_NAME in names else (names[0] if len(names) == 1 else None)
        if name is None:
            raise ReportError(f"{db}: no study named {STUDY_NAME!r} (studies there: {', '.join(names) or 'none'}); "
                              f"not a fitter study")
        study = optuna.load_study(study_name=name, storage=url)
    except ReportError:
        raise
    except Exception as e:  # sqlalchemy's errors for a locked, corrupt or foreign database
        raise ReportError(f"{db}: cannot read the Optuna study ({type(e).__name__}: {e})") from None
    attrs = study.user_attrs
    missing = [k for k in (*KEY_ATTRS, "objectives") if k not in attrs]
    if missing:
        raise ReportError(f"{db}: study {name!r} is not a fitter study (no {', '.join(missing)} in its attributes)")
    objectives = tuple(str(o) for o in attrs["objectives"])
    if not set(objectives) <= set(OBJECTIVES):  # figure files are named after them
        raise ReportError(f"{db}: the study records objectives {list(objectives)}; fitter's are "
                          f"{', '.join(OBJECTIVES)}")
    if len(objectives) != len(study.directions):
        raise ReportError(f"{db}: the study records objectives {list(objectives)} but optimizes "
                          f"{len(study.directions)} values")
    return StudyResult(folder, db, study, objectives, _read_pareto(folder / RESULT_FILE))


def _read_pareto(path: Path) -> ParetoDoc | None:
    if not path.is_file():
        return None
    try:
        return load_pareto(path)
    except ResultError as e:
        raise ReportError(f"{path}: not a readable {RESULT_FILE} ({e.reason}); move it away to report the study "
                          "alone") from None
