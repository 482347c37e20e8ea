#!/usr/bin/env python
"""Speculative decoding, measured on text: a model decoding after each of the user's prompts (`--prompts`) through
the pinned llama-server, alone and with a draft model (`-md … --spec-type draft-simple`), in R interleaved rounds of
a fresh shuffled order. Prints each round, the drafted and accepted tokens, what the draft adds to memory (llama-
server's logged buffers against fitter's estimate) and the 95 % interval of each config's decode over the model
alone (fitter.noise: Student t over the rounds' paired log ratios).

    python benchmarks/draft_speed.py [--rounds 6] [--prompts examples/prompts.txt] [-n 64] [-r 2] [-t 2]

The drafts: the model drafting for itself (greedy: every drafted token is accepted, the mechanism's best case) and
another of fitter's tiny models with the same vocabulary and weights of its own (nearly none accepted: the cost of
a useless draft); `-md` without `--spec-type` loads the draft and drafts nothing (its memory, not its speed).
fitter's small models have random weights, so no figure here says what a trained draft gains. Figures, not a test.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fitter.flags import parse_launch_flags
from fitter.gguf.demo_models import SHAPES, write_model
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.llamacpp.tools import ensure_tools
from fitter.measure.server import measure_server
from fitter.measure.types import BenchSpec
from fitter.memory.plan.estimator import estimate
from fitter.noise import ratio_interval
from fitter.units import MIB
from fitter.workload.prompts import read_prompts

REPO = Path(__file__).resolve().parent.parent
BASE = ["-c", "2048", "-np", "1", "-fit", "off"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", default=str(REPO / "examples" / "prompts.txt"))
    ap.add_argument("--model", default="qwen3-tiny", help="one of fitter's small models (default qwen3-tiny)")
    ap.add_argument("--other", default="llama-tiny", help="the other draft (same vocabulary, default llama-tiny)")
    ap.add_argument("-p", type=int, default=64)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=2)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    binary = str(ensure_tools(["llama-server"])["llama-server"])
    prompts = read_prompts(args.prompts)
    bench = BenchSpec(n_prompt=args.p, n_gen=args.n, repetitions=args.r, threads=args.t, threads_batch=args.t,
                      prompts=prompts.texts)
    with tempfile.TemporaryDirectory(prefix="fitter-draft-speed-") as tmp:
        paths = {name: str(write_model(SHAPES[name], Path(tmp) / f"{name}.gguf")[0]) for name in (args.model,
                                                                                              args.other)}
        model, other = paths[args.model], paths[args.other]
        spec = ["--spec-type", "draft-simple"]
        flags = {"alone": [], "loaded": ["-md", other], "self": ["-md", model, *spec], "other": ["-md", other, *spec]}
        speeds: dict[str, list[float]] = {name: [] for name in flags}
        drafted: dict[str, list[int]] = {name: [0, 0] for name in flags}
        memory: dict[str, tuple[float, float]] = {}
        for k in range(args.rounds):
            order = list(flags)
            random.Random(f"{args.seed}|order|{k}").shuffle(order)
            for name in order:
                argv = [*BASE, *flags[name], "-t", str(args.t)]
                m = measure_server(binary, model, argv, bench, timeout=300, vocab_size=SHAPES[args.model].n_vocab)
                if m.outcome != "ok" or m.tg is None:
                    raise SystemExit(f"{name}: {m.outcome}: {m.reason}")
                speeds[name].append(m.tg.avg_ts)
                if m.drafted is not None:
                    drafted[name] = [drafted[name][0] + m.drafted[0], drafted[name][1] + m.drafted[1]]
                config = parse_launch_flags([*BASE, *flags[name]])
                draft = config.draft_model
                plan = estimate(load_model_spec(model, draft), config)
                memory[name] = (sum(b.mib for b in m.buffers) * MIB, plan.totals()["CPU"].total)
            print(f"round {k + 1}: " + "  ".join(f"{n} {speeds[n][-1]:.0f}" for n in order), flush=True)
    print(f"\n{args.model} decoding {args.n} tokens after each of {len(prompts.texts)} prompts of {prompts.file}, "
          f"{' '.join(BASE)} -t {args.t} -r {args.r}; {args.rounds} interleaved rounds (t/s of each round's mean)")
    for name in flags:
        logged, est = memory[name]
        n, accepted = drafted[name]
        share = f", {accepted} of {n} drafted tokens accepted" if n else ""
        print(f"  {name:<6} {' '.join(flags[name]).replace(tmp, '…') or '(no draft)'}: llama-server's buffers "
              f"{logged / MIB:.2f} MiB, estimated {est / MIB:.2f} MiB{share}")
    for name in ("loaded", "self", "other"):
        iv = ratio_interval(speeds[name], speeds["alone"])
        if iv is not None:
            verdict = "a tie" if iv[1] <= 1 <= iv[2] else "differs beyond noise"
            print(f"{name}/alone decode {iv[0]:.3f} (95 % CI {iv[1]:.3f}–{iv[2]:.3f}): {verdict}")


if __name__ == "__main__":
    main()
