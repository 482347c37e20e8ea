#!/usr/bin/env python
"""`fitter fit` on two and three GPUs against the GPU0-first placement (llama.cpp's default split by free memory
with the smallest `-ncmoe` that fits), on the gpt-oss-120b shape (header only) at -c 32768: bytes per GPU, what is
left beyond each budget, the flags and the time. Estimator only (hypothetical CUDA GPUs).

    python benchmarks/fit_devices.py [--devices cuda:24576,12288 ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from fitter.flags import parse_launch_flags
from fitter.flags.overrides import ncmoe_rules
from fitter.gguf.demo_models import SHAPES, write_model
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.budgets import DEFAULT_FIT_TARGET_MIB, device_budgets
from fitter.memory.devices import parse_devices
from fitter.memory.estimator import estimate
from fitter.memory.fit import fit

MIB = 1024 * 1024
CASES = ("cuda:24576,12288", "cuda:24576,24576", "cuda:24576,12288,12288", "cuda:16384,8192")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", nargs="*", default=list(CASES))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(SHAPES["gpt-oss-120b"], Path(tmp) / "gpt-oss-120b.gguf", sparse=True, n_shards=3)[0]
        spec = load_model_spec(str(path))
        base = parse_launch_flags(["-c", "32768"])
        for text in args.devices:
            devices = parse_devices(text)
            budgets = device_budgets(devices, (DEFAULT_FIT_TARGET_MIB,))
            t0 = time.perf_counter()
            result = fit(spec, base, devices)
            took = time.perf_counter() - t0
            totals = result.plan.totals()
            naive = None
            for n in range(spec.n_layer + 1):
                plan = estimate(spec, replace(base, n_gpu_layers=-2, overrides=ncmoe_rules(n)), devices)
                t = plan.totals()
                if all(t[d.name].total <= (budgets[d.name] or 0) for d in devices):
                    naive = (n, [t[d.name].total for d in devices])
                    break
            used = [totals[d.name].total for d in devices]
            slack = [(budgets[d.name] or 0) - u for d, u in zip(devices, used, strict=True)]
            print(f"{text}: fitter {' + '.join(f'{u / MIB:.0f}' for u in used)} = {sum(used) / MIB:.0f} MiB "
                  f"(-ngl {result.config.n_gpu_layers} -ts {','.join(f'{x:g}' for x in result.config.tensor_split)}; "
                  f"left beyond the budgets {', '.join(f'{x / MIB:.0f}' for x in slack)} MiB) in {took:.2f} s")
            if naive is not None:
                print(f"  GPU0-first -ncmoe {naive[0]}: {' + '.join(f'{u / MIB:.0f}' for u in naive[1])} = "
                      f"{sum(naive[1]) / MIB:.0f} MiB")


if __name__ == "__main__":
    main()
