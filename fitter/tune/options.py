"""What `fitter tune` was asked, in groups: the model and the flags it runs with, what is searched, how each trial is
measured, and where the study is kept. fitter.cli.tune and fitter.cli.grid build it from argv; tests and benchmarks
build it directly. The checks here need nothing started."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitter.errors import FitterError
from fitter.flags import LaunchConfig, ProcessFlags
from fitter.gguf.model_spec import ModelSpec
from fitter.search.request import OBJECTIVES, STREAM_OBJECTIVES
from fitter.workload import Workload, context_choices, context_problem

DEFAULT_ROUNDS = 4  # t(0.975, 3) = 3.18: an interval ~1.8× the per-round spread; 3 rounds would make it 2.5×


@dataclass(frozen=True)
class SearchOptions:
    """What is searched, toward what, for how long."""

    objectives: tuple[str, ...] = ("tg", "pp", "vram")
    space: str | None = None  # a search-space file; None: the shipped one for the model and machine
    fit_targets: tuple[int, ...] | None = None  # MiB left free per device; None: the target's default (1024 MiB)
    trials: int = 12  # launched trials, the baseline included
    timeout_s: float | None = None  # stop launching after this long
    seed: int = 0
    quality_text: str | None = None  # the text quality is measured on (--quality-text, else --prompts, else shipped)
    quality_ctx: int = 512  # llama-perplexity's -c for the quality measurement (its chunks)
    # the model file whose f16 run is quality's reference (several files of one model: the highest-precision one)
    quality_reference: str | None = None
    quality_kv_types: tuple[str, ...] = ()  # the KV types the build's llama-perplexity takes (its --help), once read


@dataclass(frozen=True)
class MeasureOptions:
    """Where each trial runs and how it is measured."""

    backend: str = "llama-cpp-python"  # llama-cpp-python (fitter's worker) | sim | replay
    machine: str | None = None  # --backend sim: the simulated machine
    landscape: str | None = None  # --backend replay: the recorded landscape (fitter grid)
    emulated_gpu_mib: int | tuple[int, ...] | None = None  # several: one emulated GPU per value
    emulated_kind: str = "rpc"  # `--emulated-gpu [cuda:|vulkan:]MiB`: the RPC, CUDA-shaped or Vulkan one
    llama_cpp: str | None = None  # `--llama-cpp DIR`: trials through that build's llama-server, its fit the baseline
    llama_fit_params: str | None = None
    projection: str = "auto"  # the drift guard with --llama-cpp: auto (another build or backend), always, never
    repetitions: int = 3
    confirm_rounds: int = DEFAULT_ROUNDS  # interleaved confirm rounds (fitter.tune.confirm), each of -r repetitions
    trial_timeout_s: float | None = None  # None: from the predicted work


@dataclass(frozen=True)
class StorageOptions:
    """Where the study and the results are kept."""

    storage: str | None = None  # an Optuna storage URL; None: the results folder's study.db
    study_name: str | None = None  # the study's name in a shared storage (default: fitter-<model file stem>)
    results: Path = Path("results")


@dataclass(frozen=True)
class TuneOptions:
    """What `fitter tune` was asked, parsed."""

    model: str
    spec: ModelSpec
    base: LaunchConfig  # the user's llama.cpp flags, parsed once
    process: ProcessFlags = field(default_factory=ProcessFlags)  # -t/-tb fix the threads; -C/-Cr the affinity
    workload: Workload = field(default_factory=Workload)  # -p -n -d --concurrency, or --workload FILE
    demo: bool = False  # the model is the demo model (no GPU: it tunes on the emulated GPU by itself)
    search: SearchOptions = field(default_factory=SearchOptions)
    measure: MeasureOptions = field(default_factory=MeasureOptions)
    storage: StorageOptions = field(default_factory=StorageOptions)


def parse_objectives(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in OBJECTIVES]
    if not names or bad or len(set(names)) != len(names):
        raise FitterError(f"--objectives {text!r}: give a comma list of distinct objectives from "
                          f"{', '.join(OBJECTIVES)} (tg: decode t/s, pp: prefill t/s, vram: peak VRAM, ctx: the "
                          "context, with --min-ctx; tg-stream: one stream's decode t/s, ttft: time to first token, "
                          "with --concurrency; quality: the KL divergence from an f16 KV cache, measured with "
                          "llama-perplexity)")
    return names


def bench_settings(o: TuneOptions) -> dict[str, Any]:
    """What the study measures, as its settings record it: llama-bench's -p -n -d -r, and the workload when it
    is more than one test (a study measured under one workload is not resumed under another)."""
    w = o.workload
    out: dict[str, Any] = {"p": w.n_prompt, "n": w.n_gen, "d": max(w.depths), "r": o.measure.repetitions}
    if not w.is_default_shape or w.min_ctx or w.prompts is not None:
        out["workload"] = {k: v for k, v in w.to_json().items() if k not in ("source", "description")}
    return out


def check_workload(o: TuneOptions) -> None:
    """A workload the target can measure and the context can hold, before anything starts."""
    w, backend = o.workload, o.measure.backend
    if w.concurrency > 1 and backend != "sim" and o.measure.llama_cpp is None:
        raise FitterError(f"{w.source}: {w.concurrency} concurrent streams are served by llama-server: give your "
                          "build with --llama-cpp DIR (the pinned one: python -m fitter.measure.llamacpp.tools), or "
                          "tune a simulated machine (--backend sim)")
    if not w.is_default_shape and backend == "replay":
        raise FitterError(f"{w.source}: a replayed landscape holds one test per config: drop the depth list and "
                          "--concurrency")
    streamed = [x for x in o.search.objectives if x in STREAM_OBJECTIVES]
    if streamed and w.concurrency < 2:
        raise FitterError(f"--objectives {','.join(streamed)}: measured with several streams served at once: give "
                          "--concurrency N (N >= 2) or a workload with concurrency")
    if "quality" in o.search.objectives and backend in ("sim", "replay"):
        raise FitterError(f"--objectives quality: measured with llama.cpp's llama-perplexity on the model's output; "
                          f"--backend {backend} runs no model (a simulated machine or a replayed landscape cannot "
                          "measure quality): tune on this machine's llama.cpp")
    if "ctx" in o.search.objectives and not w.min_ctx:
        raise FitterError("--objectives ctx: the context is an objective where it is searched: give --min-ctx N")
    if w.min_ctx:
        if backend == "replay":
            raise FitterError(f"{w.source}: a replayed landscape holds the contexts it recorded: drop --min-ctx")
        context_choices(w.min_ctx, o.spec.n_ctx_train)  # more than the training context: refused here
    if (problem := context_problem(w, o.base, o.spec.n_ctx_train)) is not None:
        raise FitterError(problem)
