/*
 * capdev: an LD_PRELOAD shim that turns a llama.cpp RPC server's CPU device into a small GPU.
 *
 * Loaded into the RPC *server* process only (fitter/measure/emulator/emulated_gpu.py starts it). It interposes the three ggml
 * functions the RPC server (ggml/src/ggml-rpc/ggml-rpc.cpp, llama.cpp 0c1e570) calls in libggml-base through
 * the dynamic linker (they are undefined symbols of libggml-rpc.so, so the calls go through its PLT):
 *
 *   ggml_backend_buft_alloc_buffer  rpc_server::alloc_buffer (RPC_CMD_ALLOC_BUFFER): refused (NULL) when the
 *                                   buffer would push the bytes in use past the cap; the client then fails the
 *                                   way it fails on a full GPU.
 *   ggml_backend_buffer_free        rpc_server::free_buffer (RPC_CMD_FREE_BUFFER) and ~rpc_server (a client
 *                                   disconnecting): the buffer's bytes are given back.
 *   ggml_backend_dev_memory         rpc_server::get_device_memory (RPC_CMD_GET_DEVICE_MEMORY) and the start-up
 *                                   banner: total = cap, free = cap - used. Every device in the process is
 *                                   answered so; the server process serves exactly one, the CPU device.
 *
 * With FITTER_CAPDEV_CUDA=1 the device's buffers are CUDA's: rpc_server::get_alignment (RPC_CMD_GET_ALIGNMENT)
 * answers 128 (ggml_backend_buft_get_alignment), and each buffer's base is 256-byte aligned as cudaMalloc's. The
 * sizes of CUDA's tensors are the client's to compute (fitter/measure/emulator/native/cudadev.c): the RPC client caches the
 * server's answer per output shape, which would give every flash-attention node of a model the first one's scratch.
 *
 * Environment:
 *   FITTER_CAPDEV_CAP_BYTES  the cap in bytes (decimal). Unset: nothing is capped, only counted.
 *   FITTER_CAPDEV_CUDA       1: CUDA's alignment and aligned buffers (above). Unset: the CPU's.
 *   FITTER_CAPDEV_STATS      a file the counters live in (mmap'd, MAP_SHARED), so the parent reads them. Unset:
 *                            the counters are private to this process.
 *
 * The counters are 64-bit words in a seqlock (layout: STATS_* below, mirrored in emulated_gpu.py): the shim is
 * their only writer, except the word STATS_RESET_REQ which the parent bumps to ask for peak := used.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define STATS_MAGIC 0x3156454450414346ULL /* "FCAPDEV1" little-endian */
#define STATS_SIZE 4096

enum {
    STATS_MAGIC_W = 0,
    STATS_VERSION,
    STATS_SEQ,            /* odd while the shim writes */
    STATS_CAP,
    STATS_USED,
    STATS_PEAK,
    STATS_REFUSED,        /* allocations refused by the cap */
    STATS_LAST_REFUSED,   /* bytes asked for by the last refused allocation */
    STATS_ALLOCS,         /* successful allocations counted */
    STATS_LIVE,           /* buffers counted and not yet freed */
    STATS_RESET_REQ,      /* written by the parent: bumped to ask for peak := used */
    STATS_RESET_SEEN,     /* the last STATS_RESET_REQ the shim applied */
    STATS_PID,            /* the server's pid */
    STATS_MEMORY_QUERIES, /* ggml_backend_dev_memory calls answered */
    STATS_WORDS
};

typedef void * (*alloc_fn)(void * buft, size_t size);
typedef void (*free_fn)(void * buffer);
typedef void (*memory_fn)(void * dev, size_t * free, size_t * total);

struct live_buffer {
    void * ptr;
    uint64_t size;
    void * data; /* memory the shim allocated itself (CUDA mode), freed with the buffer; NULL otherwise */
};

static int cuda_mode(void);
static void * cuda_alloc(size_t size, void ** data);
void ggml_backend_buffer_free(void * buffer);

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static uint64_t g_private[STATS_WORDS];
static volatile uint64_t * g_stats = g_private;
static uint64_t g_cap = UINT64_MAX;
static struct live_buffer * g_live;
static size_t g_n_live, g_cap_live;

static alloc_fn real_alloc;
static free_fn real_free;
static memory_fn real_memory;

/* The next definition after this shim (libggml-base.so.0). RTLD_NEXT finds it when libggml-base is in the
 * global scope; ctypes loads libraries RTLD_LOCAL, so fall back to the already-loaded libggml-base by soname. */
