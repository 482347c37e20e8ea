"""The drift guard's two figures on another llama.cpp: fitter's estimate (rules matched at 0c1e570) beside the
build's own projection (`llama-fit-params --fit-print on`), on the pinned build and on a build of another commit.

Prints figures; it is not a test (building the other llama.cpp takes ~10 minutes on 2 cores the first time; it is
cached in fitter's home under drift/). The other build is llama-cpp-python VERSION's vendored llama.cpp, built with
fitter's recipe (fitter.measure.llamacpp.tools: RPC on, portable CPU kernels, shared libraries). Each config of the demo
model is projected by both builds on the CPU and on an emulated GPU served by that build's own ggml (its RPC
protocol on both ends); a config a build cannot project is reported, not hidden.
    python benchmarks/projection_drift.py [--version 0.3.30] [--gpu-mib 4000]
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import tempfile
from pathlib import Path

from fitter.errors import FitterError
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.llamacpp.projection import compare, project, tool_estimate
from fitter.measure.llamacpp.tools import (
    LLAMA_CPP_COMMIT,
    LLAMA_CPP_PYTHON,
    build_llama_cpp,
    ensure_tools,
    sdist_archive,
    submodule_head,
)
from fitter.memory.backends.devices import CPU_AVX2, rpc_devices
from fitter.paths import fitter_home
from fitter.units import MIB

CONFIGS = {  # llama-server flags of the demo model, as tests/measure/llamacpp/test_projection.py projects them
    "-c 4096 -nr": ["-c", "4096", "-nr"],
    "-c 4096 -ub 2048 -b 2048 -nr": ["-c", "4096", "-ub", "2048", "-b", "2048", "-nr"],
    "-c 8192 -np 2 -ctk/-ctv q8_0 -fa on -nr": ["-c", "8192", "-np", "2", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on",
                                               "-nr"],
    "-c 4096 -ngl all -cmoe (GPU)": ["-c", "4096", "-ngl", "all", "-cmoe"],
    "-c 4096 -ngl 3 (GPU)": ["-c", "4096", "-ngl", "3"],
}


def other_build(version: str) -> Path:
    """llama-fit-params and llama-server of llama-cpp-python `version`'s llama.cpp, built once (cached)."""
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(sdist_archive(Path(tmp) / "log", version)) as tar:
        commit = submodule_head(tar, f"llama-cpp-python {version}")[: len(LLAMA_CPP_COMMIT)]  # the download is cached
    home = fitter_home() / "drift" / f"llama.cpp-{version}-{commit}"
    if not (home / "llama-fit-params").is_file():
        print(f"building llama.cpp {commit} (llama-cpp-python {version}) into {home} ...", file=sys.stderr)
        info = build_llama_cpp(home, ["llama-fit-params", "llama-server"], version=version)
        print(f"  built in {info['seconds']:.0f} s", file=sys.stderr)
    return home


def run(label: str, tool: Path, gpu_mib: int) -> list[float]:
    """Each config projected by `tool` beside fitter's estimate; the largest |difference| per config (MiB)."""
    from fitter.gguf.demo_models import demo_model_path
    from fitter.measure.emulator.emulated_gpu import EmulatedGpu

    model = demo_model_path()
    spec = load_model_spec(str(model))
    worst: list[float] = []
    print(f"\n== {label}: {tool}")
    with EmulatedGpu(gpu_mib, beside=tool) as gpu:  # the build's own RPC server: its protocol
        for name, flags in CONFIGS.items():
            on_gpu = "-ngl" in flags
            flags = [*flags, "--rpc", gpu.endpoint] if on_gpu else flags
            try:
                theirs = project(tool, model, flags).devices
            except FitterError as e:
                print(f"-- {name}: the build gave no projection: {str(e).splitlines()[0][:160]}")
                continue
            ours = tool_estimate(spec, flags, rpc_devices([gpu.endpoint]) if on_gpu else (), CPU_AVX2)
            # the dry run allocates no CPU_REPACK buffer, so without -nr the host model leaves those weights out
            # (fitter.measure.llamacpp.projection); that known gap is printed, not counted
            diffs = [abs(ours.get(d, {}).get(k, 0) - theirs.get(d, {}).get(k, 0)) / MIB
                     for d in set(ours) | set(theirs) for k in ("model", "kv", "compute")
                     if not (d == "CPU" and k == "model" and "-nr" not in flags)]
            worst.append(max(diffs))
            print(f"-- {name}: largest |fitter - build| {max(diffs):.2f} MiB")
            print("\n".join(compare(ours, theirs)))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", default="0.3.30", help="the llama-cpp-python whose vendored llama.cpp is the other")
    ap.add_argument("--gpu-mib", type=int, default=4000)
    args = ap.parse_args()
    pinned = ensure_tools(["llama-fit-params"])["llama-fit-params"]
    other = other_build(args.version) / "llama-fit-params"
    a = run(f"pinned {LLAMA_CPP_COMMIT} (llama-cpp-python {LLAMA_CPP_PYTHON})", pinned, args.gpu_mib)
    b = run(f"other: {other.parent.name}", other, args.gpu_mib)
    print("\nlargest |fitter - build| per config, MiB (the build's figures are floored to whole MiB; the host model "
          "without -nr left out):")
    print(f"  pinned: {', '.join(f'{x:.2f}' for x in a)}")
    print(f"  other:  {', '.join(f'{x:.2f}' for x in b) or 'no projection'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
