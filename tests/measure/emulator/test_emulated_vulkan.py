"""fitter's emulated Vulkan GPU: llama.cpp's own Vulkan backend on Mesa's lavapipe, capped by the capdev shim in
client mode, checked with real loads of the demo model."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.emulator.capdev import EmulatedGpuError
from fitter.measure.emulator.emulated_vulkan import (
    LIB_PATH_ENV,
    VISIBLE_ENV,
    EmulatedVulkanGpus,
    emulated_vulkan_devices,
    vulkan_build,
)
from fitter.measure.loader import load_and_capture
from fitter.memory.backends.devices import VulkanLimits
from fitter.memory.plan.estimator import estimate, first_failure
from fitter.units import MIB

LAVAPIPE = VulkanLimits(16, 64, 128 * MIB, 2048 * MIB, 4096 * MIB - 1)

# ---------------------------------------------------------------------------------------------------------------
# Pure


def test_the_devices_are_named_as_ggml_vulkan_names_them_with_their_caps() -> None:
    devices = emulated_vulkan_devices((96, 48), LAVAPIPE)
    assert [(d.name, d.total_bytes, d.free_bytes) for d in devices] == [("Vulkan0", 96 * MIB, 96 * MIB),
                                                                        ("Vulkan1", 48 * MIB, 48 * MIB)]
    p = devices[0].profile
    assert (p.kind, p.alignment, p.host_buft, p.host_alignment, p.host_extra, p.max_op_bytes, p.max_alloc) == (
        "vulkan", 16, "Vulkan_Host", 64, 32, 128 * MIB, 1024 * MIB)


def test_a_binary_that_is_not_a_vulkan_build_is_refused(tmp_path: Path) -> None:
    (tmp_path / "llama-server").write_text("")
    with pytest.raises(EmulatedGpuError) as e:
        vulkan_build(tmp_path / "llama-server")
    assert str(e.value) == (f"--emulated-gpu vulkan: {tmp_path} is not a shared llama.cpp build with the Vulkan "
                            "backend (no libggml-vulkan.so.0 beside its binaries); give a Vulkan build's bin/ folder "
                            "as --llama-cpp, or leave it out to use fitter's")


# ---------------------------------------------------------------------------------------------------------------
# On lavapipe


@pytest.mark.vulkan
def test_the_build_lists_each_capped_device_and_the_environment_comes_back(vulkan_build: Path) -> None:
    before = {k: os.environ.get(k) for k in (VISIBLE_ENV, LIB_PATH_ENV, "LD_PRELOAD")}
    with EmulatedVulkanGpus((96, 48), beside=vulkan_build / "llama-server") as gpus:
        assert gpus.names == ("Vulkan0", "Vulkan1") and gpus.lib_dir == vulkan_build
        out = subprocess.run([str(vulkan_build / "llama-server"), "--list-devices"], capture_output=True, text=True,
                             timeout=120)
        listed = [line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip().startswith("Vulkan")]
        assert [line.split(": ")[0] for line in listed] == ["Vulkan0", "Vulkan1"]
        assert listed[0].endswith("(96 MiB, 96 MiB free)") and listed[1].endswith("(48 MiB, 48 MiB free)")
        assert gpus.peaks() == {"Vulkan0": 0, "Vulkan1": 0}  # listing allocates nothing
    assert {k: os.environ.get(k) for k in before} == before


@pytest.mark.vulkan
def test_a_load_peaks_at_the_estimated_bytes_and_one_past_the_cap_fails_where_predicted(vulkan_build: Path) -> None:
    from fitter.gguf.demo_models import demo_model_path

    model = str(demo_model_path())
    spec = load_model_spec(model)
    config = parse_launch_flags(["-c", "1024", "-ngl", "all", "-np", "1"])
    with EmulatedVulkanGpus((512,), beside=vulkan_build / "llama-server") as gpus:
        plan = estimate(spec, config, gpus.devices())
        res = load_and_capture(model, config)
        assert res.ok, res.error
        predicted = plan.totals()["Vulkan0"]
        assert gpus.peaks()["Vulkan0"] == predicted.model + predicted.kv + predicted.compute
        gpus.reset_peak()  # the loader has exited: its counters are cleared
        assert gpus.peaks()["Vulkan0"] == 0
    cap = (predicted.model + predicted.kv) // MIB - 1  # the KV cache does not fit
    with EmulatedVulkanGpus((cap,), beside=vulkan_build / "llama-server") as gpus:
        (device,) = gpus.devices()
        assert first_failure(estimate(spec, config, gpus.devices()), device.name, cap * MIB) == "kv"
        res = load_and_capture(model, config)
        assert not res.ok and "failed to allocate Vulkan0 buffer" in (res.error or "")
        assert "failed to allocate buffer for kv cache" in (res.error or "")
        stats = gpus.stats("Vulkan0")
        full, swa = (b.bytes for b in plan.buffers if b.kind == "kv")  # gpt-oss: the full cache, then the window's
        assert stats is not None and stats.refused == 1
        assert (stats.peak_bytes, stats.last_refused_bytes) == (predicted.model + full, swa)


@pytest.mark.vulkan
def test_a_cap_past_lavapipes_heap_is_refused(vulkan_build: Path) -> None:
    with pytest.raises(EmulatedGpuError) as e:
        EmulatedVulkanGpus((4096,), beside=vulkan_build / "llama-server").start()
    assert "4096 MiB is more than lavapipe can address" in str(e.value)
    assert VISIBLE_ENV not in os.environ or os.environ[VISIBLE_ENV] != "0"


