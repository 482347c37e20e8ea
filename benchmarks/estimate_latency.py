"""Wall time of a whole `fitter estimate` process on a gpt-oss-120b-shaped 3-shard model (target: < 0.5 s).

Prints figures; it is not a test. The model is header-only (sparse files), written to a temp dir first.
    python benchmarks/estimate_latency.py [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fitter.gguf.demo_models import SHAPES, write_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_model(SHAPES["gpt-oss-120b"], Path(tmp) / "gpt-oss-120b.gguf", sparse=True, n_shards=3)
        targets = {
            "CPU only (graph replay)": ["--devices", "none"],
            "24 GB CUDA, -ncmoe 30": ["--devices", "cuda:24576", "-ncmoe", "30"],
        }
        print(f"fitter estimate, gpt-oss-120b shape, 3 shards, -c 32768 --json, {args.runs} runs (whole process):")
        for label, extra in targets.items():
            cmd = [sys.executable, "-m", "fitter.cli", "estimate", str(shards[0]), *extra, "-c", "32768", "--json"]
            subprocess.run(cmd, check=True, capture_output=True)  # warm the page cache once
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True)
                times.append(time.perf_counter() - t0)
            verdict = "met" if statistics.median(times) < 0.5 else "MISSED"
            print(f"  {label:<26} median {statistics.median(times):.3f} s  min {min(times):.3f} s  "
                  f"max {max(times):.3f} s  (target < 0.5 s: {verdict})")


if __name__ == "__main__":
    main()
