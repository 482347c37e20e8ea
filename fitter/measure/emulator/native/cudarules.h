/*
 * cudarules.h: the rules of llama.cpp's CUDA backend (0c1e570) that decide memory, for an emulated device that is
 * not CUDA. Included by capdev.c (the RPC server: buffer alignment and allocation sizes) and cudadev.c (the
 * client: which ops a device runs and which it takes over from the CPU).
 *
 * The emulated GPU is an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell), which decides
 * the flash-attention kernel and with it the scratch space: kernel choices of older GPUs (Volta's tile kernel,
 * pre-Ada vector-kernel rules), AMD's and the build option GGML_CUDA_FA_QUANTS are not reproduced.
 *
 * Only the layout of struct ggml_tensor (ggml/include/ggml.h) and the op numbers are assumed; the op numbers are
 * checked against the loaded libggml-base (ggml_op_name) before anything is patched or answered.
 */
#ifndef FITTER_CUDARULES_H
#define FITTER_CUDARULES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define CR_MAX_DIMS 4
#define CR_MAX_OP_PARAMS 64
#define CR_MAX_SRC 10
#define CR_MAX_NAME 64

/* ggml/include/ggml.h struct ggml_tensor, llama.cpp 0c1e570 */
struct cr_tensor {
    int32_t type;
    void * buffer;
    int64_t ne[CR_MAX_DIMS];
    size_t nb[CR_MAX_DIMS];
    int32_t op;
    int32_t op_params[CR_MAX_OP_PARAMS / sizeof(int32_t)];
    int32_t flags;
    struct cr_tensor * src[CR_MAX_SRC];
    struct cr_tensor * view_src;
    size_t view_offs;
    void * data;
    char name[CR_MAX_NAME];
    void * extra;
    char padding[8];
};

/* enum ggml_op (ggml/include/ggml.h) at 0c1e570; cr_check_ops() compares them with the library's names */
enum {
    CR_OP_MUL_MAT = 29,
    CR_OP_MUL_MAT_ID = 30,
    CR_OP_GET_ROWS = 40,
    CR_OP_ROPE = 48,
    CR_OP_ROPE_BACK = 49,
    CR_OP_FLASH_ATTN_EXT = 74,
};

/* enum ggml_type (stable, the GGUF numbering) */
enum { CR_F32 = 0, CR_F16 = 1, CR_Q4_0 = 2, CR_Q4_1 = 3, CR_Q5_0 = 6, CR_Q5_1 = 7, CR_Q8_0 = 8, CR_BF16 = 30 };

#define CR_MATRIX_ROW_PADDING 512 /* ggml/src/ggml-cuda/common.cuh */
#define CR_FATTN_KQ_STRIDE 256    /* ggml/src/ggml-cuda/fattn-common.cuh */
#define CR_ALIGNMENT 128          /* ggml_backend_cuda_buffer_type_get_alignment */

/* The ggml functions the rules need, resolved from the loaded libggml-base by the includer. */
struct cr_ggml {
    const char * (*op_name)(int op);
    bool (*is_quantized)(int type);
    size_t (*nbytes)(const struct cr_tensor * t);
    int64_t (*nelements)(const struct cr_tensor * t);
    int64_t (*nrows)(const struct cr_tensor * t);
    size_t (*row_size)(int type, int64_t ne);
    size_t (*element_size)(const struct cr_tensor * t);
};

static inline bool cr_check_ops(const struct cr_ggml * g) {
    static const struct { int op; const char * name; } ops[] = {
        {CR_OP_MUL_MAT, "MUL_MAT"}, {CR_OP_MUL_MAT_ID, "MUL_MAT_ID"}, {CR_OP_GET_ROWS, "GET_ROWS"},
        {CR_OP_ROPE, "ROPE"}, {CR_OP_ROPE_BACK, "ROPE_BACK"}, {CR_OP_FLASH_ATTN_EXT, "FLASH_ATTN_EXT"},
    };
    for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++) {
        const char * name = g->op_name(ops[i].op);
        if (name == NULL || strcmp(name, ops[i].name) != 0) {
            return false;
        }
    }
    return true;
}

