"""fitter.search.screen: the drift guard screens with the larger of fitter's estimate and the build's projection."""

from __future__ import annotations

from dataclasses import replace

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import CPU_AVX2, DISCRETE_VULKAN, Device, vulkan_profile
from fitter.memory.plan.host import host_memory
from fitter.search.screen import Budgets, Screen, device_totals, screen
from fitter.units import MIB
from tests.models import model_file


def test_the_larger_of_the_two_decides_per_device() -> None:
    budgets = Budgets({"CUDA0": 100 * MIB, "CUDA1": 100 * MIB}, None, {"CUDA1": 10 * MIB})
    ours = Screen(None, {"vram:CUDA0": -20.0, "vram:CUDA1": -5.0})
    projection = {"CUDA0": {"model": 60 * MIB, "kv": 30 * MIB, "compute": 20 * MIB},  # 110: over by 10
                  "CUDA1": {"model": 50 * MIB, "kv": 10 * MIB, "compute": 10 * MIB},  # 70 + 10 margin: under
                  "CPU": {"model": 5 * MIB, "kv": 0, "compute": 1 * MIB}}
    guarded = ours.with_projection(projection, budgets)
    assert guarded.constraints == {"vram:CUDA0": 10.0, "vram:CUDA1": -5.0}
    assert not guarded.feasible and guarded.projection == projection
    assert guarded.reason() == "predicted over budget: vram:CUDA0 by 10.0 MiB"


def test_a_device_that_shares_the_hosts_memory_draws_on_the_same_ram() -> None:
    spec = load_model_spec(str(model_file("gpt-oss-tiny")))
    config = parse_launch_flags(["-c", "512", "-ngl", "all"])
    apu = (Device("Vulkan0", vulkan_profile(replace(DISCRETE_VULKAN, integrated=True)), 8 << 30, 8 << 30),)
    dgpu = (Device("Vulkan0", vulkan_profile(DISCRETE_VULKAN), 8 << 30, 8 << 30),)
    budgets = Budgets({"Vulkan0": 8 << 30}, 1 << 30, {})
    shared, own = screen(spec, config, apu, CPU_AVX2, budgets), screen(spec, config, dgpu, CPU_AVX2, budgets)
    # one pool: the integrated GPU's bytes come out of the host's RAM too, a discrete card's do not
    on_apu, on_dgpu = host_memory(shared.plan), host_memory(own.plan)
    assert on_apu.shared == device_totals(shared.plan)["Vulkan0"] and on_dgpu.shared == 0
    assert shared.constraints["ram"] == (on_apu.total - (1 << 30)) / 2**20
    assert own.constraints["ram"] == (on_dgpu.total - (1 << 30)) / 2**20
