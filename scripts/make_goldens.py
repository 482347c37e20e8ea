#!/usr/bin/env python
"""Write tests/golden/cpu.json (or rpc.json): the buffers the real llama.cpp allocates for models × flags.

`--device cpu` (default): CPU only. `--device cuda`: the first CUDA GPU, with a llama-cpp-python built with
`CMAKE_ARGS="-DGGML_CUDA=on -DGGML_RPC=ON"` (the same matrix as rpc; the CUDA rules stay "not yet validated"
until this has run on a GPU and tests/golden/cuda.json exists). `--device rpc`: with fitter's emulated GPU (an RPC
device on 127.0.0.1 whose cap is large enough never to refuse), so layers, KV and compute land on a GPU-type device;
its buffers are recorded under the canonical name RPC0[127.0.0.1:50052] whatever port the run used, and `{rpc}` in a
flag list stands for that device.

Models come from fitter.gguf.demo_models: the tiny test shapes and "demo" as real files, and four real shapes as
header-only sparse files (mmap on, --no-repack: nothing is read or written but the headers). Each flag list is
parsed as llama-server flags (fitter.flags.config.parse_launch_flags) and loaded through
fitter.measure.loader in a child process; the buffers llama.cpp logged are recorded.

About a fifth of the cases are marked "held_out" (a fixed rule on the case id): they are for a held-out check
of the estimator and must not be tuned against.

`--device cuda-emulated`: the same on the CUDA-shaped emulated GPU (`EmulatedGpu(cuda=True)`: CUDA's alignment,
row padding and flash-attention scratch answered by the server, CUDA's op offload, host buffer type and
flash-attention support in the client), with cases where those rules matter: big ubatches with experts on the CPU
(op offload copies), quantized caches at long context (scratch), `--no-op-offload`, `--no-mmap` (CUDA_Host).

`--for PROGRAM` (fitter.flags.consumers): the flags are read with that program's defaults and the loader sets
its context parameters (llama-cpp-python and llama-bench: the C API's n_outputs_max 0 = n_batch, swa_full as that
program has it); the file is tests/golden/<device>.<program>.json, and the C API's programs get a few more cases
where reserving logits for a whole ubatch matters most (-ub 4096 on the real shapes).

    python scripts/make_goldens.py [--device cpu|rpc] [--for PROGRAM] [--out tests/golden/cpu.json] [--jobs 2]

Deterministic: the same llama.cpp build gives the same file (cases sorted by id, buffers in log order).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitter.errors import LaunchConfigError
from fitter.flags import parse_launch_flags
from fitter.flags.consumers import CONSUMER_NAMES, DEFAULT_CONSUMER, consumer
from fitter.gguf.demo_models import SHAPES, write_model
from fitter.measure.loader import CaptureResult, llama_cpp_info, load_and_capture

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "golden" / "cpu.json"

# Small models: real files, a few MiB each (demo ~95 MB); sub-second loads.
SMALL_MODELS = (
    "gpt-oss-tiny", "qwen3moe-tiny", "qwen2moe-tiny", "mixtral-tiny", "llama-tiny", "qwen3-tiny",
    "deepseek2-tiny", "demo",
)
# Real shapes: header-only sparse files (name -> shards).
REAL_MODELS = {"gpt-oss-120b": 3, "gpt-oss-20b": 1, "qwen3-30b-a3b": 1, "mixtral-8x7b": 1}

C4K = ["-c", "4096"]
SMALL_FLAGS: dict[str, list[str]] = {
    "default": [],  # -c 0: the training context
    "c256": ["-c", "256"],  # -b and -ub clamp to the context
    "c512": ["-c", "512"],
    "c2048": ["-c", "2048"],
    "c4096": C4K,
    "c4097": ["-c", "4097"],  # padded to 4352
    "c4096-b2048-ub128": [*C4K, "-b", "2048", "-ub", "128"],
    "c4096-b2048-ub512": [*C4K, "-b", "2048", "-ub", "512"],
    "c4096-b2048-ub1024": [*C4K, "-b", "2048", "-ub", "1024"],
    "c4096-b4096-ub4096": [*C4K, "-b", "4096", "-ub", "4096"],
    "c4096-b256-ub512": [*C4K, "-b", "256", "-ub", "512"],  # -ub clamps to -b
    "c4096-kv-q8_0-fa-on": [*C4K, "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
    "c4096-k-q4_0-fa-on": [*C4K, "-ctk", "q4_0", "-fa", "on"],
    "c4096-v-q8_0-fa-auto": [*C4K, "-ctv", "q8_0"],
    "c4096-fa-off": [*C4K, "-fa", "off"],
    "c4096-np1": [*C4K, "-np", "1"],
    "c4096-np2-no-kvu": [*C4K, "-np", "2", "--no-kv-unified"],
    "c4096-np2-kvu": [*C4K, "-np", "2", "--kv-unified"],
    "c1000-np3": ["-np", "3", "-c", "1000"],
    "c4096-swa-full": [*C4K, "--swa-full"],
    "c4096-nr": [*C4K, "-nr"],
    "c4096-no-mmap": [*C4K, "--no-mmap"],
    "c4096-no-mmap-nr": [*C4K, "--no-mmap", "-nr"],
    "c4096-cmoe": [*C4K, "-cmoe"],  # CPU only: changes nothing, but must load
    "c4096-ncmoe2": [*C4K, "-ncmoe", "2"],
}
# Only for one model: a buffer type this machine does not have (llama-server: "unknown buffer type").
ERROR_FLAGS: dict[str, dict[str, list[str]]] = {
    "gpt-oss-tiny": {"c4096-ot-cuda0": [*C4K, "-ot", r"\.ffn_up_exps=CUDA0"]},
}
REAL_FLAGS: dict[str, list[str]] = {
    "c4096-nr": [*C4K, "-nr"],  # llama-server's defaults otherwise (4 slots, unified KV, -fa auto)
    "c32768-nr-fa-off": ["-c", "32768", "-nr", "-fa", "off"],
    "c4096-kv-q8_0-nr": [*C4K, "-ctk", "q8_0", "-ctv", "q8_0", "-nr"],
}
REAL_SWA_FLAGS: dict[str, list[str]] = {"c4096-nr-swa-full": [*C4K, "-nr", "--swa-full"]}
# For the C API's programs (llama-cpp-python, llama-bench): logits for a whole ubatch are largest at -ub 4096.
C_API_REAL_FLAGS: dict[str, list[str]] = {
    "c4096-nr-b4096-ub4096": [*C4K, "-nr", "-b", "4096", "-ub", "4096"],
    "c4096-nr-ngl-all": [*C4K, "-nr", "-ngl", "all", "-fa", "on"],
}

# The emulated GPU: every flag list gets `--rpc <endpoint>`; {rpc} is the device's buffer type name.
CANONICAL_RPC = "127.0.0.1:50052"
ALL = [*C4K, "-ngl", "all"]
RPC_FLAGS: dict[str, list[str]] = {
    "ngl-all": ALL,
    "ngl-1": [*C4K, "-ngl", "1"],  # only the output layer
    "ngl-2": [*C4K, "-ngl", "2"],
    "ngl-0-ot-layer0": [*C4K, "-ngl", "0", "-ot", r"blk\.0\.=" + "{rpc}"],
    "ngl-all-cmoe": [*ALL, "-cmoe"],
    "ngl-all-cmoe-nr": [*ALL, "-cmoe", "-nr"],
    "ngl-all-ncmoe1": [*ALL, "-ncmoe", "1"],
    "ngl-all-ot-up-gate1": [*ALL, "-ot", r"blk\.1\.ffn_(up|gate)(_exps)?\.=CPU"],
    "ngl-all-nkvo": [*ALL, "-nkvo"],
    "ngl-all-nkvo-fa-off": [*ALL, "-nkvo", "-fa", "off"],
    "ngl-all-ub128": [*ALL, "-ub", "128"],
    "ngl-all-b4096-ub4096": [*ALL, "-b", "4096", "-ub", "4096"],
    "ngl-all-c512": ["-c", "512", "-ngl", "all"],
    "ngl-all-kv-q8_0-fa-on": [*ALL, "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
    "ngl-all-fa-off": [*ALL, "-fa", "off"],
    "ngl-all-np1": [*ALL, "-np", "1"],
    "ngl-all-np2-no-kvu": [*ALL, "-np", "2", "--no-kv-unified"],
    "ngl-all-swa-full": [*ALL, "--swa-full"],
    "ngl-all-no-mmap": [*ALL, "--no-mmap"],
    "ngl-1-cmoe-ub1024": [*C4K, "-ngl", "1", "-cmoe", "-ub", "1024"],
}
# Several emulated GPUs of unequal caps (`--device rpc2`, `rpc3`): the layer split by free memory, -ts, partial
# offload, pipeline parallelism (every layer offloaded, no override: 4 copies of the scheduler's inputs) and what
# turns it off (-ncmoe, -ot, -nkvo), -ot to a named device, -sm none with -mg. `{rpc0}`, `{rpc1}`, … stand for the
# devices in --rpc order.
MULTI_FLAGS: dict[str, list[str]] = {
    "ngl-all": ALL,
    "ngl-all-ub128-fa-off": [*ALL, "-ub", "128", "-fa", "off"],
    "ngl-all-np2-no-kvu": [*ALL, "-np", "2", "--no-kv-unified"],
    "ngl-all-ts-1-3": [*ALL, "-ts", "1,3"],
    "ngl-3": [*C4K, "-ngl", "3"],
    "ngl-all-ncmoe2": [*ALL, "-ncmoe", "2"],
    "ngl-all-cmoe": [*ALL, "-cmoe"],
    "ngl-all-nkvo": [*ALL, "-nkvo"],
    "ngl-all-ot-layer0-last": [*ALL, "-ot", "blk\\.0\\.={rpclast}"],
    "ngl-all-sm-none": [*ALL, "-sm", "none"],
    "ngl-all-sm-none-mg1": [*ALL, "-sm", "none", "-mg", "1"],
}
MULTI_CAPS_MIB = {"rpc2": (3000, 1500), "rpc3": (3000, 2000, 1000)}  # the split follows free memory: unequal caps
# -sm tensor over two and three emulated GPUs (`--device sm-tensor2`, `sm-tensor3`): llama.cpp logs one Meta() line per
# buffer (the largest device's for model and KV), so each case also records every device's peak bytes (the cap
# shim's counter: its model, KV and compute slices together). -ts 3,1 leaves a third device no share; -fa off is
# refused; a quantized cache is not (docs/multi-gpu.md says it is; the source has no such check).
TENSOR_FLAGS: dict[str, list[str]] = {
    "sm-tensor-ngl-all-c512": ["-c", "512", "-ngl", "all", "-sm", "tensor"],
    "sm-tensor-ngl-all": [*ALL, "-sm", "tensor"],
    "sm-tensor-ngl-all-ts-3-1": [*ALL, "-sm", "tensor", "-ts", "3,1"],
    "sm-tensor-ngl-all-kv-q8_0": [*ALL, "-sm", "tensor", "-ctk", "q8_0", "-ctv", "q8_0"],
    "sm-tensor-ngl-all-ub128": [*ALL, "-sm", "tensor", "-ub", "128"],
    "sm-tensor-ngl-1": [*C4K, "-ngl", "1", "-sm", "tensor"],
    "sm-tensor-ngl-all-fa-off": [*ALL, "-sm", "tensor", "-fa", "off"],
}
TENSOR_CAPS_MIB = {"sm-tensor2": (3000, 1500), "sm-tensor3": (3000, 2000, 1000)}
# qwen3-tiny (Q4_K, 2 KV heads of 64) aborts while its weights are uploaded under -sm tensor ("tensor write out of
# bounds", ggml-backend.cpp ggml_backend_tensor_set) on 2 and 3 devices: a llama.cpp failure fitter does not model
TENSOR_MODELS = tuple(m for m in SMALL_MODELS if m != "qwen3-tiny")
VULKAN_CAP_MIB = 2048  # lavapipe's heap: no case reaches it

# Real shapes on the emulated GPU: dense weights on the device (their holes are read and sent), experts mapped.
REAL_RPC_FLAGS: dict[str, dict[str, list[str]]] = {
    "gpt-oss-20b": {"ngl-all-cmoe-nr-c8192": ["-c", "8192", "-ngl", "all", "-cmoe", "-nr"]},
    "qwen3-30b-a3b": {"ngl-all-ncmoe44-nr-c8192": ["-c", "8192", "-ngl", "all", "-ncmoe", "44", "-nr"]},
}
# CUDA's own rules: op offload (batches of 32+ with CPU weights), flash-attention scratch for quantized caches, the
# host buffer type (--no-mmap), and the switches that turn them off.
CUDA_FLAGS: dict[str, list[str]] = {
    "ngl-all-cmoe-ub2048": [*ALL, "-cmoe", "-ub", "2048"],
    "ngl-all-cmoe-b4096-ub4096": [*ALL, "-cmoe", "-b", "4096", "-ub", "4096"],
    "ngl-all-cmoe-ub128-no-op-offload": [*ALL, "-cmoe", "-ub", "128", "--no-op-offload"],
    "ngl-all-ncmoe1-ub512": [*ALL, "-ncmoe", "1", "-ub", "512"],
    "ngl-all-cmoe-ub16": [*ALL, "-cmoe", "-ub", "16"],  # below the offload batch: nothing copied for prefill
    "ngl-all-cmoe-no-mmap": [*ALL, "-cmoe", "--no-mmap"],
    "ngl-1-no-mmap": [*C4K, "-ngl", "1", "--no-mmap"],
    "c32768-ngl-all-kv-q8_0-fa-on": ["-c", "32768", "-ngl", "all", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
    "c32768-ngl-all-k-q8_0-fa-on-ub2048": ["-c", "32768", "-ngl", "all", "-ctk", "q8_0", "-fa", "on", "-ub", "2048"],
    "c16384-ngl-all-kv-q4_0-fa-auto-np1": ["-c", "16384", "-ngl", "all", "-ctk", "q4_0", "-ctv", "q4_0", "-np", "1"],
    "ngl-all-fa-auto": [*ALL, "-fa", "auto"],
    "ngl-0": [*C4K, "-ngl", "0"],  # nothing offloaded, yet CUDA takes the prompt's big ops: a device compute buffer
    "ngl-0-no-op-offload": [*C4K, "-ngl", "0", "--no-op-offload"],
}
# Vulkan's own rules on Mesa's lavapipe (the emulated Vulkan GPU): its buffer range (128 MiB) keeps a tensor past it
# off the device (a 201k-vocabulary output weight, gpt-oss-20b's expert tensors, a long context's KQ scores without
# flash attention) and aborts the load for a KV cache past it; Vulkan_Host for the host's buffers.
VULKAN_REAL_FLAGS: dict[str, dict[str, list[str]]] = {
    "gpt-oss-20b": {"ngl-all-cmoe-nr-c8192": ["-c", "8192", "-ngl", "all", "-cmoe", "-nr"],
                    "ngl-all-cmoe-nr-c8192-ub2048": ["-c", "8192", "-ngl", "all", "-cmoe", "-nr", "-ub", "2048"],
                    "ngl-all-nr-c8192": ["-c", "8192", "-ngl", "all", "-nr"],
                    "ngl-all-cmoe-nr-c8192-fa-off": ["-c", "8192", "-ngl", "all", "-cmoe", "-nr", "-fa", "off"]},
    # lavapipe's 2 GiB: two layers' experts on the device, at 4096 cells
    "qwen3-30b-a3b": {"ngl-all-ncmoe46-nr-c4096": ["-c", "4096", "-ngl", "all", "-ncmoe", "46", "-nr"],
                      "ngl-all-ncmoe46-nr-c4096-kv-q8_0-fa-on": ["-c", "4096", "-ngl", "all", "-ncmoe", "46", "-nr",
                                                                 "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]},
    # 2 KiB of K per cell and layer: at 98304 cells each layer's K is 192 MiB, past lavapipe's range
    "mixtral-8x7b": {"ngl-8-nr-c4096": ["-c", "4096", "-ngl", "8", "-nr"],
                     "ngl-2-nr-c98304": ["-c", "98304", "-ngl", "2", "-nr"],
                     "ngl-2-nr-c98304-nkvo": ["-c", "98304", "-ngl", "2", "-nr", "-nkvo"]},
}
CUDA_REAL_FLAGS: dict[str, dict[str, list[str]]] = {
    "gpt-oss-20b": {"ngl-all-cmoe-nr-c8192-ub2048": ["-c", "8192", "-ngl", "all", "-cmoe", "-nr", "-ub", "2048"]},
    "qwen3-30b-a3b": {"ngl-all-ncmoe44-nr-c8192-kv-q8_0-fa-on": ["-c", "8192", "-ngl", "all", "-ncmoe", "44", "-nr",
                                                                 "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]},
}
C_API_REAL_RPC_FLAGS: dict[str, dict[str, list[str]]] = {
    "gpt-oss-20b": {"ngl-all-cmoe-nr-c8192-b4096-ub4096": ["-c", "8192", "-ngl", "all", "-cmoe", "-nr", "-b", "4096",
                                                           "-ub", "4096", "-fa", "on"]},
    "qwen3-30b-a3b": {"ngl-all-ncmoe44-nr-c8192-ub2048": ["-c", "8192", "-ngl", "all", "-ncmoe", "44", "-nr",
                                                          "-ub", "2048"]},
}


@dataclass(frozen=True)
class Case:
    id: str
    model: str
    flags: list[str]

    @property
    def held_out(self) -> bool:
        # A fixed rule, independent of order and of which other cases exist: ~1 in 5.
        return zlib.crc32(self.id.encode()) % 5 == 0


def last_experts_flags(model: str) -> list[str]:
    """The experts of a model's last two layers on the CPU as one alternation rule, the rule `fitter tune` writes for
    its last-N expert order on one GPU (fitter.search.split.order_rule); a dense model's rule matches nothing."""
    n = SHAPES[model].n_layer
    return [*ALL, "-ot", rf"blk\.({n - 2}|{n - 1})\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"]