/* ggml-cuda.cu get_op_batch_size, as ggml_backend_cuda_device_offload_op compares it with
 * GGML_OP_OFFLOAD_MIN_BATCH (default 32). */
static inline int64_t cr_op_batch_size(const struct cr_ggml * g, const struct cr_tensor * op) {
    switch (op->op) {
        case CR_OP_GET_ROWS:
            return 0;
        case CR_OP_MUL_MAT:
            return op->ne[1];
        case CR_OP_MUL_MAT_ID:
        case CR_OP_ROPE:
        case CR_OP_ROPE_BACK:
            return op->ne[2];
        default:
            return g->nrows(op);
    }
}

enum cr_fattn_kernel { CR_FATTN_NONE, CR_FATTN_VEC, CR_FATTN_MMA_F16 };

static inline bool cr_fattn_kv_type_supported(int type) {
    switch (type) {
        case CR_F32: case CR_F16: case CR_BF16: case CR_Q4_0: case CR_Q4_1: case CR_Q5_0: case CR_Q5_1: case CR_Q8_0:
            return true;
        default:
            return false;
    }
}

/* fattn.cu ggml_cuda_get_best_fattn_kernel on an NVIDIA GPU with Turing tensor cores and cc >= 8.9 (Ada). Not
 * modelled: the MMA kernel's sparse decode path (unquantized K/V with GQA > 4 at one token: it would convert a
 * bf16 or f32 cache where the vector kernel does not), and the default build's vector kernels existing only for
 * equal K/V types (GGML_CUDA_FA_QUANTS), so a mixed cache (-ctk q8_0 with an f16 V) would need f16 copies at one
 * token. Both matter only in the one-token graph; the prompt graph, reserved first, sizes the buffer. */
static inline enum cr_fattn_kernel cr_fattn_kernel(const struct cr_ggml * g, const struct cr_tensor * dst) {
    const struct cr_tensor * Q = dst->src[0];
    const struct cr_tensor * K = dst->src[1];
    const struct cr_tensor * V = dst->src[2];
    const struct cr_tensor * mask = dst->src[3];
    if (Q == NULL || K == NULL || V == NULL || K->ne[2] == 0 || Q->ne[2] % K->ne[2] != 0) {
        return CR_FATTN_NONE;
    }
    const int64_t gqa_ratio = Q->ne[2] / K->ne[2];
    float max_bias = 0.0f;
    memcpy(&max_bias, &dst->op_params[1], sizeof(float));
    bool gqa_opt_applies = gqa_ratio >= 2 && mask != NULL && max_bias == 0.0f && K->ne[1] % CR_FATTN_KQ_STRIDE == 0;
    const struct cr_tensor * ts[4] = {Q, K, V, mask};
    for (int t = 0; t < 4; t++) {
        if (ts[t] == NULL || g->is_quantized(ts[t]->type)) {
            continue;
        }
        for (int i = 1; i < CR_MAX_DIMS; i++) {
            if (ts[t]->nb[i] % 16 != 0) {
                gqa_opt_applies = false;
            }
        }
    }
    switch (K->ne[0]) {
        case 40: case 64: case 72: case 80: case 96: case 128: case 112: case 256:
            if (V->ne[0] != K->ne[0]) return CR_FATTN_NONE;
            break;
        case 192:
            if (V->ne[0] != 128 || !gqa_opt_applies || gqa_ratio % 8 != 0) return CR_FATTN_NONE;
            break;
        case 320:
            if (V->ne[0] != 256 || !gqa_opt_applies || gqa_ratio % 32 != 0) return CR_FATTN_NONE;
            break;
        case 512:
            if (V->ne[0] != K->ne[0] || !gqa_opt_applies) return CR_FATTN_NONE;
            break;
        case 576:
            if (V->ne[0] != 512 || !gqa_opt_applies) return CR_FATTN_NONE;
            break;
        default:
            return CR_FATTN_NONE;
    }
    if (!cr_fattn_kv_type_supported(K->type) || !cr_fattn_kv_type_supported(V->type)) {
        return CR_FATTN_NONE;
    }
    if (mask != NULL && mask->ne[2] != 1) {
        return CR_FATTN_NONE;
    }
    const bool can_use_vector_kernel = Q->ne[0] <= 256 && Q->ne[0] % 64 == 0 && Q->ne[0] != 192 &&
                                       K->ne[1] % CR_FATTN_KQ_STRIDE == 0;
    if (Q->ne[0] != 40 && Q->ne[0] != 72) { /* turing_mma_available */
        if (can_use_vector_kernel) {
            if (!g->is_quantized(K->type) && !g->is_quantized(V->type)) {
                if (Q->ne[1] == 1 && Q->ne[3] == 1 && !(gqa_ratio > 4 && (Q->ne[0] >= 256 || K->ne[1] >= 8192))) {
                    return CR_FATTN_VEC;
                }
            } else if (Q->ne[1] <= 2) {
                return CR_FATTN_VEC;
            }
            if (!gqa_opt_applies && Q->ne[1] == 1) {
                return CR_FATTN_VEC;
            }
        }
        return CR_FATTN_MMA_F16;
    }
    /* head sizes 40 and 72 without tensor cores: the tile kernel, which converts like the MMA one */
    return CR_FATTN_MMA_F16;
}

