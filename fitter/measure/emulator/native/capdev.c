/*
 * capdev: an LD_PRELOAD shim that gives a llama.cpp device a memory cap: a small GPU on a CPU-only machine.
 *
 * Server mode (FITTER_CAPDEV_CAP_BYTES): loaded into a llama.cpp RPC *server* (fitter/measure/emulator/emulated_gpu.py
 * starts it), it turns the server's CPU device into a small GPU. It interposes the three ggml functions the RPC server
 * (ggml/src/ggml-rpc/ggml-rpc.cpp, llama.cpp 0c1e570) calls in libggml-base through the dynamic linker (they are
 * undefined symbols of libggml-rpc.so, so the calls go through its PLT):
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
 * Client mode (FITTER_CAPDEV_DEVICES): loaded into the llama.cpp program itself (llama-server, llama-fit-params, the
 * loader) to cap devices of a real backend, such as the Vulkan device of Mesa's software driver (lavapipe reports its
 * 2 GiB heap as free forever and never refuses: fitter/measure/emulator/emulated_vulkan.py). Only the devices named
 * are capped, each on its own: their buffer types' buffers (the buffer type bears the device's name, as ggml-vulkan's
 * `Vulkan0` does) count against the device's cap, and `ggml_backend_dev_memory` and `ggml_backend_dev_get_props`
 * answer total = cap, free = cap - used for the device. llama.cpp calls all four through the dynamic linker (libllama
 * and libllama-common into libggml-base; ggml-alloc's and ggml-backend's own calls inside libggml-base go through its
 * PLT too, the functions being exported with default visibility). Other buffer types (the CPU's, `Vulkan_Host`) pass
 * through uncounted. Memory the backend allocates past ggml's buffer API (ggml-vulkan's staging and dequantization
 * buffers) is not capped, as a CUDA pool would not be: llama.cpp's buffers are.
 *
 * With FITTER_CAPDEV_CUDA=1 (server mode) the device's buffers are CUDA's: rpc_server::get_alignment
 * (RPC_CMD_GET_ALIGNMENT) answers 128 (ggml_backend_buft_get_alignment), and each buffer's base is 256-byte aligned
 * as cudaMalloc's. The sizes of CUDA's tensors are the client's to compute (fitter/measure/emulator/native/cudadev.c):
 * the RPC client caches the server's answer per output shape, which would give every flash-attention node of a model
 * the first one's scratch.
 *
 * Environment:
 *   FITTER_CAPDEV_CAP_BYTES  server mode: the cap in bytes (decimal). Unset (and no FITTER_CAPDEV_DEVICES): nothing
 *                            is capped, only counted.
 *   FITTER_CAPDEV_CUDA       1: CUDA's alignment and aligned buffers (above). Unset: the CPU's.
 *   FITTER_CAPDEV_STATS      server mode: a file the counters live in (mmap'd, MAP_SHARED), so the parent reads them.
 *                            Unset: the counters are private to this process.
 *   FITTER_CAPDEV_DEVICES    client mode: the capped devices' names, comma-separated (Vulkan0,Vulkan1)
 *   FITTER_CAPDEV_CAPS       client mode: each one's cap in bytes, in the same order
 *   FITTER_CAPDEV_STATS_DIR  client mode: a folder with one counters file per device, <name>.stats. A process claims
 *                            a device's file at its first counted allocation (its counters start from zero then), so
 *                            the file holds the counters of the last process that allocated on the device; programs
 *                            that only ask for memory (--list-devices, a no-alloc projection) leave it alone.
 *
 * The counters are 64-bit words in a seqlock (layout: STATS_* below, mirrored in capdev.py): the shim is their only
 * writer, except the word STATS_RESET_REQ which the parent bumps to ask for peak := used, the word STATS_HELD (bytes
 * another process holds on the device, as a browser or a second model holds part of a real GPU: they count against
 * the cap and are not free; `EmulatedGpu.hold`) and, in client mode, the parent's reset of a file whose process is
 * gone.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
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
    STATS_HELD,           /* written by the parent: bytes another process holds on the device (server mode) */
    STATS_WORDS
};

typedef void * (*alloc_fn)(void * buft, size_t size);
typedef void (*free_fn)(void * buffer);
typedef void (*memory_fn)(void * dev, size_t * free, size_t * total);
typedef void (*props_fn)(void * dev, void * props);
typedef const char * (*name_fn)(void * obj);

#define MAX_DEVICES 16
#define NAME_LEN 64

