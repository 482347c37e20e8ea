"""What a measurement is: the bench spec it ran with, its speeds, the buffers llama.cpp logged, how it ended.

Shared by every runner (fitter's worker, a user's llama-server or llama-bench, a simulated machine) and by what reads
their results (tune, check, bench's output). Outcomes: `ok`, `oom` (an allocation refused: which buffer, which
device, how many bytes), `crash` (the process died: signal or exit status and the log tail) or `timeout`. A failed
outcome carries no speeds, never zeros.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from fitter.errors import FitterError
from fitter.units import MIB

OUTCOMES = ("ok", "oom", "crash", "timeout")


@dataclass(frozen=True)
class LoggedBuffer:
    """One buffer llama.cpp reported: its (buffer or buffer type) name, what it holds, and its size in MiB."""

    buft: str
    kind: str  # model | kv | compute | output
    mib: float


class WorkerError(FitterError):
    """A trial llama.cpp rejected for a reason other than memory (an unknown buffer type, a test that does not fit
    the context), or a worker that could not be started."""

    quotes_output = True  # the worker's log tail, line by line


@dataclass(frozen=True)
class BenchSpec:
    """llama-bench's -p -n -d -r -t (and llama-server's -tb) for one trial."""

    n_prompt: int = 512
    n_gen: int = 128
    n_depth: int = 0
    repetitions: int = 3
    threads: int = 1
    threads_batch: int | None = None  # None: = threads (llama-bench has one count)
    warmup: bool = True
    seed: int = 0  # random tokens (llama-bench uses std::rand() unseeded, i.e. seed 1)
    streams: int = 1  # concurrent requests, one slot each (llama-server and simulated machines only)
    prompts: tuple[str, ...] = field(default=(), repr=False)  # decode on the user's text (llama-server only)

    def __post_init__(self) -> None:
        if min(self.n_prompt, self.n_gen, self.n_depth) < 0 or min(self.repetitions, self.threads, self.streams) < 1:
            raise WorkerError(f"bench spec {self}: counts must be >= 0, repetitions, threads and streams >= 1")


@dataclass(frozen=True)
class SpeedStats:
    """One test's repetitions, as llama-bench reports them."""

    n: int  # tokens per repetition
    depth: int
    samples_ns: tuple[int, ...]
    samples_ts: tuple[float, ...]
    avg_ts: float
    stddev_ts: float

    @staticmethod
    def from_ns(n: int, depth: int, samples_ns: list[int]) -> SpeedStats:
        ts = tuple(n * 1e9 / max(ns, 1) for ns in samples_ns)
        std = statistics.stdev(ts) if len(ts) > 1 else 0.0
        return SpeedStats(n, depth, tuple(samples_ns), ts, statistics.fmean(ts), std)

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "depth": self.depth, "avg_ts": self.avg_ts, "stddev_ts": self.stddev_ts,
                "samples_ts": list(self.samples_ts)}

    def __str__(self) -> str:
        return f"{self.avg_ts:.2f} ± {self.stddev_ts:.2f} t/s"


@dataclass(frozen=True)
class Latency:
    """Time to first token of each repetition (ms): the mean over the streams served at once."""

    samples_ms: tuple[float, ...]
    avg_ms: float
    stddev_ms: float

    @staticmethod
    def from_ms(samples_ms: list[float]) -> Latency:
        std = statistics.stdev(samples_ms) if len(samples_ms) > 1 else 0.0
        return Latency(tuple(samples_ms), statistics.fmean(samples_ms), std)

    def to_json(self) -> dict[str, Any]:
        return {"avg_ms": self.avg_ms, "stddev_ms": self.stddev_ms, "samples_ms": list(self.samples_ms)}


@dataclass(frozen=True)
class AtDepth:
    """One depth of a workload's trial: its speeds there (fitter.measure.served combines them)."""

    depth: int
    pp: SpeedStats | None
    tg: SpeedStats | None
    tg_stream: SpeedStats | None = None
    ttft: Latency | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"depth": self.depth}
        for key in ("pp", "tg", "tg_stream", "ttft"):
            if (value := getattr(self, key)) is not None:
                out[key] = value.to_json()
        return out


