"""fitter.storage.studies: a results folder derived from a model's file name, a machine and a build stays under the
results root, whatever those are called, and the filesystem takes it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fitter.grid.record import LANDSCAPES, default_out
from fitter.storage.studies import ensure_writable, machine_dir_name, result_dir
from tests.hostile import HOSTILE_NAMES, HOSTILE_PATHS

DOTS = ["..", ".", "...", "../..", "/", "", "\0", "a/../../b", "/etc/passwd", "\\..\\..", "x" * 300, "é" * 200]
MODELS = [*HOSTILE_PATHS, *(f"/models/{n}.gguf" for n in DOTS + HOSTILE_NAMES), "/models/..", "/models/...gguf",
          "../../../outside.gguf", "/models/" + "y" * 250 + ".gguf"]
MACHINES = [machine_dir_name({"gpus": [n, n], "fingerprint": "1a2b3c4d5e6f"}, None) for n in DOTS + HOSTILE_NAMES] + [
    f"sim-{n}-1a2b3c4d" for n in DOTS + HOSTILE_NAMES] + ["..", "../../x", "/abs", "a/b", "+" * 300]
COMMITS = [*DOTS, *HOSTILE_NAMES, "0c1e570"]


def _inside(folder: Path, root: Path, depth: int) -> None:
    rel = folder.resolve().relative_to(root.resolve())  # raises if the folder left the root
    assert len(rel.parts) == depth and len(folder.relative_to(root).parts) == depth
    for part in folder.relative_to(root).parts:
        assert part not in (".", "..") and "\0" not in part and len(os.fsencode(part)) <= 255


def test_results_folders_never_leave_the_root(tmp_path: Path) -> None:
    root = tmp_path / "results"
    n = max(len(MODELS), len(MACHINES), len(COMMITS))
    for i in range(n):  # every hostile value of each part at least once, beside hostile others
        folder = result_dir(root, MODELS[i % len(MODELS)], MACHINES[i % len(MACHINES)], COMMITS[i % len(COMMITS)])
        _inside(folder, root, 3)
        ensure_writable(folder)  # the filesystem takes it
        assert folder.is_dir()


@pytest.mark.parametrize("model", ["/models/..", "/models/...gguf", "../../../outside.gguf"])
def test_a_model_named_dots_gets_a_folder_of_its_own(tmp_path: Path, model: str) -> None:
    folder = result_dir(tmp_path, model, "cpu-only-1a2b3c4d", "..")
    assert folder == tmp_path / ("outside" if "outside" in model else "unknown") / "cpu-only-1a2b3c4d" / "unknown"


def test_sane_names_keep_their_folders(tmp_path: Path) -> None:
    machine = machine_dir_name({"gpus": ["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090"],
                                "fingerprint": "1a2b3c4d5e6f"}, None)
    assert result_dir(tmp_path, "/m/gpt-oss-20b-mxfp4.gguf", machine, "0c1e570") == (
        tmp_path / "gpt-oss-20b-mxfp4" / "NVIDIA-GeForce-RTX-4090+NVIDIA-GeForce-RTX-4090-1a2b3c4d" / "0c1e570")


def test_landscape_files_stay_in_their_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for model, machine in zip(MODELS, MACHINES * 3, strict=False):
        path = default_out(model, machine)
        assert path.parent == LANDSCAPES and len(os.fsencode(path.name)) <= 255
        _inside(path, Path("."), 2)
        path.parent.mkdir(exist_ok=True)
        path.write_text("{}")  # the filesystem takes it
