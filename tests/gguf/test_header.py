from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
from gguf.constants import GGMLQuantizationType

from fitter.errors import GGUFError
from fitter.gguf.header import SkippedString, read_header, tensor_nbytes
from tests.models import model_file, model_files


def _gguf(n_tensors: int, kvs: bytes = b"", n_kv: int = 0, tensors: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + tensors


def _str(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def test_reads_metadata_and_tensor_table_of_a_generated_model() -> None:
    h = read_header(model_file("gpt-oss-tiny"))
    assert h.metadata["general.architecture"] == "gpt-oss"
    assert h.metadata["gpt-oss.block_count"] == 2
    experts = next(t for t in h.tensors if t.name == "blk.0.ffn_up_exps.weight")
    assert experts.type_name == "MXFP4"
    assert experts.ne == (128, 128, 4)  # {n_embd, n_ff_exp, n_expert}
    assert experts.n_bytes == 128 // 32 * 17 * 128 * 4
    assert h.tensor_bytes == sum(t.n_bytes for t in h.tensors)
    assert len(h.shards) == 1 and h.shards[0].size == model_file("gpt-oss-tiny").stat().st_size


def test_tensor_nbytes_uses_gguf_block_sizes() -> None:
    assert tensor_nbytes(GGMLQuantizationType.Q8_0, (64, 3)) == 2 * 34 * 3
    assert tensor_nbytes(GGMLQuantizationType.F32, (5,)) == 20


def test_split_model_is_found_from_any_shard() -> None:
    paths = model_files("gpt-oss-tiny", n_shards=3)
    assert [p.name for p in paths] == [f"gpt-oss-tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    whole = read_header(model_file("gpt-oss-tiny"))
    for p in paths:
        h = read_header(p)
        assert [s.path for s in h.shards] == list(paths)
        assert sorted(t.name for t in h.tensors) == sorted(t.name for t in whole.tensors)
        assert h.identity == read_header(paths[0]).identity
    assert whole.identity != read_header(paths[0]).identity


def test_missing_shard_is_named(tmp_path: Path) -> None:
    for p in model_files("gpt-oss-tiny", n_shards=3):
        shutil.copy(p, tmp_path / p.name)
    (tmp_path / "gpt-oss-tiny-00002-of-00003.gguf").unlink()
    with pytest.raises(GGUFError, match=r"split shard 2 of 3 is missing: .*gpt-oss-tiny-00002-of-00003\.gguf"):
        read_header(tmp_path / "gpt-oss-tiny-00001-of-00003.gguf")


def test_mismatched_shard_is_named(tmp_path: Path) -> None:
    paths = model_files("gpt-oss-tiny", n_shards=3)
    for p in paths:
        shutil.copy(p, tmp_path / p.name)
    shutil.copy(paths[2], tmp_path / paths[1].name)  # shard 3's content under shard 2's name
    with pytest.raises(GGUFError, match=r"00002-of-00003\.gguf.*split\.no=2.*expected split\.no=1"):
        read_header(tmp_path / paths[0].name)


def test_identity_is_stable_and_reads_no_data(tmp_path: Path) -> None:
    src = model_file("gpt-oss-tiny")
    copy = tmp_path / "copy.gguf"
    data = bytearray(src.read_bytes())
    data[-1] ^= 0xFF  # change tensor data only
    copy.write_bytes(bytes(data))
    assert read_header(copy).identity == read_header(src).identity


def test_sparse_real_shape_header_reads_fast_fields() -> None:
    h = read_header(model_files("gpt-oss-20b", sparse=True)[0])
    assert h.metadata["tokenizer.ggml.tokens"].count == 201088
    assert h.metadata["gpt-oss.expert_count"] == 32


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"PK\x03\x04 not a gguf at all", r"not a GGUF file \(magic b'PK\\x03\\x04'"),
        (b"GGUF\x03\x00", r"truncated header: version needs 4 bytes"),
        (_gguf(1 << 60), r"truncated header: 1152921504606846976 tensor infos and 0 metadata"),
        (_gguf(0, struct.pack("<Q", 1 << 40) + bytes(16), n_kv=1), r"metadata key of length 1099511627776"),
        (
            _gguf(0, _str(b"general.name") + struct.pack("<I", 8) + struct.pack("<Q", 1 << 40), n_kv=1),
            r"value of 'general.name' of length 1099511627776 needs 1099511627776 bytes",
        ),
        (
            _gguf(1, tensors=_str(b"w") + struct.pack("<I", 1) + struct.pack("<q", 32) + struct.pack("<I", 999)
                  + struct.pack("<Q", 0)),
            r"tensor 'w' has unknown ggml type 999",
        ),
        (
            _gguf(1, tensors=_str(b"w") + struct.pack("<I", 1) + struct.pack("<q", 32) + struct.pack("<I", 0)
                  + struct.pack("<Q", 0)),
            r"tensor 'w' data \[\d+, \d+\) lies beyond the end of the file",
        ),
        (_gguf(0, _str(b"k") + struct.pack("<I", 77), n_kv=1), r"metadata key 'k' has unknown value type 77"),
    ],
    ids=["not-gguf", "truncated", "2^60-tensors", "1TB-key", "1TB-string", "unknown-type", "truncated-data",
         "bad-value-type"],
)
def test_bad_input_is_one_clear_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match=message) as info:
        read_header(path)
    assert str(info.value).startswith(str(path))


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="no such file"):
        read_header(tmp_path / "nope.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="empty"):
        read_header(tmp_path / "empty.gguf")


def _tensor(name: bytes) -> bytes:
    """A tensor info: one F32 dimension of 32, data at offset 0."""
    return _str(name) + struct.pack("<IqIQ", 1, 32, 0, 0)


# Found by tests/gguf/test_header_properties.py: each was a traceback (MemoryError), a string read into memory as long
# as the file, or a header gguf.cpp refuses read as if it were fine.
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (_gguf(1, tensors=_tensor(b"w" * 64)),
         "tensor name of length 64: 64 bytes or more, gguf.cpp's limit (GGML_MAX_NAME) (at byte 32 of 120)"),
        (_gguf(0, struct.pack("<Q", 1 << 20) + bytes(1 << 20), n_kv=1),
         "metadata key of length 1048576: 1048576 bytes or more, longer than any header holds (at byte 32 of 1048608)"),
        (_gguf(2, tensors=_tensor(b"w") + _tensor(b"w")), "tensor 'w' appears twice (at byte 66 of 90)"),
        (_gguf(0, 2 * (_str(b"k") + struct.pack("<II", 4, 7)), n_kv=2),
         "metadata key 'k' appears twice (at byte 50 of 58)"),
    ],
    ids=["64-byte-tensor-name", "1MiB-key", "duplicate-tensor", "duplicate-key"],
)
def test_what_gguf_cpp_refuses_is_one_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError) as info:
        read_header(path)
    assert str(info.value) == f"{path}: {message}"


def test_a_long_string_value_is_skipped_not_read(tmp_path: Path) -> None:
    path = tmp_path / "long.gguf"
    path.write_bytes(_gguf(0, _str(b"tokenizer.huggingface.json") + struct.pack("<I", 8) + _str(b"x" * (1 << 20)),
                           n_kv=1))
    assert read_header(path).metadata == {"tokenizer.huggingface.json": SkippedString(1 << 20)}


def test_a_name_the_system_refuses_is_a_gguf_error(tmp_path: Path) -> None:
    path = tmp_path / ("x" * 300 + ".gguf")  # was an OSError traceback (ENAMETOOLONG)
    with pytest.raises(GGUFError) as info:
        read_header(path)
    assert str(info.value) == f"{path}: cannot read: File name too long"
