"""Wall time of whole `fitter estimate` and `fitter fit` processes on a gpt-oss-120b-shaped 3-shard model (or
`--shape deepseek-v3`: 61 MLA layers, 256 experts, the largest shape fitter rebuilds), beside a bare
`fitter --version` (the interpreter and fitter's imports alone), so a figure can be read as a ratio to start-up.

Targets (issues 14 and 22): `fitter fit --devices cuda:24576 -c 32768` ≤ 1.5 s, `fitter estimate` on it ≤ 0.25 s.
Prints figures; it is not a test. The model is header-only (sparse files), written to a temp dir first. Runs are
interleaved (each round runs every command once), so drift on a shared machine hits them all alike; the CPU time
(user + sys of the process) is printed beside the wall time, as it barely moves when other work shares the cores.
The commands run with bytecode caching on, as an installed fitter does (pip compiles it at install): a
PYTHONDONTWRITEBYTECODE=1 in the environment (set on the machines fitter is developed on) would recompile fitter's
modules in every process, ~0.07 s of CPU each; `--no-bytecode` measures that case.
    python benchmarks/estimate_latency.py [--runs 5] [--no-bytecode] [--shape deepseek-v3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fitter.gguf.demo_models import SHAPES, write_model

TARGETS_S = {"estimate": 0.25, "fit": 1.5}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--shape", default="gpt-oss-120b", choices=("gpt-oss-120b", "deepseek-v3", "deepseek-v3-nextn"))
    ap.add_argument("--no-bytecode", action="store_true", help="keep PYTHONDONTWRITEBYTECODE as the environment has it")
    args = ap.parse_args()
    env = dict(os.environ)
    if not args.no_bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_model(SHAPES[args.shape], Path(tmp) / f"{args.shape}.gguf", sparse=True, n_shards=3)
        fitter = [sys.executable, "-m", "fitter.cli"]
        model = str(shards[0])
        commands = {
            "fitter --version": [*fitter, "--version"],
            "estimate, CPU only (graph replay)": [*fitter, "estimate", model, "--devices", "none", "-c", "32768",
                                                  "--json"],
            "estimate, 24 GB CUDA, -ncmoe 30": [*fitter, "estimate", model, "--devices", "cuda:24576", "-ncmoe", "30",
                                                "-c", "32768", "--json"],
            "fit, 24 GB CUDA": [*fitter, "fit", model, "--devices", "cuda:24576", "-c", "32768", "--json"],
        }
        for cmd in commands.values():
            subprocess.run(cmd, check=True, capture_output=True, env=env)  # warm the page cache once
        times: dict[str, list[float]] = {label: [] for label in commands}
        cpu: dict[str, list[float]] = {label: [] for label in commands}
        for _ in range(args.runs):
            for label, cmd in commands.items():
                c0, t0 = _children_cpu(), time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True, env=env)
                times[label].append(time.perf_counter() - t0)
                cpu[label].append(_children_cpu() - c0)
    base = statistics.median(times["fitter --version"])
    print(f"{args.shape} shape, 3 shards, -c 32768, {args.runs} interleaved runs each (whole process; wall, then CPU):")
    for label, ts in times.items():
        med = statistics.median(ts)
        kind = label.split(",")[0]
        verdict = f"  target ≤ {TARGETS_S[kind]} s: {'met' if med <= TARGETS_S[kind] else 'MISSED'}" \
            if kind in TARGETS_S else ""
        print(f"  {label:<36} median {med:.3f} s  min {min(ts):.3f}  max {max(ts):.3f}  "
              f"{med / base:5.1f}× --version{verdict}")
        print(f"  {'':<36} CPU    {statistics.median(cpu[label]):.3f} s  min {min(cpu[label]):.3f}  "
              f"max {max(cpu[label]):.3f}")


def _children_cpu() -> float:
    """User + system seconds of the finished child processes so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


if __name__ == "__main__":
    main()