static inline size_t cr_pad(size_t x, size_t n) {
    return (x + n - 1) / n * n;
}

/* ggml_backend_cuda_buffer_type_get_alloc_size (ggml-cuda.cu) with ggml_cuda_flash_attn_ext_get_alloc_size
 * (fattn.cu) and ggml_cuda_flash_attn_ext_get_f16_extra_data (fattn-common.cuh): a flash-attention node gets room
 * for an f16 copy of K and V where its kernel needs one; a quantized tensor pads its last row to 512 elements. */
static inline size_t cr_alloc_size(const struct cr_ggml * g, const struct cr_tensor * t) {
    size_t size = g->nbytes(t);
    if (t->op == CR_OP_FLASH_ATTN_EXT && t->src[1] != NULL && t->src[2] != NULL) {
        const struct cr_tensor * K = t->src[1];
        const struct cr_tensor * V = t->src[2];
        const enum cr_fattn_kernel kernel = cr_fattn_kernel(g, t);
        /* the vector kernel converts only F32 (its compiled K/V cases are assumed present; see cr_fattn_kernel) */
        const bool need_k = kernel == CR_FATTN_MMA_F16 || (kernel == CR_FATTN_VEC && K->type == CR_F32);
        const bool need_v = kernel == CR_FATTN_MMA_F16 || (kernel == CR_FATTN_VEC && V->type == CR_F32);
        const bool v_is_k_view = V->view_src != NULL &&
            (V->view_src == K || (V->view_src == K->view_src && V->view_offs == K->view_offs));
        uintptr_t end = (uintptr_t) t->data + size;
        if (need_k && K->type != CR_F16) {
            end = cr_pad(end, 128) + (size_t) g->nelements(K) * 2;
        }
        if (need_v && V->type != CR_F16 && !v_is_k_view) {
            end = cr_pad(end, 128) + (size_t) g->nelements(V) * 2;
        }
        size = end - (uintptr_t) t->data;
    }
    if (g->is_quantized(t->type) && t->ne[0] % CR_MATRIX_ROW_PADDING != 0) {
        size += g->row_size(t->type, CR_MATRIX_ROW_PADDING - t->ne[0] % CR_MATRIX_ROW_PADDING);
    }
    return size;
}

#endif /* FITTER_CUDARULES_H */
