"""fitter.memory.plan.device_choice: which devices a model uses, as src/llama.cpp chooses them or -dev names them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fitter.errors import LaunchConfigError
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import DISCRETE_VULKAN, Device, rpc_devices, vulkan_profile
from fitter.memory.backends.registry import parse_devices
from fitter.memory.plan.device_choice import default_devices, model_devices
from fitter.memory.plan.estimator import estimate
from fitter.units import MIB
from tests.models import model_file

IGPU = replace(DISCRETE_VULKAN, integrated=True)


def _names(devices: tuple[Device, ...]) -> list[str]:
    return [d.name for d in devices]


def test_rpc_servers_first_then_gpus_and_integrated_ones_only_without_those() -> None:
    dgpu = Device("Vulkan0", vulkan_profile(DISCRETE_VULKAN), 8192 * MIB, 8192 * MIB)
    igpu = Device("Vulkan1", vulkan_profile(IGPU), 16384 * MIB, 16384 * MIB)
    (rpc,) = rpc_devices(["127.0.0.1:50052"])
    assert _names(default_devices((igpu, dgpu, rpc))) == ["RPC0[127.0.0.1:50052]", "Vulkan0"]
    assert _names(default_devices((igpu, rpc))) == ["RPC0[127.0.0.1:50052]", "Vulkan1"]  # RPC counts as no GPU
    assert igpu.profile.unified and not igpu.profile.mmap and dgpu.profile.mmap


def test_dev_names_the_devices_in_its_order_and_none_takes_them_all_away() -> None:
    devices = parse_devices("vulkan:8192,4096")
    assert _names(model_devices(parse_launch_flags(["-dev", "Vulkan1,Vulkan0"]), devices)) == ["Vulkan1", "Vulkan0"]
    assert model_devices(parse_launch_flags(["-dev", "none"]), devices) == ()
    (rpc,) = rpc_devices(["10.0.0.2:50052"])  # ggml names the first server's device RPC0
    assert _names(model_devices(parse_launch_flags(["-dev", "RPC0"]), (*devices, rpc))) == ["RPC0[10.0.0.2:50052]"]
    with pytest.raises(LaunchConfigError) as e:
        model_devices(parse_launch_flags(["-dev", "CUDA0"]), devices)
    assert str(e.value) == ("-dev CUDA0: llama.cpp has no device 'CUDA0' here (invalid device); the devices are "
                            "Vulkan0, Vulkan1")


def test_an_integrated_gpu_loads_the_weights_without_mmap() -> None:
    spec = load_model_spec(str(model_file("gpt-oss-tiny")))
    igpu = (Device("Vulkan0", vulkan_profile(IGPU), 2048 * MIB, 2048 * MIB),)
    plan = estimate(spec, parse_launch_flags(["-c", "512", "-ngl", "1"]), igpu)
    # ggml-vulkan's caps.mmap_support is false for an integrated GPU: -lm auto loads as -lm none, so the host's
    # weights sit in the pinned host buffer type instead of a mapping of the file
    assert {b.buft for b in plan.buffers if b.kind == "model"} == {"Vulkan_Host", "Vulkan0"}
    assert any("cannot map the model file" in w for w in plan.warnings)
    dgpu = (Device("Vulkan0", vulkan_profile(DISCRETE_VULKAN), 2048 * MIB, 2048 * MIB),)
    mapped = estimate(spec, parse_launch_flags(["-c", "512", "-ngl", "1"]), dgpu)
    assert "CPU_Mapped" in {b.buft for b in mapped.buffers if b.kind == "model"}
