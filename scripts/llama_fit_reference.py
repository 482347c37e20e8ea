#!/usr/bin/env python
"""Write tests/golden/fit_reference.json: what llama.cpp's own `--fit` chooses on a capped (emulated) GPU.

For a matrix of (model, device cap, fit target, context/flags), this runs llama.cpp's `llama-fit-params` (the tool
form of `--fit`: common/fit.cpp `common_fit_params`, which prints the fitted CLI args; run through
`fitter.measure.llamacpp.fit_params.run_llama_fit`, as `fitter tune` runs it for its baseline) against fitter's
emulated GPU (`fitter.measure.emulator.emulated_gpu.EmulatedGpu`: an RPC device whose advertised free memory is the cap
and which refuses allocations past it), then loads llama.cpp's chosen placement on the same capped device through
`fitter.measure.loader.load_and_capture` and records the buffers it logged and the device memory it really used
(the cap's peak counter). `fitter fit` is compared against this file.

The tool is built once by `fitter.measure.llamacpp.tools` from the llama.cpp source vendored in llama-cpp-python 0.3.36
(the version fitter pins; `--llama-src DIR` names a llama.cpp tree instead) and cached with llama-server,
llama-bench and their shared libraries in `fitter_home()/tools/llama.cpp-0.3.36-0c1e570-<recipe hash>/`, so later
runs skip the build.

A run of the 56 cases takes ~13 minutes after the build on a 2-core machine (759 s), ~8 of them loading the four
real-shape placements of 3.4-5.1 GiB into the emulated GPU(s) (60-110 s each, for its two loads); placements
projected over 6 GiB in all are fitted but not loaded (`load_skipped` says so). `--only SUBSTRING` runs a subset
(`--only +`: the 13 cases on two or three devices, ~4.5 minutes).

Semantics to know when comparing (llama.cpp 0c1e570):
- llama-fit-params parses args as its own example (LLAMA_EXAMPLE_FIT_PARAMS), not as llama-server: `-np` defaults
  to 1, `-kvu` does not exist (KV never unified), and n_outputs_max stays 0 (= n_batch: logits for a full ubatch
  in the compute graph). Every case therefore pins `-np`, and the load reproduces the context the fit projected
  (`load_and_capture(..., n_outputs_max=0)`); llama-server itself reserves only min(-b, slots) outputs.
- `-c 0` given explicitly disables fit's context reduction unless `-fitc` follows it (common/arg.cpp); the fit
  command puts the case's flags first and `-fitc` last.
- With one device, fit only ever overflows tensors to `CPU`; with two or more, a device's partial layer may
  overflow to the next device's buffer type (`RPC0[127.0.0.1:PORT]`).
- `-fitt` takes one value for every device or one per device (common/arg.cpp `MiB0,MiB1,...`): a case's
  `fit_target_mib` is a number or a list, as fitter's `fit` takes a tuple of targets.
- The RPC endpoints are normalized to 127.0.0.1:50052, :50053, :50054, … (CANONICAL_PORTS, the case's devices in
  order) in args, logs and buffers.

    python scripts/llama_fit_reference.py [--llama-src DIR] [--out tests/golden/fit_reference.json]
                                          [--only SUBSTRING] [--rebuild] [--build-only]

Deterministic: the same llama.cpp build gives the same file (cases in a fixed order; buffers sorted by kind, then
buffer type, in log order among equals).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitter.flags import parse_launch_flags
from fitter.gguf.demo_models import SHAPES, write_model
from fitter.measure.emulator.emulated_gpu import EmulatedGpu
from fitter.measure.llamacpp.fit_params import TOOL, LlamaFitError, parse_projected_mib, run_llama_fit
from fitter.measure.llamacpp.tools import CMAKE_ARGS, LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON, ensure_tools
from fitter.measure.loader import llama_cpp_info, load_and_capture
from fitter.units import MIB

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "golden" / "fit_reference.json"

CANONICAL_PORTS = (50052, 50053, 50054, 50055)  # endpoint i of a case is written as 127.0.0.1:CANONICAL_PORTS[i]
LOAD_LIMIT_BYTES = 6 * 1024 * MIB  # device-resident bytes above which a load is skipped (copied into the server)
FIT_TIMEOUT_S = 600.0
TOOK_RE = re.compile(r"fitting params to free memory took [0-9.]+ seconds")


# ---------------------------------------------------------------------------------------------------------------
# The cases


@dataclass(frozen=True)
class Case:
    id: str
    model: str
    caps_mib: tuple[int, ...]  # one capped device per entry
    fit_target_mib: int | tuple[int, ...]  # -fitt: one value broadcast to every device, or one per device
    flags: tuple[str, ...]  # the case's own llama.cpp flags, given to both the fit and the load
    fit_ctx_min: int | None = None  # -fitc (only matters with -c 0)

    @property
    def targets(self) -> tuple[int, ...]:
        return self.fit_target_mib if isinstance(self.fit_target_mib, tuple) else (self.fit_target_mib,)


# Small models: real files. Real shapes: header-only sparse files (fit reads headers only; loads map file holes).
SMALL_MODELS = ("demo", "gpt-oss-tiny", "qwen3moe-tiny")
REAL_MODELS = ("gpt-oss-20b", "qwen3-30b-a3b")


def build_cases() -> list[Case]:
    cases: list[Case] = []
    np1 = ("-np", "1")  # llama-fit-params' default; pinned so the load (llama-server flags) means the same
    # The demo model (8 layers, ~91 MiB, mostly MXFP4 experts): caps below the model, targets that matter.
    for cap in (48, 64, 96, 128):
        for target in (0, 8, 16):
            for ctx in (4096, 8192):
                cases.append(Case(f"demo/cap{cap}/fitt{target}/c{ctx}", "demo", (cap,), target, ("-c", str(ctx), *np1)))
    # -c 0: fit may shrink the context (down to -fitc) before it moves layers. An explicit `-c 0` sets -fitc to
    # "no reduction" unless a -fitc follows it (common/arg.cpp); without -c, -fitc defaults to 4096.
    for cap, target in ((48, 8), (64, 8), (128, 16)):
        cases.append(Case(f"demo/cap{cap}/fitt{target}/c0-fitc2048", "demo", (cap,), target, ("-c", "0", *np1), 2048))
    cases.append(Case("demo/cap64/fitt8/c0", "demo", (64,), 8, ("-c", "0", *np1)))
    cases.append(Case("demo/cap64/fitt8/c-unset", "demo", (64,), 8, np1))
    # Flags fit never tunes but which change what it projects.
    variants = {
        "c8192-ub128": ("-c", "8192", "-ub", "128", *np1),
        "c8192-b4096-ub2048": ("-c", "8192", "-b", "4096", "-ub", "2048", *np1),
        "c8192-kv-q8_0-fa-on": ("-c", "8192", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", *np1),
        "c8192-fa-off": ("-c", "8192", "-fa", "off", *np1),
        "c8192-np4": ("-c", "8192", "-np", "4"),  # 4 separate streams in both (llama-fit-params has no -kvu)
    }
    for name, flags in variants.items():
        cases.append(Case(f"demo/cap64/fitt8/{name}", "demo", (64,), 8, flags))
    # Two or three capped devices: fit fills them front to back and may overflow a partial layer into the next
    # device. Uneven pairs both ways (the small device first, then last), and one -fitt per device.
    several: tuple[tuple[int, ...], ...] = ((32, 32), (48, 32), (64, 24), (24, 64), (48, 32, 24), (32, 32, 32))
    for sizes in several:
        tag = "+".join(map(str, sizes))
        cases.append(Case(f"demo/cap{tag}/fitt4/c4096", "demo", sizes, 4, ("-c", "4096", *np1)))
    per_device: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
        ((48, 32), (16, 0)), ((48, 32), (0, 16)), ((48, 32, 24), (8, 0, 4)))
    for sizes, targets in per_device:
        tag, fitt = "+".join(map(str, sizes)), ",".join(map(str, targets))
        cases.append(Case(f"demo/cap{tag}/fitt{fitt}/c4096", "demo", sizes, targets, ("-c", "4096", *np1)))
    # Tiny models (2 layers, ~1 MiB of weights, ~5 MiB loaded): caps of a few MiB still force choices.
    tiny: dict[str, tuple[int, ...]] = {"gpt-oss-tiny": (3, 4, 5), "qwen3moe-tiny": (4, 5)}
    for model, caps in tiny.items():
        for cap in caps:
            cases.append(Case(f"{model}/cap{cap}/fitt0/c2048", model, (cap,), 0, ("-c", "2048", *np1)))
    # Real shapes, header-only: -nr keeps the host side from repacking GiBs of mapped holes.
    for model in REAL_MODELS:
        for cap, target in ((4096, 512), (8192, 1024)):
            flags = ("-c", "8192", *np1, "-nr")
            cases.append(Case(f"{model}/cap{cap}/fitt{target}/c8192", model, (cap,), target, flags))
    # ... and on two devices, an uneven pair and an even one.
    for model in REAL_MODELS:
        for pair, target in (((4096, 2048), 512), ((6144, 6144), 1024)):
            flags = ("-c", "8192", *np1, "-nr")
            tag = "+".join(map(str, pair))
            cases.append(Case(f"{model}/cap{tag}/fitt{target}/c8192", model, pair, target, flags))
    return cases


def write_models(folder: Path, names: set[str]) -> tuple[dict[str, Path], dict[str, dict[str, Any]]]:
    paths: dict[str, Path] = {}
    meta: dict[str, dict[str, Any]] = {}
    for name in sorted(names):
        sparse = name in REAL_MODELS
        paths[name] = write_model(SHAPES[name], folder / f"{name}.gguf", sparse=sparse)[0]
        meta[name] = {"shape": name, "n_shards": 1, "sparse": sparse}
    return paths, meta


# ---------------------------------------------------------------------------------------------------------------
# Running one case


def _replace_all(text: str, mapping: dict[str, str]) -> str:
    """Every key of `mapping` replaced at once (a replaced endpoint is never replaced again), whole ports only."""
    if not mapping:
        return text
    pattern = "|".join(re.escape(k) for k in sorted(mapping, key=len, reverse=True))
    return re.sub(rf"(?:{pattern})(?!\d)", lambda m: mapping[m.group(0)], text)


def _normalize(text: str, endpoints: list[str]) -> str:
    return _replace_all(text, {e: f"127.0.0.1:{p}" for e, p in zip(endpoints, CANONICAL_PORTS, strict=False)})


def run_fit(tool: Path, model: Path, case: Case, endpoints: list[str]) -> dict[str, Any]:
    """llama.cpp's fit for the case (fitter.measure.llamacpp.fit_params), endpoints normalized, the fit's timing
    blanked."""
    exit_status = None
    try:
        fit = run_llama_fit(
            tool, model, case.flags, tuple(endpoints), case.targets, 1, FIT_TIMEOUT_S, case.fit_ctx_min
        )
        args, raw_log, projected = list(fit.flags), fit.log, fit.projected_mib
    except LlamaFitError as e:
        if e.exit_status is None:  # it did not run to the end: no case to record
            raise
        args, raw_log, projected, exit_status = [], e.log, parse_projected_mib(e.log), e.exit_status
    log = [TOOK_RE.sub("fitting params to free memory took <t> seconds", _normalize(ln, endpoints)) for ln in raw_log]
    record: dict[str, Any] = {
        "args": [_normalize(a, endpoints) for a in args],
        "status": "ok" if exit_status is None else "failed",
        "log": log,
        "projected_device_mib": list(projected) if projected is not None else None,
    }
    if exit_status is not None:
        record["exit_status"] = exit_status
    return record


def _load_skip_reason(fit: dict[str, Any]) -> str | None:
    if fit["status"] != "ok":
        return "llama.cpp's fit failed: nothing to load"
    projected = fit["projected_device_mib"]
    if projected is not None and sum(projected) * MIB > LOAD_LIMIT_BYTES:
        return (
            f"not loaded: the fit projects {sum(projected)} MiB on the device(s), over this script's "
            f"{LOAD_LIMIT_BYTES // MIB} MiB limit for copying weights into the emulated GPU"
        )
    return None


def run_case(tool: Path, case: Case, model: Path, folder: Path) -> dict[str, Any]:
    if len(case.caps_mib) > len(CANONICAL_PORTS):
        raise SystemExit(f"{case.id}: {len(case.caps_mib)} devices, but CANONICAL_PORTS names {len(CANONICAL_PORTS)}")
    gpus = [EmulatedGpu(cap) for cap in case.caps_mib]
    try:
        for gpu in gpus:
            gpu.start()
        endpoints = [gpu.endpoint for gpu in gpus]
        t0 = time.perf_counter()
        fit = run_fit(tool, model, case, endpoints)
        fit_s = time.perf_counter() - t0
        record: dict[str, Any] = {
            "id": case.id,
            "model": case.model,
            "cap_mib": case.caps_mib[0] if len(case.caps_mib) == 1 else list(case.caps_mib),
            "fit_target_mib": list(case.targets) if len(case.targets) > 1 else case.targets[0],
            "fit_ctx_min": case.fit_ctx_min,
            "flags": list(case.flags),
            "llama_fit": fit,
            "load": None,
            "load_server": None,
        }
        # The fit's dry runs use no_alloc: nothing may have been allocated on the devices.
        fit_peak = [gpu.stats().peak_bytes for gpu in gpus]
        if any(fit_peak):
            record["fit_device_peak_bytes"] = fit_peak
        skip = _load_skip_reason(fit)
        load_s = 0.0
        if skip is not None:
            record["load_skipped"] = skip
        else:
            canon = [f"127.0.0.1:{p}" for p in CANONICAL_PORTS[: len(endpoints)]]
            args = [_denormalize(a, canon, endpoints) for a in fit["args"]]
            config = parse_launch_flags([*case.flags, *args, "--rpc", ",".join(endpoints)])
            t1 = time.perf_counter()
            # "load": the context llama-fit-params projected (n_outputs_max 0 = n_batch); "load_server": the same
            # placement under llama-server, which reserves logits for min(-b, slots) outputs only.
            record["load"] = load_on(gpus, model, config, 0, case, folder, endpoints)
            record["load_server"] = load_on(gpus, model, config, None, case, folder, endpoints)
            load_s = time.perf_counter() - t1
        print(
            f"{case.id:<44} fit {fit_s:5.1f} s  load {load_s:5.1f} s  {fit['status']:<6} "
            f"{' '.join(fit['args']) or '-'}  -> {_load_summary(record)}",
            file=sys.stderr,
        )
        return record
    finally:
        for gpu in gpus:
            gpu.stop()


def load_on(
    gpus: list[EmulatedGpu],
    model: Path,
    config: Any,
    n_outputs_max: int | None,
    case: Case,
    folder: Path,
    endpoints: list[str],
) -> dict[str, Any]:
    """Load `config` on the capped devices; the buffers llama.cpp logged and the device memory really used."""
    for gpu in gpus:
        gpu.reset_peak()
    res = load_and_capture(model, config, n_outputs_max=n_outputs_max)
    stats = [gpu.stats() for gpu in gpus]
    error = None
    if not res.ok:
        error = _normalize((res.error or "unknown error").replace(str(folder), "<models>"), endpoints)
    peaks = [s.peak_bytes for s in stats]
    load: dict[str, Any] = {
        "ok": res.ok,
        "error": error,
        "buffers": _sorted_buffers(
            [{"buft": _normalize(str(b.buft), endpoints), "kind": b.kind, "mib": b.mib} for b in res.buffers]
        ),
        "device_peak_bytes": sum(peaks),
        "device_unused_bytes": sum(case.caps_mib) * MIB - sum(peaks),
        "refused_allocations": sum(s.refused for s in stats),
    }
    if len(gpus) > 1:
        load["device_peak_bytes_per_device"] = peaks
    return load


def _sorted_buffers(buffers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """By kind (llama.cpp's log order), then buffer type; log order among equals (e.g. a KV cache and its SWA part).

    llama.cpp logs buffer types of one kind in the order of their buffer-type pointers, which differs between runs
    when there are two RPC devices.
    """
    order = {"model": 0, "output": 1, "kv": 2, "compute": 3}
    return sorted(buffers, key=lambda b: (order.get(b["kind"], len(order)), b["buft"]))


def _denormalize(arg: str, canonical: list[str], endpoints: list[str]) -> str:
    return _replace_all(arg, dict(zip(canonical, endpoints, strict=True)))


def _load_summary(record: dict[str, Any]) -> str:
    load = record["load"]
    if load is None:
        return str(record.get("load_skipped", "not loaded"))
    out = []
    for key in ("load", "load_server"):
        load = record[key]
        status = "ok" if load["ok"] else f"ERROR {str(load['error'])[:100]}"
        out.append(
            f"{key}: peak {load['device_peak_bytes'] / MIB:.2f} MiB, "
            f"unused {load['device_unused_bytes'] / MIB:.2f} MiB, {status}"
        )
    return "; ".join(out)


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--llama-src",
        type=Path,
        default=None,
        help="build from this llama.cpp tree instead of llama-cpp-python's sdist",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--only",
        default=None,
        help="run only the cases whose id contains this (no file is written unless --out is given explicitly)",
    )
    ap.add_argument("--rebuild", action="store_true", help="rebuild the cached llama-fit-params")
    ap.add_argument("--build-only", action="store_true", help="build (or find) the tool and stop")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    tool = ensure_tools([TOOL], args.llama_src, args.rebuild)[TOOL]
    print(f"{TOOL}: {tool}", file=sys.stderr)
    if args.build_only:
        return 0
    info = llama_cpp_info()
    if info["version"] != LLAMA_CPP_PYTHON:
        raise SystemExit(
            f"llama-cpp-python {info['version']} is installed; this reference needs {LLAMA_CPP_PYTHON} "
            "(the emulated GPU's RPC server and the tool must speak the same protocol)"
        )
    cases = build_cases()
    if args.only:
        cases = [c for c in cases if args.only in c.id]
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fitter-fitref-") as tmp:
        folder = Path(tmp)
        paths, models = write_models(folder, {c.model for c in cases})
        print(f"{len(cases)} cases", file=sys.stderr)
        for case in cases:
            records.append(run_case(tool, case, paths[case.model], folder))
    golden: dict[str, Any] = {
        "generated_by": "scripts/llama_fit_reference.py",
        "llama_cpp": {
            "version": info["version"],
            "commit": LLAMA_CPP_COMMIT,
            "system_info": info["system_info"],
            "fit_tool": TOOL,
            "fit_tool_source": f"llama-cpp-python {LLAMA_CPP_PYTHON} vendor/llama.cpp",
            "fit_tool_cmake_args": CMAKE_ARGS,
            "fit_command": "llama-fit-params --model MODEL --rpc ENDPOINT[,ENDPOINT...] "
            "-fitt TARGET_MIB[,TARGET_MIB...] FLAGS [-fitc MIN_CTX] -t 1 -lv 4 --no-log-prefix --no-log-timestamps "
            "--log-colors off",
            "load": "load_and_capture(model, parse_launch_flags(flags + llama_fit.args + ['--rpc', ENDPOINTS]), "
            "n_outputs_max=0)",
            "load_server": "the same with n_outputs_max=None (llama-server: min(-b, slots) outputs)",
        },
        "device": {"kind": "rpc", "emulated": True, "endpoints": [f"127.0.0.1:{p}" for p in CANONICAL_PORTS]},
        "models": dict(sorted(models.items())),
        "cases": records,
    }
    if args.only and args.out == DEFAULT_OUT:
        print(json.dumps(records, indent=1))
        print(f"--only: {DEFAULT_OUT} left as it is", file=sys.stderr)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    n_ok = sum(r["llama_fit"]["status"] == "ok" for r in records)
    n_loaded = sum(r["load"] is not None and r["load"]["ok"] for r in records)
    print(
        f"{len(records)} cases ({n_ok} fitted, {n_loaded} loaded ok) in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
