"""Small generated GGUF files for tests, cached per session (generation is deterministic)."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

from fitter.gguf.demo_models import SHAPES, write_model
from tests.folders import process_folder

_DIR = process_folder("fitter-test-models-")


@cache
def model_files(shape: str, sparse: bool = False, n_shards: int = 1) -> tuple[Path, ...]:
    folder = _DIR / f"{'sparse' if sparse else 'dense'}-{n_shards}"
    folder.mkdir(exist_ok=True)
    return tuple(write_model(SHAPES[shape], folder / f"{shape}.gguf", sparse=sparse, n_shards=n_shards))


def model_file(shape: str, sparse: bool = False) -> Path:
    return model_files(shape, sparse)[0]


@cache
def projector_file(shape: str, model: str) -> Path:
    """fitter.gguf.demo_projectors' projector `shape` made for `model` (its width)."""
    from fitter.gguf.demo_projectors import PROJECTORS, write_projector

    folder = _DIR / "mmproj"
    folder.mkdir(exist_ok=True)
    return write_projector(PROJECTORS[shape], SHAPES[model].n_embd, folder / f"{shape}@{model}.gguf")


def unknown_arch_model(folder: Path) -> Path:
    """llama-tiny as an architecture fitter has not matched ('llamb'): every 'llama' in its header (the
    general.architecture value and the `llama.` key prefix) renamed to a string of the same length."""
    from fitter.gguf.header import read_header

    src = model_file("llama-tiny")
    data = bytearray(src.read_bytes())
    end = read_header(src).shards[0].data_offset
    data[:end] = bytes(data[:end]).replace(b"llama", b"llamb")
    out = folder / "llamb-tiny.gguf"
    out.write_bytes(bytes(data))
    return out


def renamed_in_header(shape: str, folder: Path, old: bytes, new: bytes) -> Path:
    """`shape`'s header-only file with the bytes `old` replaced by `new` of the same length in its header (a tensor
    renamed, a key renamed), so every offset holds; the data region stays a hole."""
    from fitter.gguf.header import read_header

    assert len(old) == len(new)
    src = model_file(shape, sparse=True)
    end = read_header(src).shards[0].data_offset
    header = src.read_bytes()[:end]
    assert old in header
    out = folder / f"{shape}-renamed.gguf"
    out.write_bytes(header.replace(old, new))
    os.truncate(out, src.stat().st_size)
    return out


@cache
def golden_arch_model(name: str) -> Path:
    """llama.cpp's own tiny model `name` of tests/golden/archs.json (its tests/test-llama-archs.cpp builds them),
    rebuilt from the stored header as a sparse file: zero weights, which llama.cpp loads and runs."""
    import json
    import tarfile

    golden = Path(__file__).resolve().parent / "golden"
    size = json.loads((golden / "archs.json").read_text())["models"][name]["size"]
    folder = _DIR / "archs"
    folder.mkdir(exist_ok=True)
    out = folder / f"{name}.gguf"
    with tarfile.open(golden / "llama-archs.tar.xz") as tar:
        member = tar.extractfile(f"{name}.gguf")
        assert member is not None, name
        out.write_bytes(member.read())
    os.truncate(out, size)
    return out
