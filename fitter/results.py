"""A tuning result on disk: `results/<model>/<machine>/<llama.cpp build>/` with `study.db` (the Optuna study),
`trials.csv` and `pareto.json` (CONTRACTS.md).

A study is keyed by the model identity (sha256 of its GGUF headers), the machine fingerprint and the llama.cpp
build; opening a study whose key differs is an error that names both values, and nothing is overwritten.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from fitter.errors import FitterError

STUDY_NAME = "fitter"
HEARTBEAT_S = 5
GRACE_S = 20
KEY_ATTRS = ("model_identity", "machine_fingerprint", "llama_cpp_commit")


class ResultsError(FitterError):
    pass


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "unknown"


def machine_dir_name(machine: dict[str, Any], emulated_mib: int | None) -> str:
    """GPUs (or cpu-only / an emulated cap) plus the fingerprint, so two machines never share a folder."""
    if emulated_mib is not None:
        gpus = f"emulated-{emulated_mib}MiB"
    elif machine.get("gpus"):
        gpus = "+".join(slug(g) for g in machine["gpus"])
    else:
        gpus = "cpu-only"
    return f"{gpus}-{machine['fingerprint'][:8]}"


def result_dir(root: Path, model_path: str, machine_dir: str, commit: str) -> Path:
    return root / slug(Path(model_path).stem) / machine_dir / slug(commit)


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
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ResultsError(f"results folder {folder}: cannot create it: {e.strerror}; give --results DIR") from None
    if not os.access(folder, os.W_OK):
        raise ResultsError(f"results folder {folder}: not writable; give --results DIR")


def open_study(url: str, key: StudyKey, directions: list[Any], sampler: optuna.samplers.BaseSampler,
               settings: dict[str, Any], heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S) -> optuna.Study:
    """Create or resume the study at `url`. Heartbeats let a resumed study fail the trial a killed tune left
    RUNNING (optuna.storages.fail_stale_trials) and keep every finished one."""
    name = STUDY_NAME if url.startswith("sqlite:") else f"{STUDY_NAME}-{key.model_identity[:12]}-" \
        f"{key.machine_fingerprint[:8]}-{slug(key.llama_cpp_commit)}"
    if url.startswith("sqlite:///"):
        db = Path(url.removeprefix("sqlite:///"))
        if db.exists():
            check_study_db(db, "move it away or give --results DIR; nothing was changed", require_tables=False)
    try:
        with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna since 2.9; fitter relies on them
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = optuna.storages.RDBStorage(url, heartbeat_interval=heartbeat_s, grace_period=grace_s)
        study = optuna.create_study(storage=storage, study_name=name, directions=directions, sampler=sampler,
                                    load_if_exists=True)
    except (ImportError, ValueError) as e:
        raise ResultsError(f"--storage {url}: cannot open it: {e}") from None
    except Exception as e:  # sqlalchemy's errors for corrupt or foreign databases
        raise ResultsError(f"{url}: not a readable Optuna study database ({type(e).__name__}: {e}); move it away "
                           f"or give --storage URL; nothing was changed") from None
    existing = study.user_attrs
    if existing.get("model_identity"):
        for attr in KEY_ATTRS:
            if existing.get(attr) != key.attrs()[attr]:
                raise ResultsError(f"{url}: the study there is for another {attr.replace('_', ' ')} "
                                   f"({existing.get(attr)!r}, this run: {key.attrs()[attr]!r}); give --results DIR "
                                   f"or --storage URL for a new study; nothing was changed")
        if [d.name.lower() for d in study.directions] != directions:
            raise ResultsError(f"{url}: the study there optimizes {existing.get('objectives')}, this run "
                               f"{settings.get('objectives')}: give --results DIR for a new study")
    else:
        for k, v in {**key.attrs(), **settings}.items():
            study.set_user_attr(k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    return study


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
    if (tables or require_tables) and not {"studies", "trials", "version_info"} <= tables:
        raise ResultsError(f"{path}: an SQLite database without Optuna's tables (it has: "
                           f"{', '.join(sorted(tables)) or 'none'}); {advice}")


# -- picks -------------------------------------------------------------------------------------------------------


def picks(entries: list[dict[str, Any]]) -> dict[str, int]:
    """max-decode, max-prefill, balanced (highest min(pp/pp_best, tg/tg_best), never a sum) and min-vram (least
    VRAM within 5 % of the best decode), over confirmed Pareto entries, by trial number."""
    if not entries:
        return {}

    def tg(e: dict[str, Any]) -> float:
        return float(e["measurement"]["tg"]["avg_ts"])

    def pp(e: dict[str, Any]) -> float:
        return float(e["measurement"]["pp"]["avg_ts"])

    tg_best, pp_best = max(map(tg, entries)), max(map(pp, entries))
    out = {"max-decode": max(entries, key=tg)["trial"], "max-prefill": max(entries, key=pp)["trial"],
           "balanced": max(entries, key=lambda e: min(pp(e) / pp_best, tg(e) / tg_best))["trial"]}
    close = [e for e in entries if tg(e) >= 0.95 * tg_best]
    out["min-vram"] = min(close, key=lambda e: (e.get("vram_bytes", 0), -tg(e)))["trial"]
    return out


def ratios(measurement: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, float | None]:
    """Speed over the baseline's (None when the baseline did not run or failed)."""
    out: dict[str, float | None] = {}
    for k in ("pp", "tg"):
        base = (baseline or {}).get(k, {}).get("avg_ts") if baseline and baseline.get("outcome") == "ok" else None
        out[k] = round(measurement[k]["avg_ts"] / base, 3) if base else None
    return out


def write_pareto(folder: Path, doc: dict[str, Any]) -> Path:
    path = folder / "pareto.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)  # never a half-written result
    return path


def write_trials_csv(folder: Path, study: optuna.Study) -> Path:
    """One row per trial: Optuna's own dataframe (params, values, state, durations) plus what fitter adds."""
    df = study.trials_dataframe(attrs=("number", "state", "values", "params", "datetime_start", "duration"),
                                multi_index=False)
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    extra: dict[str, list[Any]] = {k: [] for k in ("phase", "launched", "outcome", "reason", "pp_ts", "tg_ts",
                                                   "vram_mib", "predicted_vram_mib", "same_as", "flags")}
    for number in df["number"]:
        t = trials[int(number)]
        m = t.user_attrs.get("measurement", {})
        predicted = t.user_attrs.get("predicted_bytes", {})
        extra["phase"].append(t.user_attrs.get("phase"))
        extra["launched"].append(bool(t.user_attrs.get("launched")))
        extra["outcome"].append(t.user_attrs.get("outcome") or _state_word(t))
        extra["reason"].append(t.user_attrs.get("reason", ""))
        extra["pp_ts"].append(m.get("pp", {}).get("avg_ts"))
        extra["tg_ts"].append(m.get("tg", {}).get("avg_ts"))
        vram = t.user_attrs.get("vram_bytes")
        extra["vram_mib"].append(round(vram / 2**20, 2) if vram is not None else None)
        device_predicted = sum(v for k, v in predicted.items() if k != "CPU")
        extra["predicted_vram_mib"].append(round(device_predicted / 2**20, 2) if predicted else None)
        extra["same_as"].append(t.user_attrs.get("same_as"))
        extra["flags"].append(" ".join(t.user_attrs.get("flags", [])))
    for k, v in extra.items():
        df[k] = v
    path = folder / "trials.csv"
    df.to_csv(path, index=False)
    return path


def _state_word(t: FrozenTrial) -> str:
    if t.state == TrialState.PRUNED:
        return "screened"
    return t.state.name.lower()