/* One capped device: the whole process's buffers in server mode, a named device's in client mode. */
struct capped {
    char name[NAME_LEN];            /* client mode: the device and its buffer type; "" in server mode */
    uint64_t cap;
    uint64_t used, peak;            /* this process's bytes on the device: what the cap and memory answers use */
    volatile uint64_t * stats;      /* its counters: the shared file's once mapped, else `own` (a mirror of the
                                     * above for the parent; another process may claim the file) */
    uint64_t own[STATS_WORDS];
    char path[4096];                /* client mode: its counters file, claimed at the first counted allocation */
    int claimed;
};

struct live_buffer {
    void * ptr;
    uint64_t size;
    void * data; /* memory the shim allocated itself (CUDA mode), freed with the buffer; NULL otherwise */
    int device;  /* index into g_devices */
};

static int cuda_mode(void);
static void * cuda_alloc(size_t size, void ** data);
void ggml_backend_buffer_free(void * buffer);

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static struct capped g_devices[MAX_DEVICES];
static int g_n_devices;
static int g_client; /* client mode: only the named devices are capped */
static struct live_buffer * g_live;
static size_t g_n_live, g_cap_live;
static struct { void * buft; int device; } g_bufts[4 * MAX_DEVICES]; /* buffer types seen: their device or -1 */
static int g_n_bufts;

static alloc_fn real_alloc;
static free_fn real_free;
static memory_fn real_memory;
static props_fn real_props;
static name_fn real_buft_name;
static name_fn real_dev_name;

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

static volatile uint64_t * map_stats(const char * path) {
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (st.st_size < STATS_SIZE && ftruncate(fd, STATS_SIZE) != 0)) {
        close(fd);
        return NULL;
    }
    void * p = mmap(NULL, STATS_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    return p == MAP_FAILED ? NULL : (volatile uint64_t *) p;
}

static void publish(struct capped * d) {
    d->stats[STATS_VERSION] = 1;
    d->stats[STATS_CAP] = d->cap;
    d->stats[STATS_PID] = (uint64_t) getpid();
    __atomic_store_n(&d->stats[STATS_MAGIC_W], STATS_MAGIC, __ATOMIC_RELEASE);
}

/* Client mode: the next comma-separated field of `*list` into `out` (at most `n` bytes); 0 at the end. */
static int next_field(const char ** list, char * out, size_t n) {
    const char * s = *list;
    if (s == NULL || *s == '\0') {
        return 0;
    }
    const char * comma = strchr(s, ',');
    size_t len = comma ? (size_t) (comma - s) : strlen(s);
    if (len >= n) {
        len = n - 1;
    }
    memcpy(out, s, len);
    out[len] = '\0';
    *list = comma ? comma + 1 : s + strlen(s);
    return 1;
}

static void init_stats(void) {
    const char * names = getenv("FITTER_CAPDEV_DEVICES");
    if (names != NULL && *names != '\0') {
        g_client = 1;
        const char * caps = getenv("FITTER_CAPDEV_CAPS");
        const char * dir = getenv("FITTER_CAPDEV_STATS_DIR");
        char name[NAME_LEN], cap[32];
        while (g_n_devices < MAX_DEVICES && next_field(&names, name, sizeof name)) {
            struct capped * d = &g_devices[g_n_devices++];
            snprintf(d->name, sizeof d->name, "%s", name);
            d->cap = next_field(&caps, cap, sizeof cap) ? strtoull(cap, NULL, 10) : UINT64_MAX;
            d->stats = d->own;
            if (dir != NULL && *dir != '\0') {
                snprintf(d->path, sizeof d->path, "%s/%s.stats", dir, name);
            }
            publish(d);
        }
        return;
    }
    struct capped * d = &g_devices[g_n_devices++];
    d->cap = UINT64_MAX;
    const char * cap = getenv("FITTER_CAPDEV_CAP_BYTES");
    if (cap != NULL && *cap != '\0') {
        d->cap = strtoull(cap, NULL, 10);
    }
    const char * path = getenv("FITTER_CAPDEV_STATS");
    volatile uint64_t * mapped = (path != NULL && *path != '\0') ? map_stats(path) : NULL;
    d->stats = mapped ? mapped : d->own;
    publish(d);
}

static void init_once(void) {
    pthread_once(&g_once, init_stats);
}

__attribute__((constructor)) static void capdev_init(void) {
    init_once();
}

