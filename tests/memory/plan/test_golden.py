"""The estimator against buffers llama.cpp itself logged (tests/golden/*.json, from scripts/make_goldens.py).

cpu.json: CPU only. rpc.json: with fitter's emulated GPU (a llama.cpp RPC device), so model, KV and compute
buffers are split between RPC0[…] and the host. cuda-emulated.json: the CUDA-shaped emulated GPU (CUDA's
alignment, row padding, flash-attention scratch, op offload and CUDA_Host), estimated with the CUDA profile.
vulkan-emulated.json: llama.cpp's own Vulkan backend on Mesa's lavapipe (fitter's emulated Vulkan GPU), estimated
with the Vulkan profile of lavapipe's limits: every buffer, compute included, to the logged 0.01 MiB.
<device>.<program>.json: the same loads as another program makes them (`make_goldens.py --for llama-cpp-python`:
the C API's context parameters and Llama()'s defaults), estimated with `--for` that program. Model, KV and output
buffers must match the logged 0.01 MiB; compute buffers within 5 %. Cases marked held_out were never looked at
while writing the estimator's rules: they are the check that the rules generalise.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fitter.errors import LaunchConfigError
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import ModelSpec, load_model_spec
from fitter.memory.backends.devices import CPU_AVX2, CUDA, Device, VulkanLimits, rpc_devices, vulkan_profile
from fitter.memory.plan.estimator import estimate
from tests.models import model_files

MIB = 1024 * 1024
_DIR = Path(__file__).resolve().parents[2] / "golden"
# cuda.json exists once scripts/make_goldens.py --device cuda has run on a GPU
GOLDENS = {p.stem: json.loads(p.read_text()) for p in sorted(_DIR.glob("*.json"))
           if p.stem.split(".")[0] in ("cpu", "rpc", "rpc2", "rpc3", "cuda-emulated", "cuda", "vulkan-emulated")}
EXACT_COMPUTE = ("vulkan-emulated",)  # goldens whose compute buffers are held to the logged 0.01 MiB too
# Another program's goldens (<device>.<program>.json) run under -m slow: the default run keeps llama-server's, on every
# device
_SLOW = [pytest.mark.slow]
CASES = [pytest.param(name, c, marks=_SLOW if "." in name else (), id=f"{name}:{c['id']}")
         for name, g in GOLDENS.items() for c in g["cases"] if c["outcome"] == "ok"]
ERRORS = [pytest.param(name, c, marks=_SLOW if "." in name else (), id=f"{name}:{c['id']}")
          for name, g in GOLDENS.items() for c in g["cases"] if c["outcome"] == "error"]
_specs: dict[str, ModelSpec] = {}


@pytest.fixture(autouse=True)
def _fitter_home() -> None:
    """The golden cases read and write nothing in fitter's home: no folder of their own (tests/conftest.py's)."""


def _spec(golden: str, model: str) -> ModelSpec:
    if model not in _specs:
        m = GOLDENS[golden]["models"][model]
        _specs[model] = load_model_spec(str(model_files(m["shape"], m["sparse"], m["n_shards"])[0]))
    return _specs[model]


def _target(golden: str, flags: list[str]) -> tuple[list[str], tuple[Device, ...]]:
    """The flags as the golden run passed them, and the devices the estimate is asked about."""
    return device_target(GOLDENS[golden].get("device"), flags)


def device_target(device: dict[str, Any] | None, flags: list[str]) -> tuple[list[str], tuple[Device, ...]]:
    """A golden file's `device` record: the flags as its runs passed them, and the devices to estimate for."""
    if device is None:
        return flags, ()
    if device["kind"] == "cuda":
        free = device["free_mib"] * MIB
        return [f.replace("{rpc}", "CUDA0") for f in flags], (Device("CUDA0", CUDA, free, free),)
    if device["kind"] == "vulkan-emulated":  # lavapipe's limits, as the run read them; its cap is its memory
        cap = device["cap_mib"] * MIB
        profile = vulkan_profile(VulkanLimits(**device["limits"]))
        return [f.replace("{rpc}", device["name"]) for f in flags], (Device(device["name"], profile, cap, cap),)
    if device["kind"] == "rpc-multi":  # several emulated GPUs: each one's free memory is its cap
        endpoints = device["endpoints"]
        devices = tuple(replace(d, total_bytes=cap * MIB, free_bytes=cap * MIB)
                        for d, cap in zip(rpc_devices(endpoints), device["caps_mib"], strict=True))
        return [multi_flag(f, endpoints) for f in flags] + ["--rpc", ",".join(endpoints)], devices
    endpoint = device["endpoint"]
    devices = rpc_devices([endpoint])
    if device["kind"] == "cuda-emulated":  # an RPC device with CUDA's rules: the estimator's CUDA profile
        devices = tuple(replace(d, profile=CUDA) for d in devices)
    return [f.replace("{rpc}", f"RPC0[{endpoint}]") for f in flags] + ["--rpc", endpoint], devices