def build_rpc_cases(c_api: bool = False, cuda: bool = False, vulkan: bool = False) -> list[Case]:
    """The emulated GPU's cases; `cuda`: with CUDA's own (op offload, scratch, the host type), which Vulkan shares
    (`vulkan`: with its own, its buffer range)."""
    flag_sets = {**RPC_FLAGS, **(CUDA_FLAGS if cuda or vulkan else {})}
    cases = [Case(f"{m}/{name}", m, flags) for m in SMALL_MODELS for name, flags in flag_sets.items()]
    cases += [Case(f"{m}/ngl-all-ot-experts-last2", m, last_experts_flags(m)) for m in SMALL_MODELS]
    if vulkan:  # lavapipe holds 2 GiB: the real shapes' cases of its own
        real = VULKAN_REAL_FLAGS
    else:
        real = {m: {**sets, **(C_API_REAL_RPC_FLAGS.get(m, {}) if c_api else {}),
                    **(CUDA_REAL_FLAGS.get(m, {}) if cuda else {})} for m, sets in REAL_RPC_FLAGS.items()}
    cases += [Case(f"{m}/{name}", m, flags) for m, sets in real.items() for name, flags in sets.items()]
    return sorted(cases, key=lambda c: c.id)


def build_multi_cases() -> list[Case]:
    return sorted((Case(f"{m}/{name}", m, flags) for m in SMALL_MODELS for name, flags in MULTI_FLAGS.items()),
                  key=lambda c: c.id)


