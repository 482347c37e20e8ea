/*
 * cudadev: makes an RPC device in this (client) process behave like a CUDA device towards llama.cpp's scheduler
 * and model loader, so llama.cpp itself places tensors and sizes compute buffers as a CUDA build would.
 *
 * Loaded with ctypes into the process that runs llama.cpp (fitter/measure/capi.py), after the RPC server is
 * registered; `fitter_cudadev_patch(dev, cpu_buft, min_batch)` rewrites three entries of the device's interface
 * (struct ggml_backend_device_i in ggml/src/ggml-backend-impl.h, llama.cpp 0c1e570), which the RPC backend leaves
 * NULL or answers for every op, and one of its buffer type's:
 *
 *   get_alloc_size        ggml_backend_cuda_buffer_type_get_alloc_size (cudarules.h cr_alloc_size): row padding
 *                         and flash-attention scratch, computed for each tensor (the RPC client would ask its
 *                         server once per output shape and reuse the answer for nodes whose K/V differ).
 *
 *   offload_op            ggml_backend_cuda_device_offload_op: an op whose weight lives in a host buffer runs on
 *                         the device when its batch is at least GGML_OP_OFFLOAD_MIN_BATCH (32); the scheduler then
 *                         copies the weight into the device's compute buffer (ggml-backend.cpp
 *                         ggml_backend_sched_backend_id_from_cur, "1.off").
 *   get_host_buffer_type  ggml_backend_cuda_device_get_host_buffer_type: a pinned host buffer type "CUDA_Host"
 *                         (here the CPU buffer type under that name), which llama.cpp puts before CPU_REPACK in
 *                         the CPU buffer list (src/llama-model.cpp make_cpu_buft_list) and uses for the CPU
 *                         backend's compute and the output buffers (src/llama-context.cpp).
 *   supports_op           ggml_backend_cuda_device_supports_op for FLASH_ATTN_EXT (the kernels' head sizes and
 *                         K/V types, cudarules.h), so `-fa auto` decides as on CUDA; every other op as before.
 *
 * The alignment (128) and the buffers' base addresses are the server's (capdev.c with FITTER_CAPDEV_CUDA=1). Not reproduced: CUDA's memory pool, its context and cuBLAS workspaces
 * (outside llama.cpp's buffers), graph_optimize's fused-MoE dependencies, kernel choices of other GPU generations.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cudarules.h"

/* ggml/src/ggml-backend-impl.h at 0c1e570 */
struct buft_iface {
    const char * (*get_name)(void * buft);
    void * (*alloc_buffer)(void * buft, size_t size);
    size_t (*get_alignment)(void * buft);
    size_t (*get_max_size)(void * buft);
    size_t (*get_alloc_size)(void * buft, const struct cr_tensor * tensor);
    bool (*is_host)(void * buft);
};

struct buft {
    struct buft_iface iface;
    void * device;
    void * context;
};

struct device_iface {
    const char * (*get_name)(void * dev);
    const char * (*get_description)(void * dev);
    void (*get_memory)(void * dev, size_t * free, size_t * total);
    int (*get_type)(void * dev);
    void (*get_props)(void * dev, void * props);
    void * (*init_backend)(void * dev, const char * params);
    void * (*get_buffer_type)(void * dev);
    void * (*get_host_buffer_type)(void * dev);
    void * (*buffer_from_host_ptr)(void * dev, void * ptr, size_t size, size_t max_tensor_size);
    bool (*supports_op)(void * dev, const struct cr_tensor * op);
    bool (*supports_buft)(void * dev, void * buft);
    bool (*offload_op)(void * dev, const struct cr_tensor * op);
    void * (*event_new)(void * dev);
    void (*event_free)(void * dev, void * event);
    void (*event_synchronize)(void * dev, void * event);
};

struct device {
    struct device_iface iface;
    void * reg;
    void * context;
};

#define MAX_DEVICES 16

static struct cr_ggml g_ggml;
static int64_t g_min_batch = 32;
static struct buft g_host;  /* "CUDA_Host": the CPU buffer type under CUDA's name */
static int g_host_ready;
static struct {
    struct device * dev;
    bool (*supports_op)(void * dev, const struct cr_tensor * op);
} g_devices[MAX_DEVICES];
static int g_n_devices;

