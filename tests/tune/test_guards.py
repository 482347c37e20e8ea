"""fitter.tune.guards: the drift guard projects each config where fitter's rules were not checked against such a
device, and stays off where they were."""

from __future__ import annotations

from pathlib import Path

from fitter import LLAMA_CPP_TARGET
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.llamacpp.builds import find_build
from fitter.tune.guards import drift_guard
from tests.models import model_file
from tests.tune.options import tune_options

LISTING = """#!/bin/sh
case "$*" in
  *--list-devices*) printf 'Available devices:\\n  %s\\n' "$FAKE_DEVICE" ;;
esac
"""


def _build(tmp_path: Path, device: str) -> Path:
    folder = tmp_path / "build"
    folder.mkdir(parents=True)
    for name in ("llama-server", "llama-fit-params"):
        (folder / name).write_text(LISTING.replace("$FAKE_DEVICE", device))
        (folder / name).chmod(0o755)
    return folder


def _guard(tmp_path: Path, device: str) -> list[str]:
    model = model_file("llama-tiny")
    o = tune_options(model=str(model), spec=load_model_spec(str(model)), base=parse_launch_flags(["-c", "512"]))
    said: list[str] = []
    projector = drift_guard(o, find_build(str(_build(tmp_path, device))), LLAMA_CPP_TARGET["commit"], (), said.append)
    assert (projector is None) == (not said)
    return said


def test_lavapipe_is_checked_by_the_vulkan_goldens_so_no_guard(tmp_path: Path) -> None:
    assert _guard(tmp_path, "Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)") == []


def test_a_vulkan_card_a_cuda_build_and_metal_are_projected_before_each_launch(tmp_path: Path) -> None:
    for i, device in enumerate(("Vulkan0: AMD Radeon RX 7600 (RADV NAVI33) (8176 MiB, 8000 MiB free)",
                                "CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23500 MiB free)",
                                "MTL0: Apple M2 Max (98304 MiB, 98304 MiB free)")):
        (said,) = _guard(tmp_path / str(i), device)
        name = device.split(":")[0]
        assert said.startswith(f"fitter: drift guard on ({name}: no golden data from that backend or device yet): "
                               "each config is projected by ")
