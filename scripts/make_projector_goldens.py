#!/usr/bin/env python
"""Write tests/golden/mmproj-<device>.json: what llama-server allocates for a model with a vision projector
(`--mmproj`), from its own log and, on an emulated GPU, the device's peak.

Each case starts the pinned llama-server (fitter.measure.server start_server, `-lv 5`, `-fit on` so that it runs
libmtmd's memory probe first) until it answers /health and records:
- `buffers`: the model's buffer lines (model, KV, compute, output), as every golden file has them;
- `mmproj_compute`: clip's last warm-up reservation (tools/mtmd/clip.cpp `reserve_compute_meta`: one line per
  backend whose buffer is over a byte; with `-fa auto` a second reservation when the device cannot run flash
  attention), `mmproj_backend` (its `CLIP using … backend` line), `mmproj_flash_attn`, `mmproj_nodes`;
- `mmproj_probe`: the probe's bytes per device (tools/server/server-context.cpp: "[mtmd] adding X MiB to
  fit_params_target for device D": the weights' unpadded bytes plus that device's compute buffer);
- `peaks` (emulated GPUs): the device's peak bytes while serving, every buffer on it (the projector's weights
  included, which no log line gives).

Models are fitter's small models (fitter.gguf.demo_models), projectors fitter.gguf.demo_projectors' made for each
model's width. `--device rpc`: fitter's emulated GPU (RPC, big enough never to refuse), recorded under the canonical
RPC0[127.0.0.1:50052]; `--device cuda-emulated`: the CUDA-shaped emulated GPU, whose client rules (op support and
offload, the host buffer type) live in fitter's own loader (fitter.measure.loader, llama-cpp-python's libmtmd: no
--fit probe there); `--device vulkan-emulated`: lavapipe through the Vulkan build's llama-server, capped by capdev's
client mode.

    python scripts/make_projector_goldens.py [--device cpu|rpc|vulkan-emulated] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fitter import process
from fitter.flags import parse_launch_flags
from fitter.gguf.demo_models import SHAPES, write_model
from fitter.gguf.demo_projectors import PROJECTORS, write_projector
from fitter.measure.llamacpp.builds import server_build
from fitter.measure.llamacpp.tools import ensure_tools
from fitter.measure.loader import load_and_capture
from fitter.measure.logs import parse_buffer_lines
from fitter.measure.server import start_server

REPO = Path(__file__).resolve().parent.parent
CANONICAL_RPC = "127.0.0.1:50052"
VULKAN_CAP_MIB = 2048

PAIRS = {  # id -> (model, projector)
    "llama+gemma3": ("llama-tiny", "gemma3-l2"),
    "llama+gemma3-448": ("llama-tiny", "gemma3-l4-448"),
    "llama+mlp": ("llama-tiny", "mlp-l3"),
    "llama+gemma3-d48": ("llama-tiny", "gemma3-d48"),
    "llama+qwen2vl": ("llama-tiny", "qwen2vl-l2"),
    "llama+qwen25vl": ("llama-tiny", "qwen25vl-l2"),
    "llama+qwen3vl": ("llama-tiny", "qwen3vl-l2"),
    "llama+pixtral": ("llama-tiny", "pixtral-l2"),
    "llama+pixtral12b": ("llama-tiny", "pixtral12b-l2"),
    "llama+llama4": ("llama-tiny", "llama4-l2"),
    "llama+glm4v": ("llama-tiny", "glm4v-l2"),
    "demo+gemma3-448": ("demo", "gemma3-l4-448"),
}
C1K = ["-c", "1024"]
CPU_FLAGS: dict[str, list[str]] = {
    "c1024": C1K,
    "c1024-fa-on": [*C1K, "-fa", "on"],
    "c1024-fa-off": [*C1K, "-fa", "off"],
}
GPU_FLAGS: dict[str, list[str]] = {
    "ngl-all": [*C1K, "-ngl", "all"],
    "ngl-all-fa-off": [*C1K, "-ngl", "all", "-fa", "off"],
    "ngl-0": [*C1K, "-ngl", "0"],  # the model on the CPU, the projector still on the GPU
    "ngl-all-no-mmproj-offload": [*C1K, "-ngl", "all", "--no-mmproj-offload"],
    "ngl-all-mmdev-none": [*C1K, "-ngl", "all", "-mmdev", "none"],
}

_RESERVE_RE = re.compile(r"reserve_compute_meta: +(?P<buft>\S+) compute buffer size = +(?P<mib>[\d.]+) MiB")
_SPLITS_RE = re.compile(r"reserve_compute_meta: graph splits = (?P<splits>\d+), nodes = (?P<nodes>\d+)")
_BACKEND_RE = re.compile(r"clip_ctx: CLIP using (?P<name>\S+) backend")
_FA_RE = re.compile(r"warmup: flash attention is (?P<state>enabled|disabled)")
_PROBE_RE = re.compile(r"\[mtmd\] adding (?P<mib>[\d.]+) MiB to fit_params_target for device (?P<dev>\S+)")
_PROJECTOR_LINE = "clip_model_loader:"  # the projector's load starts: the model's lines come before it
_FIT_DONE = "common_fit_params: fitting params to free memory took"  # common/fit.cpp: the dry runs are over


def cases(device: str) -> list[dict[str, Any]]:
    flags = CPU_FLAGS if device == "cpu" else GPU_FLAGS
    return [{"id": f"{pair}/{fid}", "model": model, "projector": proj, "flags": fl}
            for pair, (model, proj) in PAIRS.items() for fid, fl in flags.items()]


def mmproj_record(log: str) -> dict[str, Any]:
    """The projector's lines: its last reservation's buffers, backend, flash attention and node count."""
    blocks: list[list[dict[str, Any]]] = [[]]
    nodes = None
    for line in log.splitlines():
        if (m := _RESERVE_RE.search(line)) is not None:
            blocks[-1].append({"buft": m.group("buft"), "mib": float(m.group("mib"))})
        elif (m := _SPLITS_RE.search(line)) is not None:
            nodes = int(m.group("nodes"))
            blocks.append([])
    done = [b for b in blocks[:-1]]
    backend = _BACKEND_RE.search(log)
    fa = _FA_RE.search(log)
    return {
        "mmproj_compute": done[-1] if done else [],
        "mmproj_reservations": len(done),
        "mmproj_backend": backend.group("name") if backend else None,
        "mmproj_flash_attn": fa.group("state") == "enabled" if fa else None,
        "mmproj_nodes": nodes,
    }


def run(case: dict[str, Any], paths: dict[str, Path], binary: str, endpoint: str | None, folder: Path,
        peaks: Any, in_process: bool = False) -> dict[str, Any]:
    flags = [*case["flags"], "--mmproj", str(paths[case["projector"] + "@" + case["model"]])]
    if endpoint:
        flags += ["--rpc", endpoint]
    t0 = time.perf_counter()
    if peaks is not None:
        peaks.reset()
    if in_process:  # fitter's loader: the CUDA-shaped GPU's client rules apply in its process only (no probe)
        res = load_and_capture(paths[case["model"]], parse_launch_flags([*flags, "-fit", "off"]))
        log, problem = res.log, None if res.ok else (res.error or "failed")
        measured = peaks.read() if peaks is not None and res.ok else {}
    else:
        log, problem, measured = _served(binary, paths[case["model"]], [*flags, "-t", "2", "-lv", "5", "-fit", "on"],
                                         folder / "server.log", t0, peaks)
    record: dict[str, Any] = {**case, "outcome": "ok" if problem is None else "error", "error": None}
    if problem is not None:
        record["error"] = (problem + ": " + log[-600:]).replace(str(folder), "<models>")
    head, sep, tail = log.partition(_PROJECTOR_LINE)
    # the model's load after --fit's dry runs (common/fit.cpp loads it without allocating: buffers of 0 MiB)
    loaded = head.rpartition(_FIT_DONE)[2]
    buffers = [{"buft": b.buft, "kind": b.kind, "mib": b.mib} for b in parse_buffer_lines(loaded)]
    record.update(buffers=buffers, **mmproj_record(sep + tail), peaks=measured)
    # the probe runs before the model loads (its clip lines go to a stub logger)
    record["mmproj_probe"] = {m.group("dev"): float(m.group("mib")) for m in _PROBE_RE.finditer(head)}
    text = json.dumps(record)
    if endpoint:
        text = text.replace(endpoint, CANONICAL_RPC)
    print(f"{case['id']:<48} {time.perf_counter() - t0:5.1f} s  {record['outcome']}", file=sys.stderr)
    return json.loads(text)  # type: ignore[no-any-return]


def _served(binary: str, model: Path, flags: list[str], log_path: Path, t0: float,
            peaks: Any) -> tuple[str, str | None, dict[str, int]]:
    proc, _, problem = start_server(binary, str(model), flags, log_path, t0 + 180)
    try:
        log = log_path.read_text(errors="replace")
        measured = peaks.read() if peaks is not None and problem is None else {}
    finally:
        process.stop(proc)
    return log, problem, measured


class _RpcPeaks:
    def __init__(self, gpu: Any) -> None:
        self.gpu = gpu

    def reset(self) -> None:
        """Restart the peak once the previous server's buffers are gone (as fitter.measure.emulator.emulated_gpu
        EmulatedGpus.wait_until_empty: ggml-rpc's frees reach the server after the client has exited, and a reset
        met before them counts the previous case's buffers in this one's peak)."""
        deadline = time.monotonic() + 10.0
        while self.gpu.stats().used_bytes and time.monotonic() < deadline:
            time.sleep(0.005)
        self.gpu.reset_peak()

    def read(self) -> dict[str, int]:
        return {f"RPC0[{self.gpu.endpoint}]": self.gpu.stats().peak_bytes}


class _VulkanPeaks:
    def __init__(self, gpus: Any) -> None:
        self.gpus = gpus

    def reset(self) -> None:
        self.gpus.reset_peak()

    def read(self) -> dict[str, int]:
        return dict(self.gpus.peaks())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "rpc", "cuda-emulated", "vulkan-emulated"), default="cpu")
    ap.add_argument("--out", type=Path, default=None, help="default tests/golden/mmproj-<device>.json")
    args = ap.parse_args(argv)
    out: Path = args.out or REPO / "tests" / "golden" / f"mmproj-{args.device}.json"
    gpu = vulkan = peaks = None
    endpoint = None
    binary = str(ensure_tools(["llama-server"])["llama-server"])
    if args.device in ("rpc", "cuda-emulated"):
        from fitter.measure.emulator.emulated_gpu import EmulatedGpu

        # big enough never to refuse: sizes are recorded
        gpu = EmulatedGpu(cap_mib=20000, cuda=args.device == "cuda-emulated").start()
        endpoint, peaks = gpu.endpoint, _RpcPeaks(gpu)
    elif args.device == "vulkan-emulated":
        from fitter.measure.emulator.emulated_vulkan import EmulatedVulkanGpus

        vulkan = EmulatedVulkanGpus((VULKAN_CAP_MIB,)).start()
        binary = str(vulkan.lib_dir / "llama-server")
        peaks = _VulkanPeaks(vulkan)
    try:
        with tempfile.TemporaryDirectory(prefix="fitter-mmproj-goldens-") as tmp:
            folder = Path(tmp)
            paths: dict[str, Path] = {}
            for model, proj in PAIRS.values():
                if model not in paths:
                    paths[model] = write_model(SHAPES[model], folder / f"{model}.gguf")[0]
                key = f"{proj}@{model}"
                if key not in paths:
                    paths[key] = write_projector(PROJECTORS[proj], SHAPES[model].n_embd, folder / f"{key}.gguf")
            records = [run(c, paths, binary, endpoint, folder, peaks, args.device == "cuda-emulated")
                       for c in cases(args.device)]
    finally:
        if gpu is not None:
            gpu.stop()
        if vulkan is not None:
            vulkan.stop()
    device: dict[str, Any] | None = {"kind": args.device, "endpoint": CANONICAL_RPC, "emulated": True} if \
        args.device in ("rpc", "cuda-emulated") else None
    if args.device == "vulkan-emulated":  # lavapipe's limits, as the estimate of these runs must read them
        from fitter.machine.vulkan import vulkan_devices

        lavapipe = next((d for d in vulkan_devices() or () if d.device_type == "cpu"), None)
        device = {"kind": "vulkan-emulated", "name": "Vulkan0", "cap_mib": VULKAN_CAP_MIB, "emulated": True,
                  "driver": lavapipe.name if lavapipe else None,
                  "limits": dataclasses.asdict(lavapipe.limits()) if lavapipe else None}
    golden: dict[str, Any] = {
        "generated_by": "scripts/make_projector_goldens.py" + (f" --device {args.device}" if args.device != "cpu"
                                                               else ""),
        "llama_cpp": server_build(binary),
        "device": device,
        "projectors": {name: vars(shape) for name, shape in PROJECTORS.items()},
        "cases": records,
    }
    out.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    n_err = sum(r["outcome"] != "ok" for r in records)
    print(f"{len(records)} cases ({n_err} error) -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
