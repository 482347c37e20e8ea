#!/usr/bin/env python
"""Expert order on one GPU, measured: the experts of N layers on the CPU, either the first N (`-ncmoe N`) or the
last N (llama.cpp --fit's order, the `-ot` rule fitter's tune writes: fitter.search.split.last_experts_rule), every
other layer on the device. Both run through fitter's worker on the emulated GPU (a capped llama.cpp RPC device, this
machine's CPU behind it) in R interleaved rounds of a fresh shuffled order; prints each round, the device memory
each held (measured peak against fitter's estimate) and the 95 % interval of last/first for prefill and decode
(fitter.noise: Student t over the rounds' paired log ratios).

    python benchmarks/expert_order.py [--rounds 6] [--n 4] [-p 512] [-n 64] [-r 3] [-t 2] [--cap 512]

The emulated GPU computes on this CPU, so the figure says what the order costs in llama.cpp's scheduling (graph
splits, copies), not a GPU's speed; a real GPU's figure needs one. Figures, not a test.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fitter.flags import parse_launch_flags
from fitter.flags.overrides import override_flags
from fitter.gguf.demo_models import demo_model_path
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.runners import WorkerRunner
from fitter.measure.types import BenchSpec
from fitter.memory.backends.devices import CPU_AVX2
from fitter.memory.plan.estimator import estimate
from fitter.noise import ratio_interval
from fitter.search.split import last_experts_rule
from fitter.units import MIB

BASE = ["-c", "4096", "-fa", "on", "-ngl", "all"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--n", dest="layers", type=int, default=4, help="expert layers on the CPU (default 4 of 8)")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--cap", type=int, default=512, help="the emulated GPU's MiB (default 512: everything fits)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = str(demo_model_path())
    spec = load_model_spec(model)
    rule = last_experts_rule(spec, args.layers)
    if rule is None:
        raise SystemExit(f"--n {args.layers}: first and last are the same placement on this model")
    bench = BenchSpec(n_prompt=args.p, n_gen=args.n, repetitions=args.r, threads=args.t, threads_batch=args.t)
    per_round: dict[str, dict[str, list[float]]] = {k: {"pp": [], "tg": []} for k in ("first", "last")}
    memory: dict[str, tuple[int, int]] = {}
    with WorkerRunner(emulated_gpu_mib=args.cap) as runner:
        rpc = ["--rpc", ",".join(runner.rpc)]
        flags = {"first": [*BASE, *rpc, "-ncmoe", str(args.layers)], "last": [*BASE, *rpc, *override_flags((rule,))]}
        for k in range(args.rounds):
            order = list(flags)
            random.Random(f"{args.seed}|order|{k}").shuffle(order)
            for name in order:
                config = parse_launch_flags(flags[name])
                plan = estimate(spec, config, runner.devices(), CPU_AVX2)
                result = runner.run(model, config, bench, None, plan)
                m = result.measurement
                if m.outcome != "ok" or m.pp is None or m.tg is None:
                    raise SystemExit(f"{name}: {m.outcome}: {m.reason}")
                per_round[name]["pp"].append(m.pp.avg_ts)
                per_round[name]["tg"].append(m.tg.avg_ts)
                device = next(d.name for d in runner.devices())
                memory[name] = (sum(p["bytes"] for p in result.peak_vram.values()), plan.totals()[device].total)
            print(f"round {k + 1}: " + "  ".join(f"{n} tg {per_round[n]['tg'][-1]:.1f} pp {per_round[n]['pp'][-1]:.1f}"
                                                  for n in order), flush=True)
    print(f"\ndemo model ({spec.n_layer} layers), {' '.join(BASE)} on a {args.cap} MiB emulated GPU, -t {args.t} "
          f"-p {args.p} -n {args.n} -r {args.r}; {args.rounds} interleaved rounds")
    for name in flags:
        measured, estimated = memory[name]
        print(f"  {name:<5} {' '.join(flags[name][len(BASE) + 2:])}: device peak {measured / MIB:.1f} MiB, "
              f"estimated {estimated / MIB:.1f} MiB")
    for key, label in (("tg", "decode"), ("pp", "prefill")):
        iv = ratio_interval(per_round["last"][key], per_round["first"][key])
        if iv is not None:
            verdict = "a tie" if iv[1] <= 1 <= iv[2] else "differs beyond noise"
            print(f"last/first {label} {iv[0]:.3f} (95 % CI {iv[1]:.3f}–{iv[2]:.3f}): {verdict}")


if __name__ == "__main__":
    main()
