"""fitter.memory.graph.vulkan_ops: ggml-vulkan's op support on shape-only tensors, and what its buffer range changes
in an estimate (checked against llama.cpp's Vulkan backend on lavapipe in test_golden's vulkan-emulated cases)."""

from __future__ import annotations

import pytest

from fitter.errors import LaunchConfigError
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import Device, VulkanLimits, vulkan_profile
from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph import vulkan_ops as vk
from fitter.memory.plan.estimator import estimate
from fitter.units import MIB
from tests.models import model_file

LAVAPIPE = VulkanLimits(16, 64, 128 * MIB, 2048 * MIB, 4096 * MIB - 1)


def _fa(type_k: str = "F16", type_v: str = "F16", head: int = 64, n_kv: int = 4096) -> g.Tensor:
    q = g.permute(g.new("F32", head, 16, 512), 0, 2, 1, 3)
    k = g.permute(g.view(g.data_tensor(type_k, head * 4, n_kv, weight=False), (head, 4, n_kv),
                         (g.type_size(type_k)[1] * head // g.type_size(type_k)[0], 0)), 0, 2, 1, 3)
    v = g.permute(g.view(g.data_tensor(type_v, head * 4, n_kv, weight=False), (head, 4, n_kv),
                         (g.type_size(type_v)[1] * head // g.type_size(type_v)[0], 0)), 0, 2, 1, 3)
    return g.flash_attn_ext(q, k, v, g.new("F16", n_kv, 512), g.data_tensor("F32", 16))


def test_flash_attention_needs_head_sizes_of_eight_and_the_backends_cache_types() -> None:
    assert vk.vulkan_supports_op(_fa(), None)
    assert vk.vulkan_supports_op(_fa("Q8_0", "Q4_0"), None) and vk.vulkan_supports_op(_fa("IQ4_NL", "Q5_1"), None)
    assert not vk.vulkan_supports_op(_fa(head=60), None)  # 60 % 8
    assert not vk.vulkan_supports_op(_fa("Q4_K", "F16"), None)  # not a K type the shaders read
    assert not vk.vulkan_supports_op(_fa("BF16", "F16"), None)  # bf16 K with a V that is not


def test_the_gated_delta_rule_needs_value_heads_of_16_to_128() -> None:
    from fitter.memory.graph.recurrent_ops import gated_delta_net

    def gdn(s_v: int, state_type: str = "F32") -> g.Tensor:
        q, v = g.new("F32", s_v, 2, 8, 1), g.new("F32", s_v, 4, 8, 1)
        return gated_delta_net(q, q, v, g.new("F32", 1, 4, 8, 1), g.new("F32", 1, 4, 8, 1),
                               g.new(state_type, s_v, s_v, 4, 1))

    assert all(vk.vulkan_supports_op(gdn(s_v), None) for s_v in (16, 32, 64, 128))
    assert not vk.vulkan_supports_op(gdn(256), None) and not vk.vulkan_supports_op(gdn(96), None)
    assert not vk.vulkan_supports_op(gdn(128, "F16"), None)


def test_no_tensor_past_the_buffer_range_in_an_op() -> None:
    kq = g.mul_mat(g.data_tensor("F16", 64, 8192), g.new("F32", 64, 512, 64))  # 8192 × 512 × 64 f32 = 1 GiB
    assert kq.nbytes == 1024 * MIB
    assert vk.vulkan_supports_op(kq, None) and not vk.vulkan_supports_op(kq, 128 * MIB)
    assert vk.vulkan_supports_op(kq, 1024 * MIB)  # at the limit is within it


def test_a_weight_stays_on_the_host_when_its_op_on_a_512_token_batch_passes_the_range() -> None:
    # llama_model_loader's weight_buft_supported: the output weight's logits for 512 tokens
    assert not vk.weight_supported("Q8_0", (2880, 201088), "mul_mat", 4, 128 * MIB)  # 201088 × 512 × 4 = 393 MiB
    assert vk.weight_supported("Q8_0", (2880, 32000), "mul_mat", 4, 128 * MIB)  # 62.5 MiB
    assert vk.weight_supported("Q8_0", (2880, 201088), "mul_mat", 4, None)
    # gpt-oss-20b's expert tensors (2880 × 2880 × 32 MXFP4, 140 MB) are past lavapipe's 128 MiB themselves
    assert not vk.weight_supported("MXFP4", (2880, 2880, 32), "mul_mat_id", 4, 128 * MIB)
    assert vk.weight_supported("MXFP4", (2880, 2880, 32), "mul_mat_id", 4, 4096 * MIB)


def test_layouts_as_ggml_reads_them() -> None:
    t = g.new("F32", 8, 4, 2)
    assert vk.is_contiguous(t) and vk.dim01_contiguous(t) and vk.contiguous_rows(t)
    p = g.permute(t, 0, 2, 1, 3)
    assert not vk.is_contiguous(p) and vk.contiguous_rows(p)
    assert not vk.contiguous_rows(g.transpose(t))


def test_a_kv_cache_past_the_range_is_refused_as_llama_cpp_aborts() -> None:
    spec = load_model_spec(str(model_file("gpt-oss-tiny")))
    small = VulkanLimits(16, 64, 1 * MIB, 2048 * MIB, 4096 * MIB - 1)  # 1 MiB: 64 K values per cell, 16k cells
    dev = (Device("Vulkan0", vulkan_profile(small), 512 * MIB, 512 * MIB),)
    estimate(spec, parse_launch_flags(["-c", "8192", "-ngl", "all"]), dev)  # 8192 × 64 × 2 B = 1 MiB: at the limit
    with pytest.raises(LaunchConfigError) as e:
        estimate(spec, parse_launch_flags(["-c", "16384", "-ngl", "all"]), dev)
    assert str(e.value).startswith("-c 16384: layer 1's K cache would be 2.00 MiB on Vulkan0, past the largest tensor "
                                   "its ops take (1.00 MiB, the device's maxStorageBufferRange), so llama.cpp aborts")
    estimate(spec, parse_launch_flags(["-c", "16384", "-ngl", "all", "-nkvo"]), dev)  # the cache on the host
