#!/usr/bin/env python
"""Memory a CUDA process holds outside llama.cpp's buffers, step by step, on a real NVIDIA GPU (NVML).

For each model and flag list: in one process, NVML's per-process used memory on CUDA0 after `llama_backend_init`
(the CUDA context, where the backend creates it), after the model load, after the context (KV and compute buffers),
and after the first prefill (cuBLAS workspaces, the CUDA pool's temporaries), each beside the device buffers
llama.cpp logged so far; the difference is what fitter.memory.backends.overhead predicts. Every case runs in a child
process of its own, so each starts from an empty CUDA context.

    python scripts/gpu_overhead.py [--out tests/golden/cuda-overhead.json] [--models demo,gpt-oss-tiny]

Needs a llama-cpp-python built with CUDA and NVML (nvidia-ml-py); scripts/gpu_check.sh runs it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fitter.flags import parse_launch_flags  # noqa: E402
from fitter.gguf.demo_models import SHAPES, write_model  # noqa: E402
from fitter.measure.logs import parse_buffer_lines  # noqa: E402

# read as llama-cpp-python reads them (-b would default to 512): -b is given so the first prefill is a full batch
CASES: dict[str, list[str]] = {
    "ngl-all-c4096": ["-c", "4096", "-b", "2048", "-ngl", "all", "-fa", "on"],
    "ngl-all-cmoe-ub2048": ["-c", "4096", "-b", "2048", "-ub", "2048", "-ngl", "all", "-cmoe", "-fa", "on"],
    "ngl-0-c4096": ["-c", "4096", "-b", "2048", "-ngl", "0"],
}
MIB = 2**20


def _used_by(pid: int) -> int:
    """NVML's memory of this process on GPU 0 (compute processes)."""
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
        if p.pid == pid and p.usedGpuMemory is not None:
            return int(p.usedGpuMemory)
    return 0


def _device_buffers(log: str) -> int:
    return sum(round(b.mib * MIB) for b in parse_buffer_lines(log) if b.buft.startswith("CUDA0"))


def child(model: str, flags: list[str], log_path: Path) -> dict[str, Any]:
    """The steps, in this process (run by the parent in a fresh child)."""
    import llama_cpp
    import pynvml

    from fitter.measure.capi import Ggml, LogSink, build_context_params, build_model_params

    pynvml.nvmlInit()
    pid = os.getpid()
    sink = LogSink(log_path)
    llama_cpp.llama_log_set(sink.callback, ctypes.c_void_p(0))
    steps: list[dict[str, Any]] = []

    def step(name: str) -> None:
        time.sleep(0.2)  # NVML's accounting lags an allocation slightly
        used = _used_by(pid)
        logged = _device_buffers(log_path.read_text(errors="replace"))
        steps.append({"step": name, "nvml_used": used, "logged_device_buffers": logged, "outside": used - logged})

    llama_cpp.llama_backend_init()
    step("backend init")
    config = parse_launch_flags(flags, "llama-cpp-python")
    keep: list[Any] = []
    ggml = Ggml(Path(llama_cpp.__file__).parent / "lib")
    model = llama_cpp.llama_model_load_from_file(model.encode(), build_model_params(config, ggml, keep))
    if not model:
        return {"error": "model load failed: " + sink.error_text(), "steps": steps}
    step("model loaded")
    ctx = llama_cpp.llama_init_from_model(model, build_context_params(config, None, 4, 4))
    if not ctx:
        return {"error": "context failed: " + sink.error_text(), "steps": steps}
    step("context created")
    n = int(llama_cpp.llama_n_batch(ctx))  # one batch: llama_decode runs it as ubatches of -ub
    tokens = (llama_cpp.llama_token * n)(*[1 + i % 200 for i in range(n)])
    rc = int(llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, n)))
    llama_cpp.llama_synchronize(ctx)
    step(f"first prefill ({n} tokens, rc {rc})")
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return {"error": None, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "golden" / "cuda-overhead.json")
    ap.add_argument("--models", default="demo,gpt-oss-tiny")
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "FLAGS_JSON", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        model, flags, result = args.child
        with tempfile.TemporaryDirectory() as tmp:
            out = child(model, json.loads(flags), Path(tmp) / "llama.log")
        Path(result).write_text(json.dumps(out))
        return 0
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    gpu = {"name": pynvml.nvmlDeviceGetName(h), "driver": pynvml.nvmlSystemGetDriverVersion(),
           "compute_capability": list(pynvml.nvmlDeviceGetCudaComputeCapability(h))}
    records = []
    with tempfile.TemporaryDirectory(prefix="fitter-overhead-") as tmp:
        for name in args.models.split(","):
            path = write_model(SHAPES[name], Path(tmp) / f"{name}.gguf")[0]
            for case, flags in CASES.items():
                result = Path(tmp) / "result.json"
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, __file__, "--child", str(path), json.dumps(flags), str(result)],
                                      capture_output=True, text=True, timeout=300)
                rec = json.loads(result.read_text()) if result.exists() else {
                    "error": f"child exit {proc.returncode}: {proc.stderr[-2000:]}", "steps": []}
                records.append({"model": name, "case": case, "flags": flags, **rec,
                                "seconds": round(time.perf_counter() - t0, 2)})
                outside = [f"{s['step']}: {s['outside'] / MIB:.1f} MiB" for s in rec["steps"]]
                print(f"{name}/{case}: {rec['error'] or '; '.join(outside)}", file=sys.stderr)
                result.unlink(missing_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"generated_by": "scripts/gpu_overhead.py", "gpu": gpu, "cases": records},
                                   indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
