#!/usr/bin/env python
"""`fitter fit` on two and three GPUs against the GPU0-first placement (llama.cpp's default split by free memory
with the smallest `-ncmoe` that fits) and against llama.cpp's own `--fit` (llama-fit-params on emulated GPUs of the
same free memory, its answer's `-ot …=RPC0[…]` read as the GPU each stood for), on the gpt-oss-120b shape (header
only) at -c 32768: bytes per GPU by fitter's estimator, what is left beyond each budget, the flags and the time.
Hypothetical CUDA GPUs for fitter's fit; llama.cpp's fit is compared like with like on RPC devices of the same free
memory, the only devices it can be given here (their compute buffers are the CPU backend's, smaller than CUDA's).

    python benchmarks/fit_devices.py [--devices cuda:24576,12288 ...] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from fitter.flags import LaunchConfig, parse_launch_flags, pin
from fitter.flags.overrides import ncmoe_rules
from fitter.gguf.demo_models import SHAPES, write_model
from fitter.gguf.model_spec import ModelSpec, load_model_spec
from fitter.measure.emulator.emulated_gpu import EmulatedGpus
from fitter.measure.llamacpp.fit_params import LlamaFitError, baseline_config, find_llama_fit_params, run_llama_fit
from fitter.memory.backends.devices import Device
from fitter.memory.backends.registry import parse_devices
from fitter.memory.fit.budgets import DEFAULT_FIT_TARGET_MIB, device_budgets
from fitter.memory.fit.fit import fit
from fitter.memory.plan.estimator import estimate

MIB = 1024 * 1024
CASES = ("cuda:24576,12288", "cuda:24576,24576", "cuda:24576,12288,12288", "cuda:16384,8192")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", nargs="*", default=list(CASES))
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's own --fit")
    args = ap.parse_args()
    tool = None if args.no_llama_cpp else find_llama_fit_params()
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
            if tool is not None:
                print("  " + llama_cpp_fit(tool, path, spec, base, devices, budgets))


def llama_cpp_fit(tool: Path, model: Path, spec: ModelSpec, base: LaunchConfig, devices: tuple[Device, ...],
                  budgets: dict[str, int | None]) -> str:
    """Like with like: llama.cpp's --fit and fitter's fit on emulated RPC devices of the same free memory (the
    devices llama-fit-params can be given here), both answers estimated on them (fitter's RPC rules are exact:
    tests/golden/rpc2.json, rpc3.json)."""
    t0 = time.perf_counter()
    caps = tuple((d.free_bytes or 0) // MIB for d in devices)
    with EmulatedGpus(caps, beside=tool) as gpus:
        rpc = gpus.devices()
        try:
            answer = run_llama_fit(tool, model, pin(base, given=True), gpus.endpoints, (DEFAULT_FIT_TARGET_MIB,))
        except LlamaFitError as e:
            return f"llama.cpp --fit: {e}"
        took = time.perf_counter() - t0
        on_rpc = ["--rpc", ",".join(gpus.endpoints)]
        chosen = baseline_config(answer, base).with_given(rpc=tuple(gpus.endpoints))
        theirs = estimate(spec, chosen, rpc)
        ours = fit(spec, base.with_given(rpc=tuple(gpus.endpoints)), rpc).plan
    lines = []
    for who, plan in (("llama.cpp --fit", theirs), ("fitter fit", ours)):
        totals = plan.totals()
        used = [totals[d.name].total for d in rpc]
        left = [caps[i] * MIB - DEFAULT_FIT_TARGET_MIB * MIB - u for i, u in enumerate(used)]
        lines.append(f"{who}: {' + '.join(f'{u / MIB:.0f}' for u in used)} = {sum(used) / MIB:.0f} MiB (left beyond "
                     f"the budgets {', '.join(f'{x / MIB:.0f}' for x in left)} MiB)")
    flags = " ".join(f for f in pin(chosen, given=True) if len(f) < 40 and f not in on_rpc)
    return (f"on RPC devices of the same free memory: {lines[0]}, {flags}, in {took:.1f} s; "
            f"{lines[1]}")


if __name__ == "__main__":
    main()
