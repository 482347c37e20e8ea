"""Several files of one model (`fitter tune A.gguf B.gguf …`: Q4_K_M against Q8_0, a vendor's mix): each file's
placements tuned under the same budget, quality measured against the highest-precision file's f16 run, and every
file's confirmed front on one: which file to run on this machine, and how.

The files must be one model: the same architecture and vocabulary (KL divergence compares the same tokens'
probabilities). Each file is its own study and result folder (a resumed multi-file tune resumes each); the combined
front is judged with the same noise model as one file's (fitter.noise: the interval of the rounds' log ratios), over
rounds that were interleaved within each file but not across files: paired arbitrarily, two files' independent rounds
give differences whose spread is both files' spreads together, the unpaired test, so a difference between files
needs to be larger to count than one within a file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fitter.errors import FitterError
from fitter.measure.quality import ModelFile, reference_file
from fitter.paths import write_atomic
from fitter.results.pareto import ParetoDoc
from fitter.results.quality_record import QUALITY, kv_of_flags
from fitter.tune.confirm import final_front
from fitter.units import MIB

FILES_RESULT = "files.json"  # the combined front, in the results root


def check_files(files: Sequence[ModelFile]) -> None:
    """One model in several files, each given once (fitter.measure.quality.reference_file checks the architecture
    and the vocabulary); a one-line refusal naming the file otherwise."""
    seen: set[str] = set()
    for f in files:
        where = str(Path(f.path).resolve())
        if where in seen:
            raise FitterError(f"{f.path}: given twice; give each file of the model once")
        seen.add(where)
    reference_file(files)


def combined(results: list[tuple[ModelFile, ParetoDoc, Path]], reference: ModelFile) -> dict[str, Any]:
    """files.json: every file's confirmed entries on one front (tg, pp, VRAM, quality), each naming its file."""
    entries: list[dict[str, Any]] = []
    for f, doc, folder in results:
        for e in doc.pareto:
            data = dict(e.data)
            data.update({"model": f.path, "bits_per_weight": round(f.bits_per_weight, 3), "result": str(folder),
                         "trial": f"{Path(f.path).stem}:{e.trial}"})
            entries.append(data)
    objectives = tuple(o for o in ("tg", "pp", "vram", QUALITY) if all(
        o != QUALITY or isinstance(e.get(QUALITY), dict) for e in entries))
    front, dropped = final_front(objectives, entries, [])
    return {"reference_model": reference.path, "objectives": list(objectives),
            "files": [{"model": f.path, "bits_per_weight": round(f.bits_per_weight, 3), "result": str(folder),
                       "front": len(doc.pareto)} for f, doc, folder in results],
            "pareto": front, "dropped": dropped}


def write_combined(root: Path, doc: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    return write_atomic(root / FILES_RESULT, json.dumps(doc, indent=1) + "\n")


def combined_lines(doc: dict[str, Any]) -> list[str]:
    """The combined front as `fitter tune A B` prints it: one row per config, its file first."""
    lines = [f"\none front over {len(doc['files'])} files (quality against {doc['reference_model']}'s f16 run):",
             f"{'file:trial':<28} {'BPW':>5} {'pp t/s':>9} {'tg t/s':>8} {'VRAM MiB':>9} {'KV':>11} {'KLD':>9}"
             "  flags"]
    for e in doc["pareto"]:
        m = e.get("measurement") or {}
        q = e.get(QUALITY)
        kld = f"{q['kld']:.4g}" if q else "-"
        lines.append(f"{e['trial']:<28} {e['bits_per_weight']:>5.2f} {_ts(m, 'pp'):>9} {_ts(m, 'tg'):>8} "
                     f"{(e.get('vram_bytes') or 0) / MIB:>9.1f} {kv_of_flags(e.get('flags') or []):>11} "
                     f"{kld:>9}  {' '.join(e.get('flags') or [])}")
    for d in doc["dropped"]:
        lines.append(f"{d['trial']:<28} dropped: {d['reason']}")
    return lines


def _ts(m: dict[str, Any], key: str) -> str:
    v = (m.get(key) or {}).get("avg_ts")
    return f"{v:.1f}" if isinstance(v, int | float) else "-"
