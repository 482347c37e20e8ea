#!/usr/bin/env python
"""What tuning for the workload served buys: the demo model tuned on a simulated machine three times — for one
request at depth 0 (today's default), for a long chat (depths 0 to 7424 of its 8192 context, weighted toward the deep
end) and for a 4-stream server (4 concurrent requests at depths 0 and 1024) — then each workload's pick and the
depth-0 pick measured under *each other's* workload in R interleaved rounds (a fresh order each round, as the
confirm runs do), and the ratio pick / depth-0 pick given with its 95 % interval (fitter.noise: Student t
over the rounds' paired log ratios).

    python benchmarks/workload_picks.py [--machine gpu-8gb] [--rounds 8] [--policy max-decode] [--run-noise 0.05]

The machine's profile gets `run_noise` (noise between runs of one config, as a shared machine has) so the rounds
differ as real runs do; the tunes and the cross-measurements use different seeds. Figures, not a test.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fitter.flags import parse_launch_flags
from fitter.gguf.demo_models import demo_model_path
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.served import WorkloadRunner
from fitter.measure.types import BenchSpec, WorkerError
from fitter.noise import ratio_interval
from fitter.sim import MACHINES_DIR, SimRunner, load_machine
from fitter.tune.options import MeasureOptions, SearchOptions, StorageOptions, TuneOptions
from fitter.tune.session import run_tune
from fitter.workload import Workload, serving_config

CONTEXT = ["-c", "8192"]
WORKLOADS = {
    "depth 0": Workload(source="depth 0"),
    "long chat": Workload(depths=(0, 2048, 4096, 7424), weights=(1.0, 2.0, 3.0, 2.0), source="long chat"),
    "4 streams": Workload(depths=(0, 1024), concurrency=4, source="4 streams"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--machine", default="gpu-8gb")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--policy", default="max-decode")
    ap.add_argument("--run-noise", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="fitter-workload-picks-"))
    profile = tmp / f"{args.machine}-noisy.toml"
    text = (MACHINES_DIR / f"{args.machine}.toml").read_text()
    profile.write_text(f"run_noise = {args.run_noise}\n{text}")
    model = str(demo_model_path())
    spec = load_model_spec(model)

    picks: dict[str, list[str]] = {}
    for name, w in WORKLOADS.items():
        base = serving_config(w, parse_launch_flags(CONTEXT))
        o = TuneOptions(model=model, spec=spec, base=base, workload=w,
                        search=SearchOptions(trials=args.trials, seed=args.seed),
                        measure=MeasureOptions(backend="sim", machine=str(profile), repetitions=3, confirm_rounds=4),
                        storage=StorageOptions(results=tmp / name.replace(" ", "-")))
        result = run_tune(o, None).result
        assert result is not None
        entry = result.entry(args.policy, "workload_picks")
        picks[name] = list(entry.flags or [])
        print(f"{name:>9} pick ({args.policy}): {' '.join(picks[name])}")

    machine = load_machine(profile)
    rng = random.Random(args.seed + 1)
    print(f"\nratio pick / depth-0 pick, each measured under the workload of the row, {args.rounds} interleaved "
          f"rounds on sim {args.machine} (run_noise {args.run_noise}); 95 % intervals")
    print(f"{'measured under':>15} {'pick of':>10} {'tg ratio [95 % CI]':>26} {'pp ratio [95 % CI]':>26}")
    for under, w in WORKLOADS.items():
        runner = WorkloadRunner(SimRunner(machine, spec, seed=args.seed + 7), w)
        for pick in WORKLOADS:
            if pick == "depth 0":
                continue
            contenders = {"depth 0": picks["depth 0"], pick: picks[pick]}
            speeds: dict[str, dict[str, list[float]]] = {c: {"tg": [], "pp": []} for c in contenders}
            refused = ""
            for _ in range(args.rounds):
                if refused:
                    break
                order = list(contenders)
                rng.shuffle(order)
                for c in order:
                    flags = contenders[c]
                    t = int(flags[flags.index("-t") + 1])
                    tb = int(flags[flags.index("-tb") + 1]) if "-tb" in flags else t
                    launch = [f for i, f in enumerate(flags) if f not in ("-t", "-tb") and
                              (i == 0 or flags[i - 1] not in ("-t", "-tb"))]
                    config = serving_config(w, parse_launch_flags(launch))
                    bench = BenchSpec(n_prompt=w.n_prompt, n_gen=w.n_gen, repetitions=3, threads=t, threads_batch=tb)
                    try:
                        m = runner.run(model, config, bench, None).measurement
                    except WorkerError as e:  # the pick's context or slots cannot hold this workload
                        refused = f"{c}: {e}"
                        break
                    assert m.outcome == "ok" and m.tg is not None and m.pp is not None, m.reason
                    speeds[c]["tg"].append(m.tg.avg_ts)
                    speeds[c]["pp"].append(m.pp.avg_ts)
            if refused:
                print(f"{under:>15} {pick:>10}   cannot serve it: {refused}")
                continue
            cells = []
            for test in ("tg", "pp"):
                iv = ratio_interval(speeds[pick][test], speeds["depth 0"][test])
                cells.append(f"{iv[0]:.3f} [{iv[1]:.3f}–{iv[2]:.3f}]" if iv else "-")
            same = " (the same config)" if picks[pick] == picks["depth 0"] else ""
            print(f"{under:>15} {pick:>10} {cells[0]:>26} {cells[1]:>26}{same}")


if __name__ == "__main__":
    main()
