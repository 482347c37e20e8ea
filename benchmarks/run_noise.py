#!/usr/bin/env python
"""Noise between runs, and what interleaved rounds make of it: one config measured as two contenders (A and A′, the
same flags) beside a second config B, in R rounds of a fresh shuffled order each, as `fitter tune`'s confirm runs
do (fitter.tune.confirm). Prints each contender's per-round decode/prefill, the raw spread between runs against the
spread inside a run, and the 95 % interval of A′/A (the method's resolution: it must contain 1) and of B/A
(fitter.noise: Student t over the rounds' paired log ratios).

    python benchmarks/run_noise.py [--rounds 6] [-p 512] [-n 128] [-r 3] [-t 2] [--other -ub 256]

The defaults are the issue's figure: the demo model, `-c 4096 -ub 512 -ctk f16 -ctv f16 -fa on -t 2 -p 512 -n 128
-r 3`, on the CPU. Figures, not a test.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fitter.flags import parse_launch_flags
from fitter.gguf.demo_models import demo_model_path
from fitter.measure.runners import WorkerRunner
from fitter.measure.types import BenchSpec
from fitter.noise import ratio_interval

BASE = ["-c", "4096", "-ub", "512", "-ctk", "f16", "-ctv", "f16", "-fa", "on", "-ngl", "0"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--other", nargs=argparse.REMAINDER, default=["-ub", "256"],
                    help="flags that make config B from A (default: -ub 256)")
    args = ap.parse_args()
    model = str(demo_model_path())
    configs = {"A": BASE, "A'": BASE, "B": [*BASE, *args.other]}
    spec = BenchSpec(n_prompt=args.p, n_gen=args.n, repetitions=args.r, threads=args.t, threads_batch=args.t)
    per_round: dict[str, dict[str, list[float]]] = {k: {"pp": [], "tg": []} for k in configs}
    within: dict[str, list[float]] = {"pp": [], "tg": []}
    with WorkerRunner() as runner:
        for k in range(args.rounds):
            order = list(configs)
            random.Random(f"{args.seed}|noise|{k}").shuffle(order)
            for name in order:
                m = runner.run(model, parse_launch_flags(configs[name]), spec, None).measurement
                if m.outcome != "ok" or m.pp is None or m.tg is None:
                    raise SystemExit(f"{name}: {m.outcome}: {m.reason}")
                for key, s in (("pp", m.pp), ("tg", m.tg)):
                    per_round[name][key].append(s.avg_ts)
                    within[key].append(s.stddev_ts / s.avg_ts)
            print(f"round {k + 1}: " + "  ".join(f"{n} tg {per_round[n]['tg'][-1]:.1f} pp {per_round[n]['pp'][-1]:.1f}"
                                                  for n in order), flush=True)
    print(f"\ndemo model, {' '.join(BASE)} -t {args.t} -p {args.p} -n {args.n} -r {args.r}; B adds "
          f"{' '.join(args.other)}; {args.rounds} interleaved rounds")
    for key, label in (("tg", "decode"), ("pp", "prefill")):
        a = per_round["A"][key] + per_round["A'"][key]
        print(f"{label}: A and A′ over {len(a)} runs {min(a):.1f}–{max(a):.1f} t/s (spread "
              f"{(max(a) - min(a)) / statistics.fmean(a):.0%} of the mean); inside a run the stddev is "
              f"{min(within[key]):.1%}–{max(within[key]):.1%}")
        for name in ("A'", "B"):
            iv = ratio_interval(per_round[name][key], per_round["A"][key])
            if iv is not None:
                verdict = "a tie" if iv[1] <= 1 <= iv[2] else "differs beyond noise"
                print(f"  {name}/A {label} {iv[0]:.3f} (95 % CI {iv[1]:.3f}–{iv[2]:.3f}): {verdict}")


if __name__ == "__main__":
    main()
