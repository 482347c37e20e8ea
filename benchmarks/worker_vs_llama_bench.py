"""fitter's worker against llama-bench built from the same llama.cpp source: same model, flags and test sizes.

Prints figures; it is not a test. llama-bench sizes its context at p+n (fitter's worker at the deployed -c), so
the comparison uses -c p+n rounded up to 256 for the worker. Also times a first trial (model load) against a
trial that reuses the loaded model.

    python benchmarks/worker_vs_llama_bench.py [MODEL] [-p 512] [-n 128] [-r 3] [-t 1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

from fitter.flags import parse_launch_flags
from fitter.gguf.demo_models import demo_model_path
from fitter.measure.llamacpp.tools import ensure_tools
from fitter.measure.types import BenchSpec
from fitter.measure.worker import LlamaWorker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-t", type=int, default=1)
    args = ap.parse_args()
    model = args.model or str(demo_model_path())
    bench = ensure_tools(["llama-bench"])["llama-bench"]

    t0 = time.perf_counter()
    proc = subprocess.run([str(bench), "-m", model, "-p", str(args.p), "-n", str(args.n), "-r", str(args.r),
                           "-t", str(args.t), "-fa", "1", "-o", "json"], capture_output=True, text=True, check=True)
    lb_wall = time.perf_counter() - t0
    rows = json.loads(proc.stdout)
    lb = {("pp" if r["n_prompt"] else "tg"): (r["avg_ts"], r["stddev_ts"]) for r in rows}

    ctx = -(-(args.p + args.n) // 256) * 256
    config = parse_launch_flags(["-c", str(ctx), "-np", "1", "-fa", "on", "-b", "2048", "-ub", "512"])
    spec = BenchSpec(n_prompt=args.p, n_gen=args.n, repetitions=args.r, threads=args.t)
    with LlamaWorker() as worker:
        first = worker.run(model, config, spec)
        again = worker.run(model, config, spec)
    assert first.pp and first.tg and again.pp and again.tg, (first.reason, again.reason)

    print(f"model {model}, -p {args.p} -n {args.n} -r {args.r} -t {args.t}, flash attention on")
    print(f"{'':<22}{'pp t/s':>18}{'tg t/s':>18}{'wall s':>10}")
    print(f"{'llama-bench':<22}{lb['pp'][0]:>10.1f} ± {lb['pp'][1]:<5.1f}{lb['tg'][0]:>10.1f} ± {lb['tg'][1]:<5.1f}"
          f"{lb_wall:>10.2f}")
    for label, m in (("fitter worker (first)", first), ("fitter worker (reuse)", again)):
        print(f"{label:<22}{m.pp.avg_ts:>10.1f} ± {m.pp.stddev_ts:<5.1f}{m.tg.avg_ts:>10.1f} ± "
              f"{m.tg.stddev_ts:<5.1f}{m.wall_s:>10.2f}")
    print(f"ratio worker/llama-bench: pp {again.pp.avg_ts / lb['pp'][0]:.3f}, tg {again.tg.avg_ts / lb['tg'][0]:.3f}")
    print(f"first trial {first.wall_s:.2f} s (load {first.load_s:.2f} s) vs model-reusing trial {again.wall_s:.2f} s")


if __name__ == "__main__":
    main()