def samples_json(stats: dict[str, Any], samples: list[float]) -> dict[str, Any]:
    """A test of a bench JSON (`stats`, as SpeedStats.to_json writes it) over other `samples` (t/s): their mean and
    n−1 standard deviation, as SpeedStats computes them. For runs or trials whose samples are pooled."""
    return {**stats, "avg_ts": statistics.fmean(samples),
            "stddev_ts": statistics.stdev(samples) if len(samples) > 1 else 0.0, "samples_ts": samples}


@dataclass(frozen=True)
class OomInfo:
    """The allocation llama.cpp could not make."""

    stage: str  # model | kv | compute | output | unknown
    buft: str | None  # buffer (type) name: "RPC0[127.0.0.1:50052]", "CUDA0", "CPU"
    requested_bytes: int | None


@dataclass(frozen=True)
class Measurement:
    outcome: str  # ok | oom | crash | timeout
    reason: str
    spec: BenchSpec
    flags: tuple[str, ...]
    pp: SpeedStats | None = None  # None unless ok (or the test was not asked for)
    tg: SpeedStats | None = None  # with several streams: their aggregate decode
    tg_stream: SpeedStats | None = None  # several streams: the mean stream's own decode
    ttft: Latency | None = None  # several streams: time to first token of a prefill request
    depths: tuple[AtDepth, ...] = ()  # a workload of several depths: each one's speeds (pp/tg combine them)
    workload: dict[str, Any] | None = None  # the workload measured, when it is not a single llama-bench test
    drafted: tuple[int, int] | None = None  # speculative decoding: (tokens drafted, tokens accepted) over the decodes
    oom: OomInfo | None = None
    buffers: tuple[LoggedBuffer, ...] = ()
    load_s: float | None = None  # model load of this trial; 0.0 when the loaded model was reused
    context_s: float | None = None
    wall_s: float = 0.0  # the whole trial as the parent saw it
    reused_model: bool = False
    peak_rss: int | None = None  # bytes: the worker's VmHWM during this trial
    returncode: int | None = None  # crash: the child's status (negative: the signal)
    llama_cpp: dict[str, str] = field(default_factory=dict)
    log: str = field(default="", repr=False)  # llama.cpp's log of this trial

    def to_json(self) -> dict[str, Any]:
        """The `fitter bench --json` fields a worker knows (CONTRACTS.md); device totals and estimates come later."""
        out: dict[str, Any] = {"outcome": self.outcome, "reason": self.reason, "flags": list(self.flags),
                               "backend": "llama-cpp-python"}
        if self.pp is not None:
            out["pp"] = self.pp.to_json()
        if self.tg is not None:
            out["tg"] = self.tg.to_json()
        for key in ("tg_stream", "ttft"):
            if (value := getattr(self, key)) is not None:
                out[key] = value.to_json()
        if self.depths:
            out["depths"] = [d.to_json() for d in self.depths]
        if self.workload is not None:
            out["workload"] = dict(self.workload)
        if self.drafted is not None:
            n, accepted = self.drafted
            out["draft"] = {"drafted": n, "accepted": accepted, "acceptance": round(accepted / n, 4) if n else None}
        out.update({
            "load_s": self.load_s, "wall_s": self.wall_s, "reused_model": self.reused_model,
            "buffers": [{"buft": b.buft, "kind": b.kind, "bytes": round(b.mib * MIB)} for b in self.buffers],
            "peak_rss": self.peak_rss, "llama_cpp": dict(self.llama_cpp),
        })
        if self.oom is not None:
            out["oom"] = {"stage": self.oom.stage, "buft": self.oom.buft, "bytes": self.oom.requested_bytes}
        return out


@dataclass(frozen=True)
class TrialResult:
    measurement: Measurement
    peak_vram: dict[str, dict[str, Any]] = field(default_factory=dict)  # device → {"bytes", "source"}


