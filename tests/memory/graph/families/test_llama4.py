"""fitter.memory.graph.families.llama4 against llama.cpp 0c1e570, to the byte: Llama-4-Scout's real shape as
llama-fit-params reserves it (ggml_backend_sched_reserve_size, the CPU and an RPC device), the tiny model of
tests/golden/archs.json without chunked attention (`attention.sliding_window` = 0: one KV cache, RoPE in every layer
but the last) as a real load reserves it, and that model on lavapipe's Vulkan device as llama-fit-params of fitter's
Vulkan build reserves it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fitter.gguf.model_spec import load_model_spec
from fitter.measure.emulator.emulated_vulkan import emulated_vulkan_devices
from fitter.measure.llamacpp.projection import tool_estimate
from fitter.memory.backends.devices import CPU_AVX2, VulkanLimits, rpc_devices
from fitter.units import MIB
from tests.memory.graph.families.test_llama_like import compute_bytes, with_keys
from tests.memory.plan.test_arch_goldens import models  # noqa: F401 (the fixture)
from tests.models import model_file

GPU = "127.0.0.1:50052"


@pytest.mark.parametrize(("flags", "expected"), [
    ("-c 4096 -nr", {"CPU": 468344832}),
    ("-c 4096 -fa off -nr", {"CPU": 468336640}),
    ("-c 8192 -np 2 -ctk q8_0 -ctv q8_0 -fa on -nr", {"CPU": 445253632}),
    ("-c 4096 -ub 2048 -b 2048 -nr", {"CPU": 1873379328}),
    # the experts on the host: the MoE's REPEAT, weighted input and MUL_MAT_IDs run there
    (f"-c 4096 -ngl all -cmoe -nr --rpc {GPU}", {f"RPC0[{GPU}]": 455737344, "CPU": 73424896}),
    (f"-c 4096 -ngl 20 -nr --rpc {GPU}", {f"RPC0[{GPU}]": 455835648, "CPU": 104980480}),
    (f"-c 8192 -ngl all -fa off -nr --rpc {GPU}", {f"RPC0[{GPU}]": 462043136, "CPU": 37765120}),
])
def test_scout_reserves_what_llama_fit_params_reserves(flags: str, expected: dict[str, int]) -> None:
    devices = rpc_devices([GPU]) if "--rpc" in flags else ()
    ours = tool_estimate(load_model_spec(str(model_file("llama-4-scout", sparse=True))), flags.split(), devices,
                         CPU_AVX2)
    assert {name: kinds["compute"] for name, kinds in ours.items()} == expected


def test_without_chunks_every_layer_but_the_last_rotates(models: Path, tmp_path: Path) -> None:  # noqa: F811
    path = with_keys(models, "llama4-moe", tmp_path, attention__sliding_window=0)
    assert [compute_bytes(path, c) for c in ("c256", "ub64-nofa", "np2-q8")] == [3814432, 1116960, 3896352]


LAVAPIPE = VulkanLimits(16, 64, 128 * MIB, 2048 * MIB, 4096 * MIB - 1)


@pytest.mark.parametrize(("flags", "expected"), [
    ("-c 256 -ngl 1", {"Vulkan0": 3933440, "CPU": 1060864 + 32}),
    ("-c 256 -ngl 1 -fa off", {"Vulkan0": 4457728, "CPU": 2367488 + 32}),
])
def test_the_layers_on_the_host_share_one_rope_freqs(models: Path, flags: str, expected: dict[str, int]) -> None:  # noqa: F811
    # every layer on the CPU reads the one rope_freqs tensor of the CPU's buffer type: the Vulkan split of the first
    # ROPE copies it once and the copy lives to the last layer's ROPE, which moves the device buffer's placements
    # (a copy per layer: 262912 bytes over). The host's (Vulkan_Host) buffer: the reserve plus the 32 bytes
    # ggml-vulkan adds to each buffer it makes.
    ours = tool_estimate(load_model_spec(str(models / "llama4-moe.gguf")), flags.split(),
                         emulated_vulkan_devices((2000,), LAVAPIPE), CPU_AVX2)
    assert {name: kinds["compute"] for name, kinds in ours.items()} == expected
