"""Read GGUF headers (metadata and tensor table) without touching tensor data.

`gguf.GGUFReader` materialises every metadata array as numpy objects: ~30 s for a 200k-token vocabulary on our
2-core machines. llama.cpp's estimator needs none of those strings, so this reader walks the header through an
mmap, keeps scalars and short numeric arrays, and only skips over long arrays (recording their length). It reads
split models the way llama.cpp does (src/llama-model-loader.cpp, `llama_split_prefix`/`llama_split_path` in
src/llama.cpp): the shards are found from the file name, and each must carry the matching `split.no`.

Type sizes and names come from the gguf package (`GGML_QUANT_SIZES`, `GGMLQuantizationType`).
"""

from __future__ import annotations

import hashlib
import math
import mmap
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitter.errors import GGUFError
from fitter.gguf._constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
GGML_MAX_DIMS = 4  # ggml/include/ggml.h
# Numeric arrays longer than this (token scores, token types) are skipped; per-layer arrays are far shorter.
MAX_KEPT_ARRAY = 1 << 16
# Strings are read into memory only up to this length: a damaged length may be as large as the file. A longer value
# (an embedded tokenizer.json) is skipped; a longer key or array item is a damaged header.
MAX_KEPT_STRING = 1 << 20
GGML_MAX_NAME = 64  # ggml/include/ggml.h: gguf.cpp refuses a tensor name of this length or more

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class SkippedArray:
    """A metadata array not kept in memory (a vocabulary, merges, scores): only its element type and length."""

    item_type: str
    count: int


@dataclass(frozen=True)
class SkippedString:
    """A metadata string value longer than MAX_KEPT_STRING, not kept in memory: only its length in bytes."""

    length: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]  # ggml order: ne[0] is the contiguous row length
    shard: int  # index into GGUFHeader.shards
    offset: int  # absolute byte offset of the tensor's data in its shard
    n_bytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    size: int  # file size in bytes
    data_offset: int  # start of the aligned tensor data region


@dataclass(frozen=True)
class GGUFHeader:
    path: Path  # the file the user named (llama.cpp wants the first shard; any shard is accepted here)
    shards: tuple[ShardInfo, ...]
    metadata: Mapping[str, Any]  # from the first shard, as llama.cpp reads it
    tensors: tuple[TensorInfo, ...]
    identity: str  # sha256 over every shard's header bytes and size: no tensor data is read

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)


def tensor_nbytes(ggml_type: GGMLQuantizationType, ne: tuple[int, ...]) -> int:
    """ggml_nbytes for a contiguous tensor (ggml/src/ggml.c): rows of ne[0] elements in whole blocks."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_rows = 1
    for d in ne[1:]:
        n_rows *= d
    return ne[0] // block_size * type_size * n_rows


class _Cursor:
    """Bounds-checked little-endian reads over one mapped file; every failure names the file and offset."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf = buf
        self.path = path
        self.pos = 0
        self.size = len(buf)

    def fail(self, rule: str) -> GGUFError:
        return GGUFError(f"{self.path}: {rule} (at byte {self.pos} of {self.size})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated header: {what} needs {n} bytes, {self.size - self.pos} remain")

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str, limit: int = MAX_KEPT_STRING, rule: str = "longer than any header holds") -> str:
        n = self.unpack("<Q", what)
        self.need(n, f"{what} of length {n}")
        if n >= limit:
            raise self.fail(f"{what} of length {n}: {limit} bytes or more, {rule}")
        return self.text(n, what)

    def text(self, n: int, what: str) -> str:
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8: {e.reason}") from None



_U64 = struct.Struct("<Q")


def _skip_strings(cur: _Cursor, count: int, key: str) -> None:
    """Step over `count` length-prefixed strings: the hot loop of a 200k-token vocabulary, kept minimal."""
    unpack, buf, pos, end = _U64.unpack_from, cur.buf, cur.pos, cur.size - 8
    for _ in range(count):
        if pos > end:
            cur.pos = pos
            raise cur.fail(f"truncated header: an item of {key!r} runs past the end of the file")
        pos += 8 + unpack(buf, pos)[0]
    if pos > cur.size:
        cur.pos = pos
        raise cur.fail(f"truncated header: the last item of {key!r} runs past the end of the file")
    cur.pos = pos


