"""Several files of one model on one front: each file's confirmed entries named by their file, quality beside speed
and memory, and files that are not one model's refused in one line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from fitter.errors import FitterError
from fitter.measure.quality import ModelFile
from fitter.results.pareto import Entry, ParetoDoc
from fitter.tune.files import check_files, combined, combined_lines

Q8 = ModelFile("/m/demo-Q8_0.gguf", "gpt-oss", 2048, 8.5, "a")
Q4 = ModelFile("/m/demo-Q4_0.gguf", "gpt-oss", 2048, 4.5, "b")


def _entry(trial: int, tg: float, vram: int, kld: float, flags: list[str]) -> dict[str, Any]:
    return {"trial": trial, "phase": "neighbour", "flags": flags, "vram_bytes": vram,
            "quality": {"kv": "f16/f16", "kld": kld, "kld_interval": [kld * 0.9, kld * 1.1], "kld_p99": kld * 5,
                        "same_top_pct": 99.0},
            "measurement": {"outcome": "ok", "tg": {"avg_ts": tg}, "pp": {"avg_ts": 500.0}}}


def _doc(*entries: dict[str, Any]) -> ParetoDoc:
    return cast(ParetoDoc, SimpleNamespace(pareto=[Entry.from_json(e, "p.json") for e in entries]))


def test_every_files_entries_share_one_front() -> None:
    q8 = _doc(_entry(3, 100.0, 80 << 20, 0.001, ["-ncmoe", "2"]), _entry(5, 90.0, 80 << 20, 0.001, ["-ncmoe", "3"]))
    q4 = _doc(_entry(2, 130.0, 60 << 20, 0.02, ["-ncmoe", "0", "-ctk", "q8_0"]))
    doc = combined([(Q8, q8, Path("r/q8")), (Q4, q4, Path("r/q4"))], Q8)
    assert [e["trial"] for e in doc["pareto"]] == ["demo-Q4_0:2", "demo-Q8_0:3"]  # the faster file costs quality
    assert doc["dropped"] == [{"trial": "demo-Q8_0:5", "flags": ["-ncmoe", "3"], "outcome": "dominated",
                               "reason": "its confirm runs are dominated by trial demo-Q8_0:3's"}]
    assert doc["objectives"] == ["tg", "pp", "vram", "quality"] and doc["reference_model"] == Q8.path
    assert doc["files"] == [{"model": Q8.path, "bits_per_weight": 8.5, "result": "r/q8", "front": 2},
                            {"model": Q4.path, "bits_per_weight": 4.5, "result": "r/q4", "front": 1}]
    lines = combined_lines(doc)
    assert lines[2] == ("demo-Q4_0:2                   4.50     500.0    130.0      60.0    q8_0/f16      0.02  "
                        "-ncmoe 0 -ctk q8_0")


def test_a_file_given_twice_or_of_another_model_is_refused() -> None:
    with pytest.raises(FitterError, match=r"^/m/demo-Q8_0.gguf: given twice; give each file of the model once$"):
        check_files([Q8, Q4, Q8])
    other = ModelFile("/m/llama.gguf", "llama", 2048, 4.5, "c")
    with pytest.raises(FitterError, match=r"^/m/llama.gguf: architecture llama, /m/demo-Q8_0.gguf's is gpt-oss"):
        check_files([Q8, other])
