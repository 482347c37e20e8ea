"""fitter.memory.graph.cuda_ops: ggml-cuda's allocation, flash-attention and op-offload rules on shape-only tensors,
and what they change in an estimate (checked against the CUDA-shaped emulated GPU in test_golden)."""

from __future__ import annotations

from dataclasses import replace

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import CUDA, Device, offload_min_batch, with_offload_min_batch
from fitter.memory.graph import cuda_ops as cuda
from fitter.memory.graph import ggml_graph as g
from fitter.memory.plan.estimator import estimate
from fitter.units import MIB
from tests.models import model_file


def _fa(n_tokens: int, n_kv: int, type_k: str = "Q8_0", type_v: str = "Q8_0", head: int = 64, n_head: int = 16,
        n_head_kv: int = 4) -> g.Tensor:
    """A FLASH_ATTN_EXT node as build_attn_mha makes it: Q [head, tokens, heads], K/V views of the cache."""
    q = g.permute(g.new("F32", head, n_head, n_tokens), 0, 2, 1, 3)
    k_cache = g.data_tensor(type_k, head * n_head_kv, n_kv, weight=False)
    v_cache = g.data_tensor(type_v, head * n_head_kv, n_kv, weight=False)
    kb, vb = g.type_size(type_k), g.type_size(type_v)
    k = g.permute(g.view(k_cache, (head, n_head_kv, n_kv), (head // kb[0] * kb[1], k_cache.nb[1])), 0, 2, 1, 3)
    v = g.permute(g.view(v_cache, (head, n_head_kv, n_kv), (head // vb[0] * vb[1], v_cache.nb[1])), 0, 2, 1, 3)
    mask = g.new("F16", n_kv, n_tokens)
    return g.flash_attn_ext(q, k, v, mask, None)


def test_op_batch_size_as_ggml_cuda() -> None:
    x = g.new("F32", 64, 512)
    w = g.data_tensor("Q8_0", 64, 128)
    assert cuda.op_batch_size(g.mul_mat(w, x)) == 512  # ne[1]
    assert cuda.op_batch_size(g.get_rows(w, g.new("I32", 512))) == 0  # token_embd never moves
    ids = g.new("I32", 4, 512)
    experts = g.data_tensor("MXFP4", 64, 32, 8)
    assert cuda.op_batch_size(g.mul_mat_id(experts, g.new("F32", 64, 4, 512), ids)) == 512  # ne[2]
    assert cuda.op_batch_size(g.new("F32", 64, 3, 5, 2, op="ADD")) == 30  # ggml_nrows


def test_flash_attention_kernel_and_support() -> None:
    assert cuda.fattn_kernel(_fa(512, 4096)) == "mma"
    assert cuda.fattn_kernel(_fa(2, 4096)) == "vec"  # quantized K/V, at most 2 columns (Ada and newer)
    assert cuda.fattn_kernel(_fa(1, 4096, "F16", "F16")) == "vec"
    assert cuda.fattn_kernel(_fa(4, 4096, "F16", "F16")) == "mma"
    assert cuda.fattn_kernel(_fa(512, 4096, head=48)) is None  # no kernel for head size 48
    assert cuda.fattn_kernel(_fa(512, 4096, "IQ4_NL", "IQ4_NL")) is None  # not a K/V type the kernels read
    assert not cuda.cuda_supports_op(_fa(512, 4096, head=48)) and cuda.cuda_supports_op(_fa(512, 4096))


def test_flash_attention_scratch_holds_f16_copies_of_a_quantized_cache() -> None:
    node = _fa(512, 4096)
    out = node.nbytes  # 64 × 16 × 512 f32 = 2 MiB
    assert out == 2 * MIB
    # K and V views: 64 × 4096 × 4 elements each, converted to f16
    assert cuda.cuda_alloc_size(node) == out + 2 * (64 * 4096 * 4 * 2)
    assert cuda.cuda_alloc_size(_fa(512, 4096, "F16", "F16")) == out  # nothing to convert
    assert cuda.cuda_alloc_size(_fa(512, 4096, "Q8_0", "F16")) == out + 64 * 4096 * 4 * 2  # K only
    assert cuda.cuda_alloc_size(_fa(2, 4096)) == _fa(2, 4096).nbytes  # the vector kernel reads q8_0 as it is


def test_quantized_rows_pad_to_512_elements() -> None:
    assert cuda.cuda_alloc_size(g.new("Q8_0", 2880, 10)) == 2880 // 32 * 34 * 10 + (512 - 2880 % 512) // 32 * 34
    assert cuda.cuda_alloc_size(g.new("Q8_0", 1024, 10)) == 1024 // 32 * 34 * 10
    assert cuda.cuda_alloc_size(g.new("F32", 2880, 10)) == 2880 * 4 * 10


def test_op_offload_gives_a_cuda_device_a_compute_buffer_with_nothing_offloaded() -> None:
    spec = load_model_spec(str(model_file("demo")))
    dev = (Device("CUDA0", CUDA, 8192 * MIB, 8192 * MIB),)

    def device_compute(*flags: str) -> int:
        return estimate(spec, parse_launch_flags(["-c", "4096", "-ngl", "0", *flags]), dev).totals()["CUDA0"].compute

    assert device_compute("-ub", "512") > 0  # the prompt's big ops run on the GPU, their weights copied in
    assert device_compute("-ub", "512", "--no-op-offload") == 0
    assert device_compute("-ub", "16", "-b", "16") < device_compute("-ub", "512")


def test_the_offload_batch_follows_ggml_op_offload_min_batch() -> None:
    spec = load_model_spec(str(model_file("demo")))
    flags = parse_launch_flags(["-c", "4096", "-ngl", "all", "-cmoe", "-ub", "64", "-b", "64"])
    dev = (Device("CUDA0", CUDA, 8192 * MIB, 8192 * MIB),)
    copies = estimate(spec, flags, dev).totals()["CUDA0"].compute
    fewer = estimate(spec, flags, with_offload_min_batch(dev, "128")).totals()["CUDA0"].compute
    none = estimate(spec, flags, with_offload_min_batch(dev, "100000")).totals()["CUDA0"].compute
    assert none < fewer < copies  # at -ub 64 only ops of more rows (expert biases: 4 experts × 64 tokens) move
    assert none == estimate(spec, replace(flags, no_op_offload=True), dev).totals()["CUDA0"].compute
    assert with_offload_min_batch(dev, None) == dev
    # ggml-cuda reads it with atoi: "" and "lots" are 0, so every op with a host weight moves, even at -ub 1
    every = estimate(spec, flags, with_offload_min_batch(dev, "lots")).totals()["CUDA0"].compute
    assert every == estimate(spec, flags, with_offload_min_batch(dev, "")).totals()["CUDA0"].compute
    assert every >= copies
    assert (offload_min_batch(None), offload_min_batch(" 64x"), offload_min_batch("-3")) == (32, 64, -3)
