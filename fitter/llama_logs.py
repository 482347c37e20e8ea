"""Parse the buffer sizes llama.cpp logs while it loads a model and builds a context.

The four INFO lines, as llama.cpp 0c1e570 formats them (sizes are `%8.2f` MiB, names `%12s`/`%10s` padded, so
long names such as `RPC0[127.0.0.1:50052]` overflow the padding and short ones are right-aligned):

- src/llama-model.cpp `load_tensors`:
  `"%s: %12s model buffer size = %8.2f MiB\\n"` with the *buffer* name (`CPU`, `CPU_Mapped`, `CPU_REPACK`,
  `CUDA0`, `CUDA_Host`, `RPC0[host:port]`); one line per buffer, e.g. one `CPU_Mapped` per mapped shard.
- src/llama-kv-cache.cpp `llama_kv_cache` (the constructor): `"%s: %10s KV buffer size = %8.2f MiB\\n"`, one line
  per device buffer and per cache: an iSWA model (gpt-oss) builds two caches, so it logs two groups.
- src/llama-context.cpp `sched_reserve`: `"%s: %10s compute buffer size = %8.2f MiB\\n"` with the *buffer type*
  name, printed only for sizes above 1 byte.
- src/llama-context.cpp `llama_context`: `"%s: %10s  output buffer size = %8.2f MiB\\n"` (two spaces).

A prefix before the function name (llama-server's timestamps, progress dots) is tolerated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# log function name -> (word before "buffer size", fitter's kind)
_SOURCES = {
    "load_tensors": ("model", "model"),
    "llama_kv_cache": ("KV", "kv"),
    "sched_reserve": ("compute", "compute"),
    "llama_context": ("output", "output"),
}
KINDS = ("model", "kv", "compute", "output")

_LINE_RE = re.compile(
    r"(?<!\w)(?P<func>load_tensors|llama_kv_cache|sched_reserve|llama_context):\s+"
    r"(?P<name>\S+)\s+(?P<word>model|KV|compute|output) buffer size =\s*(?P<mib>-?\d+(?:\.\d+)?) MiB",
    re.MULTILINE,
)


@dataclass(frozen=True)
class LoggedBuffer:
    """One buffer llama.cpp reported: its (buffer or buffer type) name, what it holds, and its size in MiB."""

    buft: str
    kind: str  # model | kv | compute | output
    mib: float


def parse_buffer_lines(text: str) -> list[LoggedBuffer]:
    """Every model/KV/compute/output buffer line in a llama.cpp log, in log order (duplicates kept)."""
    out: list[LoggedBuffer] = []
    for m in _LINE_RE.finditer(text):
        word, kind = _SOURCES[m.group("func")]
        if m.group("word") != word:  # e.g. "llama_context: ... compute buffer" is not a line llama.cpp writes
            continue
        out.append(LoggedBuffer(m.group("name"), kind, float(m.group("mib"))))
    return out


def sum_by(buffers: Iterable[LoggedBuffer]) -> dict[tuple[str, str], float]:
    """Total MiB per (buffer type, kind), e.g. all `CPU_Mapped` model shards together; rounded to 0.01 MiB."""
    totals: dict[tuple[str, str], float] = {}
    for b in buffers:
        key = (b.buft, b.kind)
        totals[key] = totals.get(key, 0.0) + b.mib
    return {k: round(v, 2) for k, v in totals.items()}
