"""fitter.memory.backends.registry: every backend llama.cpp ships, and the hypothetical cards --devices asks about."""

from __future__ import annotations

import pytest

from fitter.errors import LaunchConfigError
from fitter.memory.backends.devices import CUDA
from fitter.memory.backends.registry import BACKENDS, UNKNOWN, backend_of, parse_devices
from fitter.units import MIB


def test_each_device_name_finds_its_backend() -> None:
    names = {"CUDA0": "CUDA", "ROCm1": "ROCm", "MUSA0": "MUSA", "Vulkan2": "Vulkan", "MTL0": "Metal", "SYCL0": "SYCL",
             "GPUOpenCL": "OpenCL", "CANN0": "CANN", "WebGPU": "WebGPU", "RPC0[127.0.0.1:50052]": "RPC", "RPC1": "RPC",
             "HTP0:1": "Hexagon", "OPENVINO0": "OpenVINO", "[virtgpu] Apple M4": "virtgpu", "BLAS": "BLAS"}
    assert {n: backend_of(n).name for n in names} == names
    assert backend_of("NPU0") is UNKNOWN and backend_of("Vulkan") is UNKNOWN  # an index is part of the name
    assert len({b.prefix for b in BACKENDS}) == len(BACKENDS)


def test_hypothetical_cards_of_every_backend_a_user_asks_about() -> None:
    (cuda,) = parse_devices("cuda:24576")
    assert (cuda.name, cuda.profile, cuda.total_bytes) == ("CUDA0", CUDA, 24576 * MIB) and cuda.overhead is not None
    vk = parse_devices("vulkan:16384,8192")
    assert [d.name for d in vk] == ["Vulkan0", "Vulkan1"] and vk[0].profile.host_buft == "Vulkan_Host"
    assert "typical discrete card" in vk[0].profile.validated
    (rocm,) = parse_devices("rocm:16384")
    assert (rocm.name, rocm.profile.host_buft, rocm.profile.ops) == ("ROCm0", "ROCm_Host", "cuda")
    assert "not validated on ROCm hardware" in rocm.profile.validated
    (metal,) = parse_devices("metal:98304")
    assert metal.name == "MTL0" and metal.profile.projected and metal.profile.unified


def test_a_kind_fitter_does_not_know_is_named_with_the_ones_it_does() -> None:
    with pytest.raises(LaunchConfigError) as e:
        parse_devices("npu:4096")
    assert str(e.value) == ("--devices 'npu:4096': 'npu' is not a kind fitter knows; expected none, cuda:MiB[,MiB...], "
                            "vulkan:MiB[,MiB...], rocm:MiB[,MiB...], musa:MiB[,MiB...], metal:MiB[,MiB...], "
                            "sycl:MiB[,MiB...] or rpc:HOST:PORT[,...]")
    with pytest.raises(LaunchConfigError, match="'lots' is not a positive number of MiB"):
        parse_devices("vulkan:lots")
