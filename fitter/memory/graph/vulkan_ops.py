"""The rules of llama.cpp's Vulkan backend (0c1e570) that decide where ops run, on fitter's shape-only tensors.

`supports` mirrors ggml/src/ggml-vulkan/ggml-vulkan.cpp `ggml_backend_vk_device_supports_op` for the ops fitter's
graphs build (fitter.memory.graph.graphs); the scheduler skips a device that does not support an op, and a weight
or KV cache in the device's buffer whose op it cannot run is copied to (or, pre-allocated, aborts) as
ggml-backend.cpp does (fitter.memory.graph.sched):

- `tensor_size_supported`: every source and the result at most the device's `maxBufferSize` and, for ops without
  64-bit indexing (all fitter builds), its `maxStorageBufferRange` (lavapipe: 128 MiB; real GPUs 2-4 GiB). A large
  vocabulary's logits or output weight, a long context's KQ scores or K/V cache cannot be used by such a device's
  ops.
- FLASH_ATTN_EXT: K and V head sizes multiples of 8; Q and the result f32; the mask f16 and the sinks f32; K and V
  of f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0 or iq4_nl, both bf16 or neither. (The scalar path also needs
  subgroup shuffle and vote, which every Vulkan 1.1+ GPU fitter knows has, lavapipe included: not modelled.)
- MUL_MAT and MUL_MAT_ID: the weight's type among the backend's matmul types; the fourth dimensions equal; a
  quantized operand contiguous in its first two dimensions (`ggml_vk_dim01_contiguous`); no bf16 × f16, no bf16
  activations against another type. MUL_MAT_ID also needs a matmul tile that fits the device's shared memory
  (`mul_mat_id_s/m/l`): every GPU fitter knows and lavapipe (32 KiB) have one for the types here; not modelled.
- GET_ROWS, SET_ROWS, CONT/CPY, SOFT_MAX, SCALE, SUM_ROWS, ROPE, ARGSORT: the types and layouts of the same
  function. ARGSORT over more columns than a workgroup needs the Vulkan memory model, which every driver fitter
  knows has (lavapipe included); not modelled.
- GATED_DELTA_NET: value heads of 16, 32, 64 or 128 elements, every source f32.
Every other op fitter builds (element-wise f32 ops, norms, GLU, views) is supported for the f32 tensors it builds.
"""

from __future__ import annotations

from fitter.memory.graph.ggml_graph import Tensor, type_size
from fitter.memory.graph.ggml_graph import data_tensor as _data_tensor
from fitter.memory.graph.ggml_graph import new as new_tensor

_MATMUL_TYPES = frozenset({
    "F32", "F16", "BF16", "Q1_0", "Q2_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
    "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS", "IQ4_NL", "MXFP4", "NVFP4",
    "TQ1_0", "TQ2_0",
})
_GET_ROWS_TYPES = _MATMUL_TYPES | {"I32"}
_FA_KV_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "IQ4_NL"})
_SET_ROWS_TYPES = frozenset({"F32", "F16", "BF16", "Q1_0", "Q2_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"})
_FLOAT = frozenset({"F32", "F16"})


def _quantized(type_name: str) -> bool:
    return type_size(type_name)[0] > 1


def dim01_contiguous(t: Tensor) -> bool:
    """ggml_vk_dim01_contiguous."""
    block, size = type_size(t.type)
    return (t.nb[0] == size and t.nb[1] == t.nb[0] * t.ne[0] // block
            and (t.ne[3] == 1 or t.nb[3] == t.nb[2] * t.ne[2]))


def is_contiguous(t: Tensor) -> bool:
    """ggml_is_contiguous (ggml_is_contiguous_n with n = 0): every stride as a packed tensor's, dimensions of size
    one skipped."""
    block, size = type_size(t.type)
    expected = size
    if t.ne[0] != block and t.nb[0] != size:
        return False
    expected = size * t.ne[0] // block
    for i in range(1, 4):
        if t.ne[i] != 1:
            if t.nb[i] != expected:
                return False
            expected *= t.ne[i]
    return True


def contiguous_rows(t: Tensor) -> bool:
    """ggml_is_contiguous_rows: the elements of a row adjacent."""
    return t.ne[0] == type_size(t.type)[0] or t.nb[0] == type_size(t.type)[1]


def size_supported(t: Tensor, max_bytes: int | None) -> bool:
    """`tensor_size_supported` for the op and each of its sources."""
    return max_bytes is None or all(s is None or s.nbytes <= max_bytes for s in (t, *t.src))


