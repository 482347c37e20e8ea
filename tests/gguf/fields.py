"""Every field of a valid GGUF header with its offset, walked independently of fitter's reader, so the property
tests can aim a mutation at one kind of field (a count, a string length, a type, a tensor name)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

# GGUF value types (gguf/constants.py GGUFValueType) → struct format; 8 is STRING, 9 ARRAY
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True)
class Field:
    offset: int
    size: int
    fmt: str  # its struct format; "" for the bytes of a string
    kind: str  # tensor_count, kv_count, key_length, value_type, array_type, array_length, value, item,
    #            tensor_name_length, tensor_name, n_dims, dim, ggml_type, data_offset, and bytes of strings
    owner: str  # the metadata key or tensor name it belongs to ("" for the file's own fields)


class _Walk:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0
        self.fields: list[Field] = []

    def take(self, fmt: str, kind: str, owner: str = "") -> int:
        size = struct.calcsize(fmt)
        self.fields.append(Field(self.pos, size, fmt, kind, owner))
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value  # type: ignore[no-any-return]

    def string(self, kind: str, owner: str = "") -> str:
        n = self.take("<Q", f"{kind}_length", owner)
        text = self.buf[self.pos : self.pos + n].decode()
        self.fields.append(Field(self.pos, n, "", kind, owner or text))
        self.pos += n
        return text

    def value(self, vtype: int, key: str, kind: str) -> None:
        if vtype == 8:
            self.string(kind, key)
        elif vtype == 9:
            item_type = self.take("<I", "array_type", key)
            for _ in range(self.take("<Q", "array_length", key)):
                self.value(item_type, key, "item")
        else:
            self.take(_SCALARS[vtype], kind, key)


def header_fields(buf: bytes) -> list[Field]:
    """The fields of a GGUF v3 header in file order, ending with a zero-size "end" field where the header ends."""
    w = _Walk(buf)
    w.take("<I", "magic")
    w.take("<I", "version")
    n_tensors = w.take("<Q", "tensor_count")
    n_kv = w.take("<Q", "kv_count")
    for _ in range(n_kv):
        key = w.string("key")
        w.value(w.take("<I", "value_type", key), key, "value")
    for _ in range(n_tensors):
        name = w.string("tensor_name")
        for _ in range(w.take("<I", "n_dims", name)):
            w.take("<q", "dim", name)
        w.take("<I", "ggml_type", name)
        w.take("<Q", "data_offset", name)
    w.fields.append(Field(w.pos, 0, "", "end", ""))
    return w.fields
