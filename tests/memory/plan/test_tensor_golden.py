"""-sm tensor against real loads on two and three emulated GPUs (tests/golden/sm-tensor2.json, sm-tensor3.json, from
`scripts/make_goldens.py --device sm-tensor2|sm-tensor3`).

llama.cpp logs one `Meta()` line per buffer: for model and KV the largest device's slices, for compute the size every
device holds. Each case also has every device's peak bytes from the emulator's cap shim, the truth per device: its
model and KV slices and its compute buffer together, to the byte.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from fitter.errors import LaunchConfigError
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.plan.estimator import CPU, MemoryPlan, estimate
from tests.memory.plan.test_golden import device_target
from tests.models import model_files

MIB = 1024 * 1024
_DIR = Path(__file__).resolve().parents[2] / "golden"
GOLDENS = {p.stem: json.loads(p.read_text()) for p in sorted(_DIR.glob("sm-tensor*.json"))}
OK = [pytest.param(n, c, id=f"{n}:{c['id']}") for n, g in GOLDENS.items() for c in g["cases"] if c["outcome"] == "ok"]
ERRORS = [pytest.param(n, c, id=f"{n}:{c['id']}") for n, g in GOLDENS.items() for c in g["cases"]
          if c["outcome"] == "error"]


@pytest.fixture(autouse=True)
def _fitter_home() -> None:
    """The golden cases read and write nothing in fitter's home."""


def _estimate(golden: str, case: dict[str, Any]) -> MemoryPlan:
    g = GOLDENS[golden]
    m = g["models"][case["model"]]
    spec = load_model_spec(str(model_files(m["shape"], m["sparse"], m["n_shards"])[0]))
    flags, devices = device_target(g["device"], case["flags"])
    return estimate(spec, parse_launch_flags(flags, "llama-server"), devices)


def _lines(plan: MemoryPlan) -> list[tuple[str, str, float]]:
    """The estimate as llama.cpp logs it: a Meta() buffer's devices (consecutive, one per device) as one line of the
    largest, host buffers as they are."""
    n = len(plan.devices)
    out: list[tuple[str, str, float]] = []
    meta = [b for b in plan.buffers if b.device != CPU]
    for i in range(0, len(meta), n):
        group = meta[i:i + n]
        assert len({(b.buft, b.kind) for b in group}) == 1
        out.append((group[0].buft, group[0].kind, round(max(b.bytes for b in group) / MIB, 2)))
    out += [(b.buft, b.kind, round(b.bytes / MIB, 2)) for b in plan.buffers if b.device == CPU]
    return sorted(out)


@pytest.mark.parametrize(("golden", "case"), OK)
def test_every_logged_buffer_matches_to_the_logged_hundredth_of_a_mib(golden: str, case: dict[str, Any]) -> None:
    logged = sorted((b["buft"], b["kind"], b["mib"]) for b in case["buffers"])
    assert _lines(_estimate(golden, case)) == logged


@pytest.mark.parametrize(("golden", "case"), OK)
def test_each_devices_bytes_match_its_peak_exactly(golden: str, case: dict[str, Any]) -> None:
    plan = _estimate(golden, case)
    per_device: dict[str, int] = defaultdict(int)
    for b in plan.buffers:
        per_device[b.device] += b.bytes
    assert [per_device[d.name] for d in plan.devices] == case["device_peak_bytes"]


@pytest.mark.parametrize(("golden", "case"), ERRORS)
def test_configs_llama_cpp_refuses_are_refused(golden: str, case: dict[str, Any]) -> None:
    with pytest.raises(LaunchConfigError, match=r"-sm tensor|-fa off"):
        _estimate(golden, case)


def test_both_goldens_are_there() -> None:
    assert sorted(GOLDENS) == ["sm-tensor2", "sm-tensor3"]
    assert all(len(c["device_peak_bytes"]) == len(g["device"]["caps_mib"]) for g in GOLDENS.values()
               for c in g["cases"])
