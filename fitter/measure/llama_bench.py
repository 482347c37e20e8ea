"""Measure with a user's llama-bench (`-o json`), in the same result shape as fitter's worker.

llama-bench sizes its context at p+n+d for one sequence (tools/llama-bench/llama-bench.cpp), not at the deployed
`-c`/`-np`, so a passing run does not prove the deployed configuration fits; the result says so in its reason.
`-ot` rules go in one config separated by `;` (`,` separates configs in llama-bench).
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from fitter import process
from fitter.flags import LaunchConfig, override_flags
from fitter.measure.logs import classify_exit, parse_buffer_lines, tail
from fitter.measure.types import BenchSpec, Measurement, SpeedStats

CONTEXT_NOTE = "llama-bench sized the context at p+n+d for one sequence, not the deployed -c/-np"


def llama_bench_argv(binary: str, model: str, config: LaunchConfig, spec: BenchSpec,
                     cpu_mask: str | None = None) -> list[str]:
    """The llama-bench command line for one configuration (pure)."""
    ngl = config.n_gpu_layers if config.n_gpu_layers >= 0 else 999  # llama-bench: a number; 999 = every layer
    argv = [binary, "-m", model, "-p", str(spec.n_prompt), "-n", str(spec.n_gen), "-d", str(spec.n_depth),
            "-r", str(spec.repetitions), "-t", str(spec.threads), "-b", str(config.batch_size),
            "-ub", str(config.ubatch_size), "-ctk", config.cache_type_k, "-ctv", config.cache_type_v,
            "-fa", config.flash_attn, "-ngl", str(ngl)]
    argv += override_flags(config.overrides, separator=";")
    if config.no_kv_offload:
        argv += ["-nkvo", "1"]
    if config.no_repack:
        argv += ["--repack", "0"]
    if config.load_mode != "auto":
        argv += ["-lm", config.load_mode]
    if config.rpc:
        argv += ["-rpc", ",".join(config.rpc)]
    if cpu_mask:
        argv += ["-C", cpu_mask]
    return [*argv, "-o", "json", "-v"]  # -v: llama.cpp's log (with the buffer lines) on stderr


def llama_bench_build(text: str) -> dict[str, str]:
    """The build llama-bench reports in each JSON row (`build_commit`, `build_number`)."""
    rows: list[dict[str, Any]] = json.loads(text)
    if not rows:
        return {}
    return {"commit": str(rows[0].get("build_commit", "unknown")),
            "source": f"llama-bench -o json build_commit (build {rows[0].get('build_number', '?')})"}


def parse_llama_bench_json(text: str) -> tuple[SpeedStats | None, SpeedStats | None]:
    """The prompt and generation rows of llama-bench's JSON output."""
    pp = tg = None
    rows: list[dict[str, Any]] = json.loads(text)
    for row in rows:
        stats = SpeedStats.from_ns(int(row["n_prompt"] or row["n_gen"]), int(row.get("n_depth", 0)),
                                   [int(x) for x in row["samples_ns"]])
        if row["n_prompt"] and not row["n_gen"]:
            pp = stats
        elif row["n_gen"] and not row["n_prompt"]:
            tg = stats
    return pp, tg


def measure_llama_bench(
    binary: str, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float = 600.0,
    cpu_mask: str | None = None,
) -> Measurement:
    argv = llama_bench_argv(binary, model, config, spec, cpu_mask)
    flags = tuple(argv[1:])
    t0 = time.perf_counter()
    try:
        rc, stdout, stderr = process.run(argv, timeout)
    except subprocess.TimeoutExpired as e:
        log = str(e.stderr or "")
        return Measurement("timeout", f"llama-bench still running after {timeout:.0f} s", spec, flags,
                           buffers=tuple(parse_buffer_lines(log)), wall_s=time.perf_counter() - t0, log=tail(log))
    buffers = tuple(parse_buffer_lines(stderr))
    if rc != 0:
        outcome, reason = classify_exit(rc, stderr)
        return Measurement(outcome, reason, spec, flags, buffers=buffers, wall_s=time.perf_counter() - t0,
                           returncode=rc, log=tail(stderr))
    pp, tg = parse_llama_bench_json(stdout)
    return Measurement("ok", CONTEXT_NOTE, spec, flags, pp, tg, buffers=buffers, wall_s=time.perf_counter() - t0,
                       llama_cpp=llama_bench_build(stdout), log=tail(stderr))
