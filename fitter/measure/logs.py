"""Parse the buffer sizes llama.cpp logs while it loads a model and builds a context.

The five INFO lines, as llama.cpp 0c1e570 formats them (sizes are `%8.2f` MiB, names `%12s`/`%10s` padded, so
long names such as `RPC0[127.0.0.1:50052]` overflow the padding and short ones are right-aligned):

- src/llama-model.cpp `load_tensors`:
  `"%s: %12s model buffer size = %8.2f MiB\\n"` with the *buffer* name (`CPU`, `CPU_Mapped`, `CPU_REPACK`,
  `CUDA0`, `CUDA_Host`, `RPC0[host:port]`); one line per buffer, e.g. one `CPU_Mapped` per mapped shard.
- src/llama-kv-cache.cpp `llama_kv_cache` (the constructor): `"%s: %10s KV buffer size = %8.2f MiB\\n"`, one line
  per device buffer and per cache: an iSWA model (gpt-oss) builds two caches, so it logs two groups.
- src/llama-memory-recurrent.cpp `llama_memory_recurrent`: `"%s: %10s RS buffer size = %8.2f MiB\n"`, the
  recurrent state of Mamba-style and hybrid models (qwen3next), counted with the KV cache.
- src/llama-context.cpp `sched_reserve`: `"%s: %10s compute buffer size = %8.2f MiB\\n"` with the *buffer type*
  name, printed only for sizes above 1 byte.
- src/llama-context.cpp `llama_context`: `"%s: %10s  output buffer size = %8.2f MiB\\n"` (two spaces).

A prefix before the function name (llama-server's timestamps, progress dots) is tolerated.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable

from fitter.measure.types import LoggedBuffer, OomInfo
from fitter.units import MIB

# log function name -> (word before "buffer size", fitter's kind)
_SOURCES = {
    "load_tensors": ("model", "model"),
    "llama_kv_cache": ("KV", "kv"),
    "llama_memory_recurrent": ("RS", "kv"),  # recurrent state: "context" in llama.cpp's memory breakdown too
    "sched_reserve": ("compute", "compute"),
    "llama_context": ("output", "output"),
}
KINDS = ("model", "kv", "compute", "output")

_LINE_RE = re.compile(
    r"(?<!\w)(?P<func>load_tensors|llama_kv_cache|llama_memory_recurrent|sched_reserve|llama_context):\s+"
    r"(?P<name>\S+)\s+(?P<word>model|KV|RS|compute|output) buffer size =\s*(?P<mib>-?\d+(?:\.\d+)?) MiB",
    re.MULTILINE,
)


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


TAIL = 3000  # characters of log kept in a crash/timeout reason
OOM_MARKERS = ("failed to allocate", "unable to allocate", "out of memory")
_ABORT_RE = re.compile(r"^\S+\.(?:c|cc|cpp|h):\d+: .+$", re.MULTILINE)
_ALLOC_RE = re.compile(r"failed to allocate (\S+) buffer of size (\d+)")  # ggml-alloc.c (model, KV, compute)
_CUDA_RE = re.compile(r"allocating ([\d.]+) MiB on device (\d+): cudaMalloc failed: (.*)")
_CPU_RE = re.compile(r"ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size (\d+)")
_OUTPUT_RE = re.compile(r"failed to allocate output buffer of size ([\d.]+) MiB")
_MODEL_RE = re.compile(r"unable to allocate (\S+) buffer")
_STAGES = (
    ("kv", "failed to allocate buffer for kv cache"),
    ("compute", "failed to allocate compute"),
    ("model", "unable to allocate "),
    ("output", "failed to allocate output buffer"),
    ("compute", "failed to allocate compute buffers"),
)


def parse_oom(log: str) -> OomInfo | None:
    """The refused allocation in a llama.cpp log, or None when the log shows no out-of-memory failure."""
    stage = next((name for name, text in _STAGES if text in log), None)
    buft: str | None = None
    size: int | None = None
    if m := _ALLOC_RE.search(log):
        buft, size = m.group(1), int(m.group(2))
    elif m := _CUDA_RE.search(log):
        buft, size = f"CUDA{m.group(2)}", round(float(m.group(1)) * MIB)
    elif m := _CPU_RE.search(log):
        buft, size = "CPU", int(m.group(1))
    elif m := _OUTPUT_RE.search(log):
        buft, size = "CPU", round(float(m.group(1)) * MIB)
    if "out of memory" in log.lower() and stage is None:
        stage = "unknown"
    if stage is None and buft is None:
        return None
    if buft is None and (m := _MODEL_RE.search(log)):
        buft = m.group(1)
    return OomInfo(stage or "unknown", buft, size)


def describe_oom(oom: OomInfo) -> str:
    what = f"{oom.requested_bytes} bytes ({oom.requested_bytes / MIB:.2f} MiB)" if oom.requested_bytes else "memory"
    return f"out of memory allocating the {oom.stage} buffer: {oom.buft or 'unknown device'} refused {what}"


def tail(text: str, n: int = TAIL) -> str:
    """The last `n` characters of a log, as a failed trial's reason quotes it."""
    return text.strip()[-n:]


def classify_exit(returncode: int | None, log: str) -> tuple[str, str]:
    """How a llama.cpp program that exited ended: oom when it said it could not allocate (that line is the reason),
    else crash with the signal or the exit status."""
    for line in log.splitlines():
        if any(m in line.lower() for m in OOM_MARKERS):
            return "oom", line.strip()
    if returncode is not None and returncode < 0:
        return "crash", f"killed by signal {signal.Signals(-returncode).name}"
    return "crash", f"exit status {returncode}"


def abort_lines(stderr: str) -> list[str]:
    """GGML_ABORT's "file.cpp:123: message" lines in a crashed child's stderr."""
    return [m.group(0) for m in _ABORT_RE.finditer(stderr)]