static size_t cuda_alloc_size(void * buft, const struct cr_tensor * tensor) {
    (void) buft;
    return cr_alloc_size(&g_ggml, tensor);
}

static const char * host_name(void * buft) {
    (void) buft;
    return "CUDA_Host"; /* GGML_CUDA_NAME "_Host", ggml_backend_cuda_host_buffer_type_name */
}

static bool host_is_host(void * buft) {
    (void) buft;
    return true;
}

static void * cuda_host_buffer_type(void * dev) {
    (void) dev;
    return &g_host;
}

static bool cuda_offload_op(void * dev, const struct cr_tensor * op) {
    (void) dev;
    return cr_op_batch_size(&g_ggml, op) >= g_min_batch;
}

static bool cuda_supports_op(void * dev, const struct cr_tensor * op) {
    if (op->op == CR_OP_FLASH_ATTN_EXT) {
        return cr_fattn_kernel(&g_ggml, op) != CR_FATTN_NONE;
    }
    for (int i = 0; i < g_n_devices; i++) {
        if (g_devices[i].dev == dev) {
            return g_devices[i].supports_op(dev, op);
        }
    }
    return false;
}

static int resolve_ggml(void) {
    void * base = dlopen("libggml-base.so.0", RTLD_NOW | RTLD_NOLOAD);
    if (base == NULL) {
        return 0;
    }
    g_ggml.op_name = (const char * (*)(int)) dlsym(base, "ggml_op_name");
    g_ggml.is_quantized = (bool (*)(int)) dlsym(base, "ggml_is_quantized");
    g_ggml.nbytes = (size_t (*)(const struct cr_tensor *)) dlsym(base, "ggml_nbytes");
    g_ggml.nelements = (int64_t (*)(const struct cr_tensor *)) dlsym(base, "ggml_nelements");
    g_ggml.nrows = (int64_t (*)(const struct cr_tensor *)) dlsym(base, "ggml_nrows");
    g_ggml.row_size = (size_t (*)(int, int64_t)) dlsym(base, "ggml_row_size");
    g_ggml.element_size = (size_t (*)(const struct cr_tensor *)) dlsym(base, "ggml_element_size");
    return g_ggml.op_name && g_ggml.is_quantized && g_ggml.nbytes && g_ggml.nelements && g_ggml.nrows &&
           g_ggml.row_size && g_ggml.element_size && cr_check_ops(&g_ggml);
}

/* 0 on success; 1: libggml-base is not loaded or its ops are not the ones these rules were written for;
 * 2: too many devices. `cpu_buft` is ggml_backend_cpu_buffer_type(); `min_batch` GGML_OP_OFFLOAD_MIN_BATCH. */
int fitter_cudadev_patch(void * dev, void * cpu_buft, int64_t min_batch) {
    if (!resolve_ggml()) {
        return 1;
    }
    if (g_n_devices >= MAX_DEVICES) {
        return 2;
    }
    if (!g_host_ready) {
        g_host = *(struct buft *) cpu_buft;
        g_host.iface.get_name = host_name;
        g_host.iface.is_host = host_is_host;
        /* CUDA's host type belongs to the device: the loader's "avoid using a host buffer when using mmap" test
         * (src/llama-model-loader.cpp) compares it with ggml_backend_dev_host_buffer_type(its device) */
        g_host.device = dev;
        g_host_ready = 1;
    }
    g_min_batch = min_batch;
    struct device * d = (struct device *) dev;
    g_devices[g_n_devices].dev = d;
    g_devices[g_n_devices].supports_op = d->iface.supports_op;
    g_n_devices++;
    struct buft * device_buft = (struct buft *) d->iface.get_buffer_type(d);
    if (device_buft != NULL) {
        device_buft->iface.get_alloc_size = cuda_alloc_size;
    }
    d->iface.offload_op = cuda_offload_op;
    d->iface.get_host_buffer_type = cuda_host_buffer_type;
    d->iface.supports_op = cuda_supports_op;
    return 0;
}