def build_tensor_cases() -> list[Case]:
    return sorted((Case(f"{m}/{name}", m, flags) for m in TENSOR_MODELS for name, flags in TENSOR_FLAGS.items()),
                  key=lambda c: c.id)


def canonical_endpoints(n: int) -> list[str]:
    return [f"127.0.0.1:{50052 + i}" for i in range(n)]


def build_cases(c_api: bool = False) -> list[Case]:
    cases: list[Case] = []
    for model in SMALL_MODELS:
        flag_sets = {**SMALL_FLAGS, **ERROR_FLAGS.get(model, {})}
        cases += [Case(f"{model}/{name}", model, flags) for name, flags in flag_sets.items()]
    for model in REAL_MODELS:
        flag_sets = {**REAL_FLAGS, **(REAL_SWA_FLAGS if SHAPES[model].sliding_window else {}),
                     **(C_API_REAL_FLAGS if c_api else {})}
        cases += [Case(f"{model}/{name}", model, flags) for name, flags in flag_sets.items()]
    return sorted(cases, key=lambda c: c.id)


def write_models(folder: Path, only: set[str] | None = None) -> tuple[dict[str, Path], dict[str, dict[str, Any]]]:
    paths: dict[str, Path] = {}
    meta: dict[str, dict[str, Any]] = {}
    for name in SMALL_MODELS:
        if only is not None and name not in only:
            continue
        paths[name] = write_model(SHAPES[name], folder / f"{name}.gguf")[0]
        meta[name] = {"shape": name, "n_shards": 1, "sparse": False}
    for name, n_shards in REAL_MODELS.items():
        if only is not None and name not in only:
            continue
        paths[name] = write_model(SHAPES[name], folder / f"{name}.gguf", sparse=True, n_shards=n_shards)[0]
        meta[name] = {"shape": name, "n_shards": n_shards, "sparse": True}
    return paths, meta


