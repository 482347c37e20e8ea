#!/usr/bin/env python
"""Write tests/golden/draft.json (or draft-rpc.json): the buffers llama-server logs for a model with a draft model.

llama-cpp-python loads no draft, so these loads run the pinned llama-server itself (fitter.measure.server
start_server, `-lv 4`), each until it answers /health, and split its log at llama.cpp's
`common_speculative_init_result: loading draft model` line (common/speculative.cpp): the buffers before it are the
model's, after it the draft's. `--device rpc`: with fitter's emulated GPU (big enough never to refuse), recorded
under the canonical name RPC0[127.0.0.1:50052] whatever port the run used; `{rpc}` in a flag list stands for it.

Pairs are fitter's small models (fitter.gguf.demo_models) whose vocabularies match (all the tiny ones have the same
512 tokens), so `--spec-type draft-simple` starts too; the demo model (2048 tokens) only loads a draft that drafts
nothing. Flag lists cover what changes the draft's memory: the context and slots it follows, its cache types, the
target's extra logits per drafted token, `-ngld` and the draft's expert overrides on a device.

    python scripts/make_draft_goldens.py [--device cpu|rpc] [--out tests/golden/draft.json]

Deterministic: the same llama.cpp build gives the same file (cases in order, buffers in log order).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fitter import process
from fitter.gguf.demo_models import SHAPES, write_model
from fitter.measure.llamacpp.builds import server_build
from fitter.measure.llamacpp.tools import ensure_tools
from fitter.measure.logs import parse_buffer_lines
from fitter.measure.server import start_server

REPO = Path(__file__).resolve().parent.parent
CANONICAL_RPC = "127.0.0.1:50052"


def canonical_endpoints(n: int) -> list[str]:
    """The names several emulated GPUs are recorded under, whatever ports a run used (scripts/make_goldens.py's)."""
    return [f"127.0.0.1:{50052 + i}" for i in range(n)]

DRAFT_LINE = "loading draft model"  # common/speculative.cpp common_speculative_init_result
# the context parameters llama_context logs (src/llama-context.cpp, the constructor's "%s: n_ctx = %u" lines)
CONTEXT_KEYS = ("n_seq_max", "n_ctx", "n_ctx_seq", "n_batch", "n_ubatch", "n_outputs_max")
_CONTEXT_RE = re.compile(r"llama_context: (" + "|".join(CONTEXT_KEYS) + r")\s+= (\d+)")

PAIRS = {  # id -> (model, draft)
    "qwen3+llama": ("qwen3-tiny", "llama-tiny"),
    "llama+qwen3moe": ("llama-tiny", "qwen3moe-tiny"),
    "qwen3moe+gpt-oss": ("qwen3moe-tiny", "gpt-oss-tiny"),
    "demo+llama": ("demo", "llama-tiny"),
}
SPEC = ["--spec-type", "draft-simple"]
CPU_FLAGS: dict[str, list[str]] = {
    "c1024": ["-c", "1024"],
    "c1024-np2": ["-c", "1024", "-np", "2"],
    "c3072-np3-no-kvu": ["-c", "3072", "-np", "3", "--no-kv-unified"],
    "c1024-ctkd-q8_0-fa-on": ["-c", "1024", "-ctkd", "q8_0", "-ctvd", "q8_0", "-fa", "on"],
    "c1024-ctk-q8_0-fa-on": ["-c", "1024", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],  # the draft's stay f16
    "c2048-ub128": ["-c", "2048", "-ub", "128"],
    "c1024-fa-off": ["-c", "1024", "-fa", "off"],
    "c1024-spec": ["-c", "1024", *SPEC],
    "c2048-np2-spec-nmax16": ["-c", "2048", "-np", "2", *SPEC, "--spec-draft-n-max", "16"],
    "c1024-b8-spec": ["-c", "1024", "-b", "8", "-ub", "8", *SPEC],  # the target's outputs clamp to -b
}
RPC_FLAGS: dict[str, list[str]] = {
    "ngl-all": ["-c", "1024", "-ngl", "all"],
    "ngl-all-ngld0": ["-c", "1024", "-ngl", "all", "-ngld", "0"],
    "ngl-all-ngld2": ["-c", "1024", "-ngl", "all", "-ngld", "2"],
    "ngl0-ngld-all": ["-c", "1024", "-ngl", "0", "-ngld", "all"],
    "ngl-all-spec": ["-c", "1024", "-ngl", "all", *SPEC],
    "ngl-all-cmoed": ["-c", "1024", "-ngl", "all", "-cmoed"],
    "ngl-all-ncmoed1": ["-c", "1024", "-ngl", "all", "-ncmoed", "1"],
    "ngl-all-otd": ["-c", "1024", "-ngl", "all", "-otd", r"blk\.1\.ffn_down_exps=CPU"],
    "ngl-all-ncmoe2-np2": ["-c", "2048", "-ngl", "all", "-ncmoe", "2", "-np", "2"],  # the model's rule
}
# Two emulated GPUs of equal caps: the model's layers split 1:1 by free memory, and fill the first more (5 of the
# demo's 8 layers, the second holds the output layer), so the draft, loaded after, splits by what each has left,
# not by their caps (src/llama-model.cpp reads ggml_backend_dev_memory when a model loads)
RPC2_CAPS_MIB = (96, 96)
RPC2_PAIRS = {"demo+gpt-oss": ("demo", "gpt-oss-tiny")}
RPC2_FLAGS: dict[str, list[str]] = {
    "ngl-all": ["-c", "1024", "-ngl", "all", "-fa", "on"],
    "ngl-all-ngld2": ["-c", "1024", "-ngl", "all", "-fa", "on", "-ngld", "2"],
    "ngl-all-ts1,1": ["-c", "1024", "-ngl", "all", "-fa", "on", "-ts", "1,1"],  # the draft takes the model's -ts
}
MOE_ONLY = ("cmoed", "ncmoed1", "otd")  # flag ids that need an MoE draft
# vocabularies too far apart for draft-simple (2048 vs 512): the pair loads a draft that drafts nothing
NO_SPEC = ("demo+llama",)


def cases(device: str) -> list[dict[str, Any]]:
    flags = {"rpc": RPC_FLAGS, "rpc2": RPC2_FLAGS}.get(device, CPU_FLAGS)
    out = []
    for pair, (model, draft) in (RPC2_PAIRS if device == "rpc2" else PAIRS).items():
        for fid, fl in flags.items():
            if pair in NO_SPEC and "--spec-type" in fl:
                continue
            if fid.endswith(MOE_ONLY) and not SHAPES[draft].n_expert:
                continue
            out.append({"id": f"{pair}/{fid}", "model": model, "draft": draft, "flags": fl})
    return out


def run(case: dict[str, Any], paths: dict[str, Path], binary: str, endpoints: list[str], folder: Path
        ) -> dict[str, Any]:
    endpoint = endpoints[0] if endpoints else None
    flags = [f.replace("{rpc}", f"RPC0[{endpoint}]") for f in case["flags"]]
    flags += ["-md", str(paths[case["draft"]]), "-t", "2", "-fit", "off"]  # the placement as given
    if endpoints:
        flags += ["--rpc", ",".join(endpoints)]
    log_path = folder / "server.log"
    t0 = time.perf_counter()
    proc, _, problem = start_server(binary, str(paths[case["model"]]), flags, log_path, t0 + 120)
    try:
        log = log_path.read_text(errors="replace")
    finally:
        process.stop(proc)
    record: dict[str, Any] = {**case, "outcome": "ok" if problem is None else "error", "error": None}
    if problem is not None:
        record["error"] = (problem + ": " + log[-600:]).replace(str(folder), "<models>")
    head, sep, tail = log.partition(DRAFT_LINE)
    for key, part in (("buffers", head), ("draft_buffers", tail if sep else "")):
        record[key.replace("buffers", "context")] = {m.group(1): int(m.group(2)) for m in _CONTEXT_RE.finditer(part)}
        buffers = [{"buft": b.buft, "kind": b.kind, "mib": b.mib} for b in parse_buffer_lines(part)]
        for real, canonical in zip(endpoints, canonical_endpoints(len(endpoints)), strict=True):
            for b in buffers:
                b["buft"] = str(b["buft"]).replace(real, canonical)
        record[key] = buffers
    print(f"{case['id']:<40} {time.perf_counter() - t0:5.1f} s  {record['outcome']}", file=sys.stderr)
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "rpc", "rpc2"), default="cpu")
    ap.add_argument("--out", type=Path, default=None,
                    help="default tests/golden/draft.json (draft-rpc.json, draft-rpc2.json)")
    args = ap.parse_args(argv)
    out: Path = args.out or REPO / "tests" / "golden" / (
        "draft.json" if args.device == "cpu" else f"draft-{args.device}.json")
    binary = str(ensure_tools(["llama-server"])["llama-server"])
    gpus = None
    if args.device != "cpu":
        from fitter.measure.emulator.emulated_gpu import EmulatedGpus

        # rpc: big enough never to refuse; rpc2: caps the split follows
        gpus = EmulatedGpus(RPC2_CAPS_MIB if args.device == "rpc2" else (20000,)).start()
    endpoints = list(gpus.endpoints) if gpus is not None else []
    todo = cases(args.device)
    with tempfile.TemporaryDirectory(prefix="fitter-draft-goldens-") as tmp:
        folder = Path(tmp)
        names = {name for pair in (*PAIRS.values(), *RPC2_PAIRS.values()) for name in pair}
        paths = {name: write_model(SHAPES[name], folder / f"{name}.gguf")[0] for name in sorted(names)}
        records = [run(c, paths, binary, endpoints, folder) for c in todo]
    if gpus is not None:
        gpus.stop()
    golden: dict[str, Any] = {
        "generated_by": "scripts/make_draft_goldens.py" + (f" --device {args.device}" if endpoints else ""),
        "llama_cpp": server_build(binary),
        "cases": records,
    }
    if args.device == "rpc":
        golden["device"] = {"kind": "rpc", "endpoint": CANONICAL_RPC, "emulated": True}
    elif args.device == "rpc2":
        golden["device"] = {"kind": "rpc-multi", "endpoints": canonical_endpoints(len(endpoints)),
                            "caps_mib": list(RPC2_CAPS_MIB), "emulated": True}
    out.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    n_err = sum(r["outcome"] != "ok" for r in records)
    print(f"{len(records)} cases ({n_err} error) -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