def multi_flag(flag: str, endpoints: list[str]) -> str:
    """scripts/make_goldens.py's `{rpcN}` and `{rpclast}`: those devices' buffer types."""
    flag = flag.replace("{rpclast}", f"RPC0[{endpoints[-1]}]")
    for i, e in enumerate(endpoints):
        flag = flag.replace(f"{{rpc{i}}}", f"RPC0[{e}]")
    return flag


def _by_kind(buffers: list[tuple[str, str, float]]) -> dict[tuple[str, str], list[float]]:
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for buft, kind, mib in buffers:
        out[(buft, kind)].append(mib)
    return dict(out)


def _consumer(golden: str) -> str:
    return str(GOLDENS[golden].get("for", "llama-server"))


_ESTIMATED: dict[tuple[str, str], dict[tuple[str, str], list[float]]] = {}


def estimated(golden: str, case: dict[str, Any]) -> dict[tuple[str, str], list[float]]:
    """The estimate's buffers of a case, estimated once for both of the case's tests."""
    key = (golden, case["id"])
    if key not in _ESTIMATED:
        flags, devices = _target(golden, case["flags"])
        plan = estimate(_spec(golden, case["model"]), parse_launch_flags(flags, _consumer(golden)), devices, CPU_AVX2)
        _ESTIMATED[key] = _by_kind([(b.buft, b.kind, b.bytes / MIB) for b in plan.buffers])
    return _ESTIMATED[key]


def logged(case: dict[str, Any]) -> dict[tuple[str, str], list[float]]:
    return _by_kind([(b["buft"], b["kind"], b["mib"]) for b in case["buffers"]])


def assert_all_but_compute_exact(est: dict[tuple[str, str], list[float]],
                                 gold: dict[tuple[str, str], list[float]]) -> None:
    """Model, KV and output buffers (MiB by buffer type and kind) to the logged 0.01 MiB."""
    exact = {k: v for k, v in gold.items() if k[1] != "compute"}
    assert {k: [round(x, 2) for x in v] for k, v in est.items() if k[1] != "compute"} == exact


def assert_compute_within_5_percent(est: dict[tuple[str, str], list[float]], gold: dict[tuple[str, str], list[float]],
                                    who: str = "llama.cpp") -> None:
    """The same compute buffers as logged (an estimated empty one aside), each within 5 % (+ the log's 0.005 MiB)."""
    gold_compute = {k: v for k, v in gold.items() if k[1] == "compute"}
    est_compute = {k: v for k, v in est.items() if k[1] == "compute" and (k in gold_compute or v != [0.0])}
    assert est_compute.keys() == gold_compute.keys()
    for key, (g,) in gold_compute.items():
        (e,) = est_compute[key]
        assert abs(e - g) <= 0.05 * g + 0.005, f"{key}: estimated {e:.2f} MiB, {who} {g:.2f} MiB"


@pytest.mark.parametrize(("golden", "case"), CASES)
def test_model_kv_and_output_buffers_match_llama_cpp_exactly(golden: str, case: dict[str, Any]) -> None:
    assert_all_but_compute_exact(estimated(golden, case), logged(case))


@pytest.mark.parametrize(("golden", "case"), CASES)
def test_compute_buffers_within_5_percent(golden: str, case: dict[str, Any]) -> None:
    assert_compute_within_5_percent(estimated(golden, case), logged(case))


@pytest.mark.parametrize(("golden", "case"), [c for c in CASES if c.values[0] in EXACT_COMPUTE])
def test_vulkan_compute_buffers_match_llama_cpp_exactly(golden: str, case: dict[str, Any]) -> None:
    # ggml-vulkan's own rules: its buffer range, Vulkan_Host, and the reordering of each split (graph_optimize)
    est = {k: [round(x, 2) for x in v] for k, v in estimated(golden, case).items()
           if k[1] == "compute" and v != [0.0]}  # llama.cpp logs no empty compute buffer
    assert est == {k: v for k, v in logged(case).items() if k[1] == "compute"}


@pytest.mark.parametrize(("golden", "case"), ERRORS)
def test_configs_llama_cpp_refused_are_refused_before_loading(golden: str, case: dict[str, Any]) -> None:
    flags, devices = _target(golden, case["flags"])
    with pytest.raises(LaunchConfigError):
        estimate(_spec(golden, case["model"]), parse_launch_flags(flags, _consumer(golden)), devices, CPU_AVX2)