def vulkan_supports_op(t: Tensor, max_bytes: int | None) -> bool:
    """ggml_backend_vk_device_supports_op for the ops fitter builds; `max_bytes`: the smaller of the device's
    maxStorageBufferRange and maxBufferSize (None: no limit)."""
    if not size_supported(t, max_bytes):
        return False
    op, src = t.op, t.src
    if op == "FLASH_ATTN_EXT":
        q, k, v = src[0], src[1], src[2]
        mask = src[3] if len(src) > 3 else None
        sinks = src[4] if len(src) > 4 else None
        if q is None or k is None or v is None or k.ne[0] % 8 or v.ne[0] % 8:
            return False
        if q.type != "F32" or t.type != "F32" or (mask is not None and mask.type != "F16"):
            return False
        if sinks is not None and sinks.type != "F32":
            return False
        return k.type in _FA_KV_TYPES and v.type in _FA_KV_TYPES and (k.type == "BF16") == (v.type == "BF16")
    if op in ("MUL_MAT", "MUL_MAT_ID"):
        w, b = src[0], src[1]
        if w is None or b is None or w.type not in _MATMUL_TYPES:
            return False
        a = w if op == "MUL_MAT" else src[2]
        if a is None or a.ne[3] != b.ne[3]:
            return False
        if not (dim01_contiguous(w) or w.type in ("F32", "F16", "BF16")):
            return False
        if not (dim01_contiguous(b) or b.type in _FLOAT):
            return False
        return not (w.type == "BF16" and b.type == "F16") and not (b.type == "BF16" and w.type != "BF16")
    if op == "GET_ROWS":
        return src[0] is not None and src[0].type in _GET_ROWS_TYPES
    if op == "SET_ROWS":
        rows, idxs = src[1], src[2]
        return (rows is not None and idxs is not None and rows.type in _FLOAT and idxs.type in ("I32", "I64")
                and t.type in _SET_ROWS_TYPES)
    if op == "CONT":  # CONT has no second source: ggml-vulkan reads it as a copy to the same type
        s = src[0]
        if s is None:
            return False
        if s.type in ("F32", "F16"):
            return True
        return (not _quantized(s.type) or (is_contiguous(s) and is_contiguous(t))) and type_size(s.type)[1] % 2 == 0
    if op in ("SOFT_MAX", "SCALE"):
        return src[0] is not None and is_contiguous(src[0]) and src[0].type == "F32"
    if op == "SUM_ROWS":
        return src[0] is not None and src[0].type == "F32" and contiguous_rows(src[0])
    if op == "ROPE":
        return src[0] is not None and contiguous_rows(t) and contiguous_rows(src[0])
    if op == "GATED_DELTA_NET":  # value heads of 16, 32, 64 or 128, every source F32
        v = src[2] if len(src) > 2 else None
        return (v is not None and v.ne[0] in (16, 32, 64, 128) and t.type == "F32"
                and all(s is not None and s.type == "F32" for s in src[:6]))
    if op == "ARGSORT":
        return src[0] is not None and is_contiguous(t) and is_contiguous(src[0])
    return True


def data_weight(type_name: str, ne: tuple[int, ...]) -> Tensor:
    return _data_tensor(type_name, *ne)


def weight_supported(type_name: str, ne: tuple[int, ...], op: str, n_expert_used: int, max_bytes: int | None) -> bool:
    """Whether llama.cpp's loader puts a weight in a Vulkan device's buffer (src/llama-model-loader.cpp
    `weight_buft_supported`): the weight's op, built on a 512-token dummy activation, must be one the device runs.
    `op` is the loader's test op for the weight: "mul_mat", "mul_mat_id", "add" (a bias), "add_id" (an expert bias),
    "get_rows", else an element-wise op on the weight's own shape (a norm's MUL)."""
    w = data_weight(type_name, ne)
    n, used = 512, max(1, n_expert_used)
    if op == "mul_mat":
        b = new_tensor("F32", w.ne[0], n, w.ne[2], w.ne[3])
        t = new_tensor("F32", w.ne[1], n, w.ne[2], w.ne[3], op="MUL_MAT", src=(w, b))
    elif op == "mul_mat_id":
        b = new_tensor("F32", w.ne[0], used, n)
        ids = new_tensor("I32", used, n)
        t = new_tensor("F32", w.ne[1], used, n, op="MUL_MAT_ID", src=(w, b, ids))
    elif op == "add_id":
        a = new_tensor("F32", w.ne[0], used, n)
        ids = new_tensor("I32", used, n)
        t = new_tensor("F32", w.ne[0], used, n, op="ADD_ID", src=(a, w, ids))
    elif op == "get_rows":
        rows = new_tensor("I32", n)
        t = new_tensor("F32", w.ne[0], n, op="GET_ROWS", src=(w, rows))
    else:
        a = new_tensor("F32", *w.ne)
        t = new_tensor("F32", *w.ne, op="ADD" if op == "add" else "MUL", src=(a, w))
    return vulkan_supports_op(t, max_bytes)
