#!/usr/bin/env python
"""Do llama-server and fitter's worker measure the same speeds? Interleaved rounds judged with fitter's noise model.

Each round runs `fitter bench` on the demo model once through the given llama-server and once through the worker, in
a fresh random order per round (a round is a block: slow drift moves both alike, fitter.noise); the ratio
server/worker of each speed is Student's t interval over the rounds' paired log ratios (fitter.noise.ratio_interval),
and the two backends are `tied` when every interval contains 1.

This is a benchmark, not a test: on a loaded machine the two backends are scheduled differently (llama-server's
HTTP and slot threads beside its one compute thread, the worker's single Python process), so their speeds differ
for a reason no noise model cancels (the README's test command beside two busy processes: 584 vs 243 t/s decode);
and a 95 % interval misses a true ratio of 1 one run in twenty. The test suite checks that both measure the same
quantity (tests/measure/test_bench.py); this benchmark, run on a quiet machine, checks the speeds.

    python benchmarks/server_vs_worker.py --llama-server PATH [--rounds 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fitter.noise import ratio_interval, tied  # noqa: E402

# the test's settings: 128 prompt tokens, 32 decoded after 64, 5 repetitions on one thread
BENCH = ["--json", "-t", "1", "-p", "128", "-n", "32", "-d", "64", "-r", "5"]


def bench(model: str, extra: list[str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "fitter.cli", "bench", model, *BENCH, *extra], capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    out: dict[str, Any] = json.loads(proc.stdout)
    if out.get("outcome") != "ok":
        raise SystemExit(f"fitter bench {' '.join(extra) or '(worker)'}: {out.get('outcome')}: {out.get('reason')}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = subprocess.run([sys.executable, "-m", "fitter.cli", "demo-model"], capture_output=True, text=True,
                           check=True, cwd=REPO).stdout.strip()
    backends = {"server": ["--llama-server", args.llama_server], "worker": []}
    rng = random.Random(args.seed)
    speeds: dict[str, dict[str, list[float]]] = {b: {"pp": [], "tg": []} for b in backends}
    for r in range(args.rounds):
        order = list(backends)
        rng.shuffle(order)
        for name in order:
            out = bench(model, backends[name])
            for key in ("pp", "tg"):
                speeds[name][key].append(out[key]["avg_ts"])
        print(f"round {r + 1}: " + ", ".join(f"{b} pp {speeds[b]['pp'][-1]:.1f} tg {speeds[b]['tg'][-1]:.1f} t/s"
                                              for b in order), flush=True)
    for key in ("pp", "tg"):
        iv = ratio_interval(speeds["server"][key], speeds["worker"][key])
        shown = "no interval (one round)" if iv is None else f"{iv[0]:.3f} [95 % CI {iv[1]:.3f}–{iv[2]:.3f}]"
        print(f"{key}: server/worker {shown}")
    print("tied: the same speeds within noise" if tied(speeds["server"], speeds["worker"])
          else "not tied: the backends' speeds differ beyond noise")


if __name__ == "__main__":
    main()