/* Seqlock writer; called with g_lock held. */
static void write_begin(struct capped * d) {
    __atomic_store_n(&d->stats[STATS_SEQ], d->stats[STATS_SEQ] + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static void write_end(struct capped * d) {
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&d->stats[STATS_SEQ], d->stats[STATS_SEQ] + 1, __ATOMIC_RELEASE);
}

/* Client mode: make the device's counters file this process's, its counters starting from this process's own (the
 * previous process's are gone with it); called with g_lock held, before the first counted allocation. */
static void claim(struct capped * d) {
    if (d->claimed || d->path[0] == '\0') {
        return;
    }
    d->claimed = 1;
    volatile uint64_t * mapped = map_stats(d->path);
    if (mapped == NULL) {
        return;
    }
    uint64_t seq = mapped[STATS_SEQ];
    __atomic_store_n(&mapped[STATS_SEQ], seq | 1, __ATOMIC_RELAXED); /* odd: mid-update */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (int w = STATS_CAP; w < STATS_WORDS; w++) {
        if (w != STATS_RESET_REQ && w != STATS_HELD) {
            mapped[w] = d->own[w];
        }
    }
    mapped[STATS_RESET_SEEN] = __atomic_load_n(&mapped[STATS_RESET_REQ], __ATOMIC_ACQUIRE);
    mapped[STATS_VERSION] = 1;
    __atomic_store_n(&mapped[STATS_MAGIC_W], STATS_MAGIC, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&mapped[STATS_SEQ], (seq | 1) + 1, __ATOMIC_RELEASE);
    d->stats = mapped;
}

/* Apply a pending peak reset from the parent; called with g_lock held, inside write_begin/write_end. */
static void apply_reset(struct capped * d) {
    uint64_t req = __atomic_load_n(&d->stats[STATS_RESET_REQ], __ATOMIC_ACQUIRE);
    if (req != d->stats[STATS_RESET_SEEN]) {
        d->peak = d->used;
        d->stats[STATS_PEAK] = d->peak;
        d->stats[STATS_RESET_SEEN] = req;
    }
}

/* The capped device a buffer type belongs to: 0 in server mode (every buffer), the device whose name the buffer
 * type bears in client mode, -1 for one not capped. Called with g_lock held. */
static int device_of_buft(void * buft) {
    if (!g_client) {
        return 0;
    }
    for (int i = 0; i < g_n_bufts; i++) {
        if (g_bufts[i].buft == buft) {
            return g_bufts[i].device;
        }
    }
    if (real_buft_name == NULL) {
        real_buft_name = (name_fn) resolve("ggml_backend_buft_name", NULL);
    }
    const char * name = real_buft_name != NULL && buft != NULL ? real_buft_name(buft) : NULL;
    int device = -1;
    for (int i = 0; name != NULL && i < g_n_devices; i++) {
        if (strcmp(name, g_devices[i].name) == 0) {
            device = i;
        }
    }
    if (g_n_bufts < (int) (sizeof g_bufts / sizeof g_bufts[0])) {
        g_bufts[g_n_bufts].buft = buft;
        g_bufts[g_n_bufts].device = device;
        g_n_bufts++;
    }
    return device;
}

/* The capped device of a ggml device (memory queries): 0 in server mode, by name in client mode, else -1. */
static int device_of_dev(void * dev) {
    if (!g_client) {
        return 0;
    }
    if (real_dev_name == NULL) {
        real_dev_name = (name_fn) resolve("ggml_backend_dev_name", NULL);
    }
    const char * name = real_dev_name != NULL && dev != NULL ? real_dev_name(dev) : NULL;
    for (int i = 0; name != NULL && i < g_n_devices; i++) {
        if (strcmp(name, g_devices[i].name) == 0) {
            return i;
        }
    }
    return -1;
}

static int remember(void * ptr, uint64_t size, void * data, int device) {
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
    g_live[g_n_live].device = device;
    g_n_live++;
    return 1;
}

/* The size a buffer was counted with, its device (and the memory the shim gave it), forgetting it; -1 if never
 * counted. */
static int64_t forget(void * ptr, void ** data, int * device) {
    for (size_t i = g_n_live; i-- > 0;) {
        if (g_live[i].ptr == ptr) {
            uint64_t size = g_live[i].size;
            *data = g_live[i].data;
            *device = g_live[i].device;
            g_live[i] = g_live[--g_n_live];
            return (int64_t) size;
        }
    }
    return -1;
}

static size_t live_count(int device) {
    size_t n = 0;
    for (size_t i = 0; i < g_n_live; i++) {
        n += g_live[i].device == device;
    }
    return n;
}

/* The real allocation and free run without g_lock held: a backend's own may call back into ggml's (a multi-buffer
 * frees its parts through ggml_backend_buffer_free; ggml-vulkan's pinned host type falls back to the CPU's through
 * ggml_backend_buft_alloc_buffer), which would deadlock on it. The bytes are reserved against the cap first. */
void * ggml_backend_buft_alloc_buffer(void * buft, size_t size) {
    init_once();
    if (real_alloc == NULL) {
        real_alloc = (alloc_fn) resolve("ggml_backend_buft_alloc_buffer", (void *) ggml_backend_buft_alloc_buffer);
        if (real_alloc == NULL) {
            abort(); /* no libggml-base loaded: nothing to allocate with */
        }
    }
    pthread_mutex_lock(&g_lock);
    int device = device_of_buft(buft);
    if (device < 0) {
        pthread_mutex_unlock(&g_lock);
        return real_alloc(buft, size); /* a buffer type no cap applies to: the host's, another device's */
    }
    struct capped * d = &g_devices[device];
    claim(d);
    /* what another process holds (STATS_HELD) is not this process's to allocate */
    uint64_t held = __atomic_load_n(&d->stats[STATS_HELD], __ATOMIC_ACQUIRE);
    uint64_t used = d->used;
    uint64_t taken = used + (held < d->cap ? held : d->cap);
    if ((uint64_t) size > d->cap || taken > d->cap - (uint64_t) size) {
        write_begin(d);
        apply_reset(d);
        d->stats[STATS_REFUSED] += 1;
        d->stats[STATS_LAST_REFUSED] = (uint64_t) size;
        write_end(d);
        pthread_mutex_unlock(&g_lock);
        return NULL;
    }
    d->used = used + (uint64_t) size; /* reserved while the backend allocates */
    int cuda = !g_client && cuda_mode();
    pthread_mutex_unlock(&g_lock);

    void * data = NULL;
    void * buffer = cuda ? cuda_alloc(size, &data) : real_alloc(buft, size);

    pthread_mutex_lock(&g_lock);
    if (buffer == NULL || !remember(buffer, (uint64_t) size, data, device)) {
        /* the backend failed, or no room to count it: refused rather than let it escape the cap */
        d->used -= (uint64_t) size;
        pthread_mutex_unlock(&g_lock);
        if (buffer != NULL) {
            if (real_free == NULL) {
                real_free = (free_fn) resolve("ggml_backend_buffer_free", (void *) ggml_backend_buffer_free);
            }
            if (real_free != NULL) {
                real_free(buffer);
            }
            free(data);
        }
        return NULL;
    }
    write_begin(d);
    apply_reset(d);
    if (d->used > d->peak) {
        d->peak = d->used;
    }
    d->stats[STATS_USED] = d->used;
    d->stats[STATS_PEAK] = d->peak;
    d->stats[STATS_ALLOCS] += 1;
    d->stats[STATS_LIVE] = live_count(device);
    write_end(d);
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
    int device = -1;
    int64_t size = forget(buffer, &data, &device);
    pthread_mutex_unlock(&g_lock);
    real_free(buffer);
    free(data); /* NULL unless the shim allocated it (CUDA mode): the buffer does not own it */
    if (size >= 0) {
        pthread_mutex_lock(&g_lock);
        struct capped * d = &g_devices[device];
        write_begin(d);
        apply_reset(d);
        d->used -= (uint64_t) size;
        d->stats[STATS_USED] = d->used;
        d->stats[STATS_PEAK] = d->peak;
        d->stats[STATS_LIVE] = live_count(device);
        write_end(d);
        pthread_mutex_unlock(&g_lock);
    }
}

/* A capped device's memory as llama.cpp asks for it: total = cap, free = cap - used - held; called with g_lock
 * held. */
static void capped_memory(struct capped * d, size_t * free, size_t * total) {
    if (d->cap != UINT64_MAX) {
        uint64_t used = d->used + __atomic_load_n(&d->stats[STATS_HELD], __ATOMIC_ACQUIRE);
        *total = (size_t) d->cap;
        *free = (size_t) (used < d->cap ? d->cap - used : 0);
    }
    write_begin(d);
    d->stats[STATS_MEMORY_QUERIES] += 1;
    write_end(d);
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
    int device = device_of_dev(dev);
    if (device >= 0) {
        capped_memory(&g_devices[device], free, total);
    }
    pthread_mutex_unlock(&g_lock);
}

/* include/ggml-backend.h struct ggml_backend_dev_props at 0c1e570: name, description, memory_free, memory_total, … */
struct dev_props_head {
    const char * name;
    const char * description;
    size_t memory_free;
    size_t memory_total;
};

void ggml_backend_dev_get_props(void * dev, void * props) {
    init_once();
    if (real_props == NULL) {
        real_props = (props_fn) resolve("ggml_backend_dev_get_props", (void *) ggml_backend_dev_get_props);
        if (real_props == NULL) {
            abort();
        }
    }
    real_props(dev, props);
    if (!g_client) {
        return; /* server mode: the RPC server answers memory queries through ggml_backend_dev_memory */
    }
    pthread_mutex_lock(&g_lock);
    int device = device_of_dev(dev);
    if (device >= 0) {
        struct dev_props_head * head = (struct dev_props_head *) props;
        capped_memory(&g_devices[device], &head->memory_free, &head->memory_total);
    }
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