def run_case(
    case: Case, model_path: Path, folder: Path, endpoint: str | None = None, device_name: str | None = None,
    consumer: str = DEFAULT_CONSUMER, endpoints: list[str] | None = None,
) -> tuple[dict[str, Any], CaptureResult]:
    flags = case.flags
    if endpoints:
        flags = [multi_flag(f, endpoints) for f in flags] + ["--rpc", ",".join(endpoints)]
    elif endpoint is not None:
        flags = [f.replace("{rpc}", f"RPC0[{endpoint}]") for f in flags] + ["--rpc", endpoint]
    elif device_name is not None:  # a real GPU: {rpc} stands for its buffer type
        flags = [f.replace("{rpc}", device_name) for f in flags]
    try:  # llama.cpp's own rules are left to llama.cpp: the golden records what it does
        config = parse_launch_flags(flags, consumer, check=False)
    except LaunchConfigError as e:  # the program has no way to take these flags (llama-bench and -np 2)
        res = CaptureResult(ok=False, log="", buffers=[], error=f"refused: {e}")
    else:
        res = load_and_capture(model_path, config)
    error = None if res.ok else (res.error or "unknown error").replace(str(folder), "<models>")
    if error:  # an abort names the source file where the build was made: only its place in llama.cpp is kept
        error = re.sub(r"\S*/vendor/llama\.cpp/", "", error)
    buffers = [{"buft": b.buft, "kind": b.kind, "mib": b.mib} for b in res.buffers]
    if endpoint is not None:
        for b in buffers:
            b["buft"] = str(b["buft"]).replace(endpoint, CANONICAL_RPC)
        if error:
            error = error.replace(endpoint, CANONICAL_RPC)
    for real, canonical in zip(endpoints or [], canonical_endpoints(len(endpoints or [])), strict=True):
        for b in buffers:
            b["buft"] = str(b["buft"]).replace(real, canonical)
        if error:
            error = error.replace(real, canonical)
    record = {
        "id": case.id,
        "model": case.model,
        "flags": case.flags,
        "held_out": case.held_out,
        "outcome": "ok" if res.ok else "error",
        "error": error,
        "buffers": buffers,
    }
    return record, res


