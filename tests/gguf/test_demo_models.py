"""Tests for fitter.gguf.demo_models: deterministic, valid, splittable and sparse synthetic GGUF models."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from fitter.errors import FitterError
from fitter.gguf.demo_models import DEMO_FILENAME, SHAPES, demo_model_path, shard_paths, write_model
from fitter.paths import fitter_home

SMALL = [name for name, s in SHAPES.items() if s.n_params < 10_000_000]
LOADABLE_SMALL = [name for name in SMALL if SHAPES[name].loads_in_llama_cpp]


def _sha(paths: list[Path]) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    assert field is not None, key
    return field.contents()


def _field_type(reader: gguf.GGUFReader, key: str) -> gguf.GGUFValueType:
    field = reader.get_field(key)
    assert field is not None, key
    return field.types[0]


# --- shapes ------------------------------------------------------------------------------------------


def test_demo_parameter_count_and_types() -> None:
    demo = SHAPES["demo"]
    assert 100_000_000 <= demo.n_params <= 200_000_000
    assert demo.arch == "gpt-oss" and demo.expert_type == "MXFP4" and demo.head_dim == 64
    expert = sum(t.n_elements for t in demo.tensors() if "_exps.weight" in t.name)
    assert expert / demo.n_params > 0.8  # mostly experts, like the real model


def test_real_shapes_match_public_files() -> None:
    # llama-bench on ggml-org's gpt-oss-120b MXFP4 GGUF: 116.83 B params, 59.02 GiB.
    big = SHAPES["gpt-oss-120b"]
    assert round(big.n_params / 1e9, 2) == 116.83
    assert round(big.n_bytes / 2**30, 2) == 59.02
    assert round(SHAPES["gpt-oss-20b"].n_params / 1e9, 1) == 20.9


def test_required_shapes_present() -> None:
    want = {"demo", "gpt-oss-tiny", "qwen3moe-tiny", "qwen2moe-tiny", "mixtral-tiny", "llama-tiny",
            "qwen3-tiny", "deepseek2-tiny", "gpt-oss-120b", "gpt-oss-20b", "qwen3-30b-a3b", "mixtral-8x7b"}
    assert want <= set(SHAPES)
    assert all(name == s.name for name, s in SHAPES.items())


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"n_embd": 100}, "block 32"),  # MXFP4 rows must hold whole blocks
        ({"arch": "mamba"}, "arch"),
        ({"n_expert_used": 5}, "n_expert_used"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"expert_type": "Q9_9"}, "expert_type"),
        ({"n_vocab": 100}, "n_vocab"),
    ],
)
def test_invalid_shapes_raise(change: dict[str, Any], words: str) -> None:
    with pytest.raises(FitterError, match=words) as info:
        dataclasses.replace(SHAPES["gpt-oss-tiny"], **change)
    assert "gpt-oss-tiny" in str(info.value)


def test_llama_requires_standard_head_dim() -> None:
    with pytest.raises(FitterError, match="head_dim"):
        dataclasses.replace(SHAPES["llama-tiny"], head_dim=64)


def test_unsupported_type_needs_sparse(tmp_path: Path) -> None:
    shape = dataclasses.replace(SHAPES["qwen3-tiny"], weight_type="Q6_K")
    with pytest.raises(FitterError, match="Q6_K"):
        write_model(shape, tmp_path / "q6k.gguf")
    (path,) = write_model(shape, tmp_path / "q6k.gguf", sparse=True)
    assert path.stat().st_size > shape.n_bytes


# --- writing -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt-oss-tiny", "deepseek2-tiny", "demo"])
def test_write_is_deterministic(tmp_path: Path, name: str) -> None:
    a = write_model(SHAPES[name], tmp_path / "a.gguf")
    b = write_model(SHAPES[name], tmp_path / "b.gguf")  # the file name is not part of the content
    assert _sha(a) == _sha(b)
    (c,) = write_model(SHAPES[name], tmp_path / f"{name}-seed1.gguf", seed=1)
    assert _sha([c]) != _sha(a)
    assert c.stat().st_size == a[0].stat().st_size


@pytest.mark.parametrize("name", SMALL)
def test_small_models_read_back(tmp_path: Path, name: str) -> None:
    shape = SHAPES[name]
    (path,) = write_model(shape, tmp_path / f"{name}.gguf")
    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.architecture") == shape.arch
    assert _field(reader, f"{shape.arch}.block_count") == shape.n_layer
    assert len(_field(reader, "tokenizer.ggml.tokens")) == shape.n_vocab
    specs = shape.tensors()
    assert [t.name for t in reader.tensors] == [s.name for s in specs]
    for t, s in zip(reader.tensors, specs, strict=True):
        assert t.tensor_type.name == s.type
        assert tuple(int(d) for d in t.shape) == s.ne
        assert t.n_bytes == s.nbytes
    # Weights are small and finite once dequantized.
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(values).all(), t.name
        assert float(np.abs(values).max()) <= 1.0, t.name
    assert path.stat().st_size == reader.data_offset + sum(-(-s.nbytes // 32) * 32 for s in specs)


def test_split_names_and_keys(tmp_path: Path) -> None:
    shape = SHAPES["gpt-oss-tiny"]
    paths = write_model(shape, tmp_path / "model.gguf", n_shards=3)
    assert [p.name for p in paths] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert paths == shard_paths(tmp_path / "model.gguf", 3)
    (single,) = write_model(shape, tmp_path / "single.gguf")
    whole = {t.name: t.data.tobytes() for t in gguf.GGUFReader(single).tensors}
    names: list[str] = []
    for i, path in enumerate(paths):
        reader = gguf.GGUFReader(path)
        assert _field(reader, "split.no") == i
        assert _field(reader, "split.count") == 3
        assert _field(reader, "split.tensors.count") == len(shape.tensors())
        assert _field_type(reader, "split.no") == gguf.GGUFValueType.UINT16
        assert _field_type(reader, "split.count") == gguf.GGUFValueType.UINT16
        assert _field_type(reader, "split.tensors.count") == gguf.GGUFValueType.INT32
        # Only the first shard carries the model's metadata, as gguf-split writes it.
        assert (reader.get_field("general.architecture") is not None) == (i == 0)
        assert (reader.get_field("tokenizer.ggml.tokens") is not None) == (i == 0)
        assert reader.tensors, "every shard holds at least one tensor"
        for t in reader.tensors:
            assert t.data.tobytes() == whole[t.name]  # same bytes as the unsplit file
        names += [t.name for t in reader.tensors]
    assert names == [t.name for t in shape.tensors()]  # in order, each once


def test_shard_paths() -> None:
    assert shard_paths(Path("d/m.gguf"), 1) == [Path("d/m.gguf")]
    assert shard_paths(Path("d/gpt-oss-120b.gguf"), 2) == [
        Path("d/gpt-oss-120b-00001-of-00002.gguf"),
        Path("d/gpt-oss-120b-00002-of-00002.gguf"),
    ]


def test_bad_shard_count(tmp_path: Path) -> None:
    with pytest.raises(FitterError, match="n_shards"):
        write_model(SHAPES["gpt-oss-tiny"], tmp_path / "m.gguf", n_shards=0)
    with pytest.raises(FitterError, match="n_shards"):
        write_model(SHAPES["gpt-oss-tiny"], tmp_path / "m.gguf", n_shards=10_000)


def test_sparse_matches_real_file(tmp_path: Path) -> None:
    shape = SHAPES["qwen2moe-tiny"]
    (full,) = write_model(shape, tmp_path / "full.gguf")
    (hole,) = write_model(shape, tmp_path / "hole.gguf", sparse=True)
    assert hole.stat().st_size == full.stat().st_size
    reader = gguf.GGUFReader(full)
    header = reader.data_offset
    assert hole.read_bytes()[:header] == full.read_bytes()[:header]
    assert not any(hole.read_bytes()[header:])


def test_sparse_real_model_uses_no_disk(tmp_path: Path) -> None:
    shape = SHAPES["gpt-oss-120b"]
    paths = write_model(shape, tmp_path / "gpt-oss-120b.gguf", sparse=True, n_shards=3)
    sizes = [os.stat(p).st_size for p in paths]
    assert sum(sizes) > shape.n_bytes > 59 * 2**30
    assert all(s > 10 * 2**30 for s in sizes)  # split by bytes, not by tensor count
    on_disk = sum(os.stat(p).st_blocks * 512 for p in paths)
    assert on_disk < 64 * 2**20  # headers only (the 201k-token vocabulary is ~6 MiB)


# --- cache -------------------------------------------------------------------------------------------


def test_fitter_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert fitter_home() == tmp_path / "home"  # conftest's autouse fixture
    monkeypatch.delenv("FITTER_HOME")
    assert fitter_home() == Path.home() / ".cache" / "fitter"


def test_demo_model_path_caches(tmp_path: Path) -> None:
    path = demo_model_path()
    assert path == tmp_path / "home" / "models" / DEMO_FILENAME
    assert path.is_file()
    assert [p.name for p in path.parent.iterdir()] == [DEMO_FILENAME]  # no temp file left behind
    stamp = path.stat().st_mtime_ns
    assert demo_model_path() == path
    assert path.stat().st_mtime_ns == stamp  # not rewritten
    other = demo_model_path(tmp_path / "elsewhere" / "demo.gguf")
    assert _sha([other]) == _sha([path])


# --- the real llama.cpp ------------------------------------------------------------------------------


@pytest.mark.llama
@pytest.mark.parametrize("name", LOADABLE_SMALL)
def test_llama_cpp_loads_and_evaluates(tmp_path: Path, name: str) -> None:
    import llama_cpp
    (path,) = write_model(SHAPES[name], tmp_path / f"{name}.gguf")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=1, verbose=False, logits_all=True)
    try:
        tokens = llm.tokenize(b"hello there, the cat sat on the mat", add_bos=True)
        llm.eval(tokens)
        logits = np.asarray(llm.scores[: len(tokens)])
        assert logits.shape == (len(tokens), SHAPES[name].n_vocab)
        assert np.isfinite(logits).all()
        assert float(logits.std()) > 0  # the weights do something
    finally:
        llm.close()


def _load_params(llama_cpp: Any, *, no_alloc: bool = False) -> Any:
    params = llama_cpp.llama_model_default_params()
    # 0.3.36 has no use_mmap field: load_mode AUTO means mmap. Repacking (extra bufts) would read and
    # copy every repackable tensor, so it stays off.
    params.use_extra_bufts = False
    params.n_gpu_layers = 0
    if no_alloc:  # llama.cpp's --fit dry run: weights neither mapped nor allocated (asserts without NONE)
        params.no_alloc = True
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
    return params


@pytest.mark.llama
def test_llama_cpp_maps_sparse_split_model(tmp_path: Path) -> None:
    import llama_cpp
    shape = SHAPES["gpt-oss-tiny"]
    paths = write_model(shape, tmp_path / "tiny.gguf", sparse=True, n_shards=3)
    model = llama_cpp.llama_model_load_from_file(str(paths[0]).encode(), _load_params(llama_cpp))
    assert model, "llama.cpp refused the sparse split model"
    try:
        assert llama_cpp.llama_model_n_params(model) == shape.n_params
        assert llama_cpp.llama_model_size(model) == shape.n_bytes
    finally:
        llama_cpp.llama_model_free(model)


@pytest.mark.llama
@pytest.mark.parametrize("name", [n for n, s in SHAPES.items() if s.n_params > 1_000_000_000])
def test_llama_cpp_accepts_real_shape_headers(tmp_path: Path, name: str) -> None:
    # no_alloc keeps this cheap: with mmap, llama.cpp MAP_POPULATEs the whole (hole) file, i.e. fills
    # the page cache with the model's size in zero pages (see the module notes).
    import llama_cpp
    shape = SHAPES[name]
    paths = write_model(shape, tmp_path / f"{name}.gguf", sparse=True, n_shards=2)
    params = _load_params(llama_cpp, no_alloc=True)
    model = llama_cpp.llama_model_load_from_file(str(paths[0]).encode(), params)
    assert model, f"llama.cpp refused the {name} header"
    try:
        assert llama_cpp.llama_model_n_params(model) == shape.n_params
        assert llama_cpp.llama_model_size(model) == shape.n_bytes
        assert llama_cpp.llama_model_n_layer(model) == shape.n_layer
    finally:
        llama_cpp.llama_model_free(model)
    assert sum(os.stat(p).st_blocks * 512 for p in paths) < 64 * 2**20
