"""The rules of llama.cpp's CUDA backend (0c1e570) that decide memory, on fitter's shape-only graph tensors.

The same rules, in C, make fitter's CUDA-shaped emulated GPU (fitter/measure/emulator/native/cudarules.h): the emulator
lets llama.cpp itself allocate with them, this module lets the estimator predict it; tests/golden/cuda-emulated.json
holds them to each other. Each rule names the function it mirrors:

- `alloc_size`: ggml/src/ggml-cuda/ggml-cuda.cu `ggml_backend_cuda_buffer_type_get_alloc_size`: a quantized
  tensor's last row is padded to 512 elements (MATRIX_ROW_PADDING); a FLASH_ATTN_EXT node gets room for f16 copies
  of K and V where its kernel needs them (fattn.cu `ggml_cuda_flash_attn_ext_get_alloc_size`, fattn-common.cuh
  `ggml_cuda_flash_attn_ext_get_f16_extra_data`): 2 bytes per element of the K (and V) view, which spans the whole
  cache in the worst-case graph.
- `fattn_kernel` / `cuda_supports_op`: fattn.cu `ggml_cuda_get_best_fattn_kernel` for an NVIDIA GPU of compute
  capability 8.9 or newer (other generations choose other kernels: not modelled); no kernel = the op is not
  supported there, so the scheduler runs it on the CPU and `-fa auto` turns flash attention off. Not modelled
  either, in the one-token graph only: the MMA kernel's sparse decode path (bf16/f32 caches, GQA > 4) and the
  default build's vector kernels existing for equal K/V types only (a mixed cache would be converted).
- `op_batch_size`: ggml-cuda.cu `get_op_batch_size`; an op with a host weight whose batch reaches
  GGML_OP_OFFLOAD_MIN_BATCH (32; `DeviceProfile.offload_min_batch`) runs on the GPU
  (`ggml_backend_cuda_device_offload_op`), which copies the weight into its compute buffer (fitter.memory.graph.sched).
"""

from __future__ import annotations

from fitter.memory.graph.ggml_graph import Tensor, type_size

ROW_PADDING = 512  # common.cuh MATRIX_ROW_PADDING
FATTN_KQ_STRIDE = 256  # fattn-common.cuh
_FA_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"})  # fattn_kv_type_supported


def _quantized(type_name: str) -> bool:
    return type_size(type_name)[0] > 1


def _nelements(t: Tensor) -> int:
    return t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]


def _row_bytes(type_name: str, n: int) -> int:
    block, size = type_size(type_name)
    return n // block * size


def op_batch_size(t: Tensor) -> int:
    if t.op == "GET_ROWS":
        return 0
    if t.op == "MUL_MAT":
        return t.ne[1]
    if t.op in ("MUL_MAT_ID", "ROPE", "ROPE_BACK"):
        return t.ne[2]
    return t.ne[1] * t.ne[2] * t.ne[3]  # ggml_nrows


def fattn_kernel(dst: Tensor) -> str | None:
    """"vec", "mma" or None (no kernel: not supported on the GPU)."""
    q, k, v, mask = (list(dst.src) + [None] * 4)[:4]
    if q is None or k is None or v is None or not k.ne[2] or q.ne[2] % k.ne[2]:
        return None
    gqa_ratio = q.ne[2] // k.ne[2]
    gqa_opt = gqa_ratio >= 2 and mask is not None and k.ne[1] % FATTN_KQ_STRIDE == 0  # max_bias 0: no ALiBi here
    for t in (q, k, v, mask):
        if t is not None and not _quantized(t.type) and any(nb % 16 for nb in t.nb[1:]):
            gqa_opt = False
    d, dv = k.ne[0], v.ne[0]
    if d in (40, 64, 72, 80, 96, 112, 128, 256):
        ok = dv == d
    elif d == 192:
        ok = dv == 128 and gqa_opt and gqa_ratio % 8 == 0
    elif d == 320:
        ok = dv == 256 and gqa_opt and gqa_ratio % 32 == 0
    elif d == 512:
        ok = dv == d and gqa_opt
    elif d == 576:
        ok = dv == 512 and gqa_opt
    else:
        ok = False
    if not ok or k.type not in _FA_TYPES or v.type not in _FA_TYPES or (mask is not None and mask.ne[2] != 1):
        return None
    vector_ok = q.ne[0] <= 256 and q.ne[0] % 64 == 0 and q.ne[0] != 192 and k.ne[1] % FATTN_KQ_STRIDE == 0
    if q.ne[0] not in (40, 72) and vector_ok:  # Turing tensor cores, cc >= Ada
        if not _quantized(k.type) and not _quantized(v.type):
            if q.ne[1] == 1 and q.ne[3] == 1 and not (gqa_ratio > 4 and (q.ne[0] >= 256 or k.ne[1] >= 8192)):
                return "vec"
        elif q.ne[1] <= 2:
            return "vec"
        if not gqa_opt and q.ne[1] == 1:
            return "vec"
    return "mma"  # the MMA kernel (the tile kernel for head sizes 40 and 72 converts alike)


def cuda_supports_op(t: Tensor) -> bool:
    """ggml_backend_cuda_device_supports_op, for the ops whose support differs from the CPU's here."""
    return t.op != "FLASH_ATTN_EXT" or fattn_kernel(t) is not None


def cuda_alloc_size(t: Tensor) -> int:
    size = t.nbytes
    if t.op == "FLASH_ATTN_EXT" and len(t.src) >= 3 and t.src[1] is not None and t.src[2] is not None:
        k, v = t.src[1], t.src[2]
        kernel = fattn_kernel(t)
        need_k = kernel == "mma" or (kernel == "vec" and k.type == "F32")
        need_v = kernel == "mma" or (kernel == "vec" and v.type == "F32")
        v_is_k_view = v.view_src is not None and (v.view_src is k or (v.view_src is k.view_src
                                                                      and v.view_offs == k.view_offs))
        if need_k and k.type != "F16":
            size = _pad(size, 128) + _nelements(k) * 2
        if need_v and v.type != "F16" and not v_is_k_view:
            size = _pad(size, 128) + _nelements(v) * 2
    if _quantized(t.type) and t.ne[0] % ROW_PADDING:
        size += _row_bytes(t.type, ROW_PADDING - t.ne[0] % ROW_PADDING)
    return size


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n