def multi_flag(flag: str, endpoints: list[str]) -> str:
    """A flag of MULTI_FLAGS with `{rpcN}` and `{rpclast}` standing for those devices' buffer types."""
    flag = flag.replace("{rpclast}", f"RPC0[{endpoints[-1]}]")
    for i, e in enumerate(endpoints):
        flag = flag.replace(f"{{rpc{i}}}", f"RPC0[{e}]")
    return flag


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "rpc", "cuda-emulated", "cuda", "vulkan-emulated", *MULTI_CAPS_MIB,
                                                 *TENSOR_CAPS_MIB),
                    default="cpu")
    ap.add_argument("--for", dest="consumer", choices=CONSUMER_NAMES, default=DEFAULT_CONSUMER,
                    help="the program whose defaults and memory rules the loads follow (default llama-server)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default tests/golden/<device>.json, or <device>.<program>.json for another program")
    ap.add_argument("--jobs", type=int, default=2, help="parallel loads of the small models (default 2)")
    ap.add_argument("--models", default=None, metavar="A,B,...",
                    help="only these models (e.g. a subset that fits a borrowed GPU's minutes); default: all")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    info = llama_cpp_info()
    suffix = "" if args.consumer == DEFAULT_CONSUMER else f".{args.consumer}"
    out: Path = args.out or DEFAULT_OUT.with_name(f"{args.device}{suffix}.json")
    c_api = not consumer(args.consumer).outputs_per_slot
    multi_caps = {**MULTI_CAPS_MIB, **TENSOR_CAPS_MIB}
    if args.device in MULTI_CAPS_MIB:
        cases = build_multi_cases()
    elif args.device in TENSOR_CAPS_MIB:
        cases = build_tensor_cases()
    else:
        cases = build_cases(c_api) if args.device == "cpu" else build_rpc_cases(
            c_api, args.device.startswith("cuda"), args.device == "vulkan-emulated")
    only = set(args.models.split(",")) if args.models else None
    if only is None and args.device in TENSOR_CAPS_MIB:
        only = set(TENSOR_MODELS)
    if only is not None:
        unknown = only - set(SMALL_MODELS) - set(REAL_MODELS)
        if unknown:
            ap.error(f"--models: unknown {', '.join(sorted(unknown))}; choose from "
                     f"{', '.join((*SMALL_MODELS, *REAL_MODELS))}")
        cases = [c for c in cases if c.model in only]
    gpu = None
    device_name = None
    if args.device == "cuda":
        from fitter.errors import FitterError
        from fitter.machine.llama_cpp import require_gpu_build

        try:
            require_gpu_build()
        except FitterError as e:
            print(f"make_goldens: {e}", file=sys.stderr)
            return 2
        device_name = "CUDA0"
        args.jobs = 1
    vulkan = None
    if args.device == "vulkan-emulated":
        from fitter.measure.emulator.emulated_vulkan import EmulatedVulkanGpus

        # lavapipe's whole heap: only sizes are recorded (and the loads run on the Vulkan build's libraries)
        vulkan = EmulatedVulkanGpus((VULKAN_CAP_MIB,)).start()
        device_name = "Vulkan0"
        info = llama_cpp_info()  # the Vulkan build's own system info
    if args.device in ("rpc", "cuda-emulated"):
        from fitter.measure.emulator.emulated_gpu import EmulatedGpu

        # big enough never to refuse: only sizes are recorded
        gpu = EmulatedGpu(cap_mib=20000, cuda=args.device == "cuda-emulated").start()
        args.jobs = 1  # one server: loads go one after another
    endpoint = gpu.endpoint if gpu is not None else None
    gpus = None
    if args.device in multi_caps:
        from fitter.measure.emulator.emulated_gpu import EmulatedGpus

        gpus = EmulatedGpus(multi_caps[args.device]).start()  # caps no case reaches: only sizes are recorded
        args.jobs = 1
    endpoints = list(gpus.endpoints) if gpus is not None else None
    records: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="fitter-goldens-") as tmp:
        folder = Path(tmp)
        paths, models = write_models(folder, only)
        print(f"wrote {len(paths)} models in {time.perf_counter() - t0:.1f} s; {len(cases)} cases", file=sys.stderr)
        done = 0

        def report(record: dict[str, Any], res: CaptureResult) -> None:
            nonlocal done
            done += 1
            records[record["id"]] = record
            status = "ok" if res.ok else f"ERROR {record['error'][:120]}"
            print(f"[{done:3d}/{len(cases)}] {record['id']:<42} {res.seconds:6.2f} s  {status}", file=sys.stderr)

        small = [c for c in cases if c.model not in REAL_MODELS]
        real = [c for c in cases if c.model in REAL_MODELS]
        if args.device in TENSOR_CAPS_MIB and gpus is not None:
            for case in small:  # one at a time, each device's peak from a reset
                gpus.wait_until_empty()
                gpus.reset_peak()
                record, res = run_case(case, paths[case.model], folder, endpoint, device_name, args.consumer,
                                       endpoints)
                peaks = gpus.peaks()
                record["device_peak_bytes"] = [peaks[g.device_name] for g in gpus.gpus]
                report(record, res)
            small = []
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for record, res in pool.map(
                    lambda c: run_case(c, paths[c.model], folder, endpoint, device_name, args.consumer, endpoints),
                    small):
                report(record, res)
        for case in real:  # one at a time: each maps tens of GB of file holes
            report(*run_case(case, paths[case.model], folder, endpoint, device_name, args.consumer))
    if gpu is not None:
        gpu.stop()
    if gpus is not None:
        gpus.stop()

    golden: dict[str, Any] = {
        "generated_by": "scripts/make_goldens.py" + (f" --for {args.consumer}" if suffix else ""),
        "for": args.consumer,
        "llama_cpp": {"version": info["version"], "system_info": info["system_info"]},
        "models": dict(sorted(models.items())),
        "cases": [records[c.id] for c in cases],
    }
    if args.device in ("rpc", "cuda-emulated"):
        golden["device"] = {"kind": args.device, "endpoint": CANONICAL_RPC, "emulated": True}
    if args.device in multi_caps:
        caps = multi_caps[args.device]
        golden["device"] = {"kind": "rpc-multi", "endpoints": canonical_endpoints(len(caps)), "caps_mib": list(caps),
                            "emulated": True}
    if vulkan is not None:
        from fitter.machine.vulkan import vulkan_devices

        lavapipe = next((d for d in vulkan_devices() or () if d.device_type == "cpu"), None)
        golden["device"] = {"kind": "vulkan-emulated", "name": "Vulkan0", "cap_mib": VULKAN_CAP_MIB, "emulated": True,
                            "driver": lavapipe.name if lavapipe else None,
                            "limits": dataclasses.asdict(lavapipe.limits()) if lavapipe else None}
        vulkan.stop()
    if args.device == "cuda":
        from fitter.machine.nvidia import detect_nvidia

        gpus, nvidia = detect_nvidia()
        free = gpus[0].memory_free if gpus else None
        golden["device"] = {"kind": "cuda", "name": "CUDA0", "free_mib": free // 2**20 if free else None,
                            "gpu": gpus[0].name if gpus else None, "driver": nvidia.driver,
                            "compute_capability": list(gpus[0].compute_capability or ()) if gpus else None}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    n_err = sum(r["outcome"] == "error" for r in golden["cases"])
    n_held = sum(r["held_out"] for r in golden["cases"])
    print(
        f"{len(cases)} cases ({len(cases) - n_err} ok, {n_err} error, {n_held} held out) "
        f"in {time.perf_counter() - t0:.1f} s -> {out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