def _value_type(cur: _Cursor, raw: int, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise cur.fail(f"metadata key {key!r} has unknown value type {raw}") from None


def _read_value(cur: _Cursor, vtype: GGUFValueType, key: str) -> Any:
    if vtype == GGUFValueType.STRING:
        n = cur.unpack("<Q", f"length of {key!r}")
        cur.need(n, f"value of {key!r} of length {n}")
        if n >= MAX_KEPT_STRING:  # an embedded tokenizer.json: fitter needs none of it
            cur.pos += n
            return SkippedString(n)
        return cur.text(n, f"value of {key!r}")
    if vtype == GGUFValueType.ARRAY:
        item_type = _value_type(cur, cur.unpack("<I", f"array type of {key!r}"), key)
        count = cur.unpack("<Q", f"array length of {key!r}")
        if item_type == GGUFValueType.ARRAY:
            raise cur.fail(f"metadata key {key!r} is a nested array, which llama.cpp does not accept")
        min_item = 8 if item_type == GGUFValueType.STRING else struct.calcsize(_SCALAR_FORMATS[item_type])
        # An absurd count is rejected before any loop runs: the file could not hold it.
        cur.need(count * min_item, f"array {key!r} of {count} {item_type.name} items")
        if item_type == GGUFValueType.STRING:
            if count > MAX_KEPT_ARRAY:
                _skip_strings(cur, count, key)
                return SkippedArray(item_type.name, count)
            return [cur.string(f"item of {key!r}") for _ in range(count)]
        fmt = _SCALAR_FORMATS[item_type]
        size = struct.calcsize(fmt)
        if count > MAX_KEPT_ARRAY:
            cur.pos += count * size
            return SkippedArray(item_type.name, count)
        values = list(struct.unpack_from(f"<{count}{fmt[1]}", cur.buf, cur.pos))
        cur.pos += count * size
        return values
    return cur.unpack(_SCALAR_FORMATS[vtype], f"value of {key!r}")


def _parse_one(path: Path, shard: int) -> tuple[ShardInfo, dict[str, Any], list[TensorInfo], bytes]:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            if size == 0:
                raise GGUFError(f"{path}: not a GGUF file (it is empty)")
            buf: mmap.mmap | bytes = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise GGUFError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise GGUFError(f"{path}: is a directory, not a GGUF file") from None
    except PermissionError:
        raise GGUFError(f"{path}: permission denied") from None
    except OSError as e:  # a name too long, a loop of links, an I/O error: what the system said
        raise GGUFError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        return _parse_buffer(_Cursor(buf, path), shard)
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()


def _parse_buffer(cur: _Cursor, shard: int) -> tuple[ShardInfo, dict[str, Any], list[TensorInfo], bytes]:
    path = cur.path
    if cur.size < 4 or bytes(cur.buf[:4]) != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {bytes(cur.buf[:4])!r}, expected {GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.unpack("<I", "version")
    if version not in (2, 3):
        raise cur.fail(f"unsupported GGUF version {version} (llama.cpp reads versions 2 and 3)")
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.unpack("<Q", "metadata count")
    # Smallest possible entries: a tensor info is >= 32 bytes, a key/value pair >= 13 bytes.
    cur.need(n_tensors * 32 + n_kv * 13, f"{n_tensors} tensor infos and {n_kv} metadata entries")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        if key in metadata:  # gguf.cpp refuses it: which value would count?
            raise cur.fail(f"metadata key {key!r} appears twice")
        vtype = _value_type(cur, cur.unpack("<I", f"value type of {key!r}"), key)
        metadata[key] = _read_value(cur, vtype, key)

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment must be a power of two, got {alignment!r}")

    raw_tensors: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int]] = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = cur.string("tensor name", GGML_MAX_NAME, "gguf.cpp's limit (GGML_MAX_NAME)")
        if name in names:  # gguf.cpp: "duplicate tensor name"
            raise cur.fail(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = cur.unpack("<I", f"dimension count of {name!r}")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions, ggml allows 1..{GGML_MAX_DIMS}")
        ne = tuple(cur.unpack("<q", f"shape of {name!r}") for _ in range(n_dims))
        if any(d < 0 for d in ne):
            raise cur.fail(f"tensor {name!r} has a negative dimension {ne}")
        raw_type = cur.unpack("<I", f"type of {name!r}")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise cur.fail(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        if ggml_type not in GGML_QUANT_SIZES:
            raise cur.fail(f"tensor {name!r} has ggml type {ggml_type.name}, which has no size (removed type)")
        block_size = GGML_QUANT_SIZES[ggml_type][0]
        if ne[0] % block_size:
            raise cur.fail(
                f"tensor {name!r}: row length {ne[0]} is not a multiple of {ggml_type.name}'s block {block_size}"
            )
        offset = cur.unpack("<Q", f"data offset of {name!r}")
        raw_tensors.append((name, ggml_type, ne, offset))

    header_end = cur.pos
    data_offset = (header_end + alignment - 1) // alignment * alignment
    tensors = []
    for name, ggml_type, ne, offset in raw_tensors:
        n_bytes = tensor_nbytes(ggml_type, ne)
        start = data_offset + offset
        if start + n_bytes > cur.size:
            raise GGUFError(
                f"{path}: tensor {name!r} data [{start}, {start + n_bytes}) lies beyond the end of the file "
                f"({cur.size} bytes): the file is truncated"
            )
        tensors.append(TensorInfo(name, ggml_type, ne, shard, start, n_bytes))
    header_bytes = bytes(cur.buf[:header_end])
    return ShardInfo(path, cur.size, data_offset), metadata, tensors, header_bytes


def split_paths(path: Path, count: int) -> list[Path]:
    """All shard paths of a split model, from any one of them (`llama_split_path` naming)."""
    m = _SPLIT_RE.match(path.name)
    prefix = m.group("prefix") if m else path.name.removesuffix(".gguf")
    return [path.with_name(f"{prefix}-{i + 1:05d}-of-{count:05d}.gguf") for i in range(count)]


def _split_key(meta: Mapping[str, Any], key: str, path: Path) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise GGUFError(f"{path}: split shard lacks integer key {key!r} (got {value!r})")
    return value


def read_header(path: str | Path) -> GGUFHeader:
    """Read a GGUF file's header, or every shard's header of a split model given any one shard."""
    path = Path(path)
    first_shard, metadata, tensors, header_bytes = _parse_one(path, 0)
    count = metadata.get("split.count", 0)
    name_match = _SPLIT_RE.match(path.name)
    if not count and name_match and int(name_match.group("count")) > 1:
        raise GGUFError(f"{path}: named as a split shard but has no 'split.count' key")
    if not isinstance(count, int) or count <= 1:
        identity = hashlib.sha256(header_bytes + struct.pack("<Q", first_shard.size)).hexdigest()
        return GGUFHeader(path, (first_shard,), metadata, tuple(tensors), identity)

    given_no = _split_key(metadata, "split.no", path)
    paths = split_paths(path, count)
    if paths[given_no] != path:
        raise GGUFError(
            f"{path}: split.no is {given_no} of split.count {count}, so its name should be {paths[given_no].name}"
        )
    hasher = hashlib.sha256()
    shards: list[ShardInfo] = []
    all_tensors: list[TensorInfo] = []
    first_meta: Mapping[str, Any] = {}
    for idx, shard_path in enumerate(paths):
        if idx == given_no:
            info, meta, shard_tensors, raw = first_shard, metadata, tensors, header_bytes
            shard_tensors = [_with_shard(t, idx) for t in shard_tensors]
        else:
            if not shard_path.exists():
                raise GGUFError(f"{path}: split shard {idx + 1} of {count} is missing: {shard_path}")
            info, meta, shard_tensors, raw = _parse_one(shard_path, idx)
        no = _split_key(meta, "split.no", shard_path)
        shard_count = meta.get("split.count")
        if no != idx or shard_count != count:
            raise GGUFError(
                f"{shard_path}: split.no={no}, split.count={shard_count}; expected split.no={idx}, "
                f"split.count={count} for shard {idx + 1} of {count}"
            )
        if idx == 0:
            first_meta = meta
        shards.append(info)
        all_tensors.extend(shard_tensors)
        hasher.update(raw + struct.pack("<Q", info.size))

    expected = _split_key(first_meta, "split.tensors.count", paths[0])
    if expected != len(all_tensors):
        raise GGUFError(
            f"{paths[0]}: split.tensors.count is {expected} but the {count} shards hold {len(all_tensors)} tensors"
        )
    names = [t.name for t in all_tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise GGUFError(f"{path}: tensor {dup!r} appears in more than one shard")
    return GGUFHeader(path, tuple(shards), first_meta, tuple(all_tensors), hasher.hexdigest())


def _with_shard(t: TensorInfo, shard: int) -> TensorInfo:
    return t if t.shard == shard else TensorInfo(t.name, t.ggml_type, t.ne, shard, t.offset, t.n_bytes)