static void * resolve(const char * name, void * self) {
    void * fn = dlsym(RTLD_NEXT, name);
    if (fn == NULL || fn == self) {
        void * base = dlopen("libggml-base.so.0", RTLD_NOW | RTLD_NOLOAD);
        fn = base ? dlsym(base, name) : NULL;
    }
    return fn == self ? NULL : fn;
}

static void init_stats(void) {
    const char * cap = getenv("FITTER_CAPDEV_CAP_BYTES");
    if (cap != NULL && *cap != '\0') {
        g_cap = strtoull(cap, NULL, 10);
    }
    const char * path = getenv("FITTER_CAPDEV_STATS");
    if (path != NULL && *path != '\0') {
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        if (fd >= 0) {
            struct stat st;
            if (fstat(fd, &st) == 0 && st.st_size < STATS_SIZE && ftruncate(fd, STATS_SIZE) != 0) {
                close(fd);
                fd = -1;
            }
            if (fd >= 0) {
                void * p = mmap(NULL, STATS_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
                close(fd);
                if (p != MAP_FAILED) {
                    g_stats = (volatile uint64_t *) p;
                }
            }
        }
    }
    g_stats[STATS_VERSION] = 1;
    g_stats[STATS_CAP] = g_cap;
    g_stats[STATS_PID] = (uint64_t) getpid();
    __atomic_store_n(&g_stats[STATS_MAGIC_W], STATS_MAGIC, __ATOMIC_RELEASE);
}

static void init_once(void) {
    pthread_once(&g_once, init_stats);
}

__attribute__((constructor)) static void capdev_init(void) {
    init_once();
}

/* Seqlock writer; called with g_lock held. */
static void write_begin(void) {
    __atomic_store_n(&g_stats[STATS_SEQ], g_stats[STATS_SEQ] + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static void write_end(void) {
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&g_stats[STATS_SEQ], g_stats[STATS_SEQ] + 1, __ATOMIC_RELEASE);
}

/* Apply a pending peak reset from the parent; called with g_lock held, inside write_begin/write_end. */
static void apply_reset(void) {
    uint64_t req = __atomic_load_n(&g_stats[STATS_RESET_REQ], __ATOMIC_ACQUIRE);
    if (req != g_stats[STATS_RESET_SEEN]) {
        g_stats[STATS_PEAK] = g_stats[STATS_USED];
        g_stats[STATS_RESET_SEEN] = req;
    }
}

static int remember(void * ptr, uint64_t size, void * data) {
    if (g_n_live == g_cap_live) {
        size_t n = g_cap_live ? 2 * g_cap_live : 64;
        struct live_buffer * grown = realloc(g_live, n * sizeof(*grown));
        if (grown == NULL) {
            return 0;
        }
        g_live = grown;
        g_cap_live = n;
    }
    g_live[g_n_live].ptr = ptr;
    g_live[g_n_live].size = size;
    g_live[g_n_live].data = data;
    g_n_live++;
    return 1;
}

/* The size a buffer was counted with (and the memory the shim gave it), forgetting it; -1 if never counted. */
static int64_t forget(void * ptr, void ** data) {
    for (size_t i = g_n_live; i-- > 0;) {
        if (g_live[i].ptr == ptr) {
            uint64_t size = g_live[i].size;
            *data = g_live[i].data;
            g_live[i] = g_live[--g_n_live];
            return (int64_t) size;
        }
    }
    return -1;
}

void * ggml_backend_buft_alloc_buffer(void * buft, size_t size) {
    init_once();
    if (real_alloc == NULL) {
        real_alloc = (alloc_fn) resolve("ggml_backend_buft_alloc_buffer", (void *) ggml_backend_buft_alloc_buffer);
        if (real_alloc == NULL) {
            abort(); /* no libggml-base loaded: nothing to allocate with */
        }
    }
    pthread_mutex_lock(&g_lock);
    uint64_t used = g_stats[STATS_USED];
    if ((uint64_t) size > g_cap || used > g_cap - (uint64_t) size) {
        write_begin();
        apply_reset();
        g_stats[STATS_REFUSED] += 1;
        g_stats[STATS_LAST_REFUSED] = (uint64_t) size;
        write_end();
        pthread_mutex_unlock(&g_lock);
        return NULL;
    }
    void * data = NULL;
    void * buffer = cuda_mode() ? cuda_alloc(size, &data) : real_alloc(buft, size);
    if (buffer != NULL && !remember(buffer, (uint64_t) size, data)) {
        /* no room to count it: refuse it rather than let it escape the cap (and leak the shim's memory) */
        if (real_free == NULL) {
            real_free = (free_fn) resolve("ggml_backend_buffer_free", (void *) ggml_backend_buffer_free);
        }
        if (real_free != NULL) {
            real_free(buffer);
        }
        free(data);
        pthread_mutex_unlock(&g_lock);
        return NULL;
    }
    if (buffer != NULL) {
        write_begin();
        apply_reset();
        used += (uint64_t) size;
        g_stats[STATS_USED] = used;
        if (used > g_stats[STATS_PEAK]) {
            g_stats[STATS_PEAK] = used;
        }
        g_stats[STATS_ALLOCS] += 1;
        g_stats[STATS_LIVE] = g_n_live;
        write_end();
    }
    pthread_mutex_unlock(&g_lock);
    return buffer;
}

void ggml_backend_buffer_free(void * buffer) {
    init_once();
    if (real_free == NULL) {
        real_free = (free_fn) resolve("ggml_backend_buffer_free", (void *) ggml_backend_buffer_free);
        if (real_free == NULL) {
            abort();
        }
    }
    if (buffer == NULL) {
        return; /* ggml_backend_buffer_free(NULL) is a no-op */
    }
    pthread_mutex_lock(&g_lock);
    void * data = NULL;
    int64_t size = forget(buffer, &data);
    if (size >= 0) {
        write_begin();
        apply_reset();
        g_stats[STATS_USED] -= (uint64_t) size;
        g_stats[STATS_LIVE] = g_n_live;
        write_end();
    }
    real_free(buffer);
    free(data); /* NULL unless the shim allocated it (CUDA mode): the buffer does not own it */
    pthread_mutex_unlock(&g_lock);
}

void ggml_backend_dev_memory(void * dev, size_t * free, size_t * total) {
    init_once();
    if (real_memory == NULL) {
        real_memory = (memory_fn) resolve("ggml_backend_dev_memory", (void *) ggml_backend_dev_memory);
        if (real_memory == NULL) {
            abort();
        }
    }
    real_memory(dev, free, total);
    pthread_mutex_lock(&g_lock);
    if (g_cap != UINT64_MAX) {
        uint64_t used = g_stats[STATS_USED];
        *total = (size_t) g_cap;
        *free = (size_t) (used < g_cap ? g_cap - used : 0);
    }
    write_begin();
    g_stats[STATS_MEMORY_QUERIES] += 1;
    write_end();
    pthread_mutex_unlock(&g_lock);
}

/* ---- CUDA's buffers (FITTER_CAPDEV_CUDA=1) ----------------------------------------------------------------- */

#define CUDA_ALIGNMENT 128 /* ggml-cuda.cu ggml_backend_cuda_buffer_type_get_alignment */

typedef size_t (*alignment_fn)(void * buft);
typedef void * (*from_ptr_fn)(void * data, size_t size);

static pthread_once_t g_cuda_once = PTHREAD_ONCE_INIT;
static int g_cuda; /* 1: CUDA's buffers; 0: the CPU's */
static alignment_fn real_alignment;
static from_ptr_fn cpu_buffer_from_ptr;

size_t ggml_backend_buft_get_alignment(void * buft);

static void init_cuda(void) {
    real_alignment = (alignment_fn) resolve("ggml_backend_buft_get_alignment", (void *) ggml_backend_buft_get_alignment);
    const char * cuda = getenv("FITTER_CAPDEV_CUDA");
    if (cuda == NULL || strcmp(cuda, "1") != 0) {
        return;
    }
    cpu_buffer_from_ptr = (from_ptr_fn) resolve("ggml_backend_cpu_buffer_from_ptr", NULL);
    if (cpu_buffer_from_ptr == NULL) {
        abort();
    }
    g_cuda = 1;
}

static int cuda_mode(void) {
    pthread_once(&g_cuda_once, init_cuda);
    return g_cuda;
}

/* A buffer whose base is 256-byte aligned, as cudaMalloc's: the client places tensors at 128-byte aligned offsets
 * from the base (ggml_tallocr) and would lose up to 96 bytes of a buffer the CPU type aligns to 32 only. The CPU
 * backend wraps the memory (ggml_backend_cpu_buffer_from_ptr); the shim frees it with the buffer. */
static void * cuda_alloc(size_t size, void ** data) {
    if (posix_memalign(data, 256, size ? size : 1) != 0) {
        *data = NULL;
        return NULL;
    }
    void * buffer = cpu_buffer_from_ptr(*data, size);
    if (buffer == NULL) {
        free(*data);
        *data = NULL;
    }
    return buffer;
}

size_t ggml_backend_buft_get_alignment(void * buft) {
    if (cuda_mode()) {
        return CUDA_ALIGNMENT;
    }
    if (real_alignment == NULL) {
        abort();
    }
    return real_alignment(buft);
}
