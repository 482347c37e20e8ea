"""The model's memory: its KV cache (src/llama-kv-cache.cpp, src/llama-kv-cache-iswa.cpp), the recurrent state of
Mamba-style and hybrid layers (src/llama-memory-recurrent.cpp), and the cache-type rules llama_init_from_model
checks. Which layers have which is the architecture's (fitter.gguf.archs, ModelSpec.kv_layer / rs_layer)."""

from __future__ import annotations

from collections import defaultdict

from fitter.errors import LaunchConfigError
from fitter.flags import KV_CACHE_TYPES, ContextParams, LaunchConfig
from fitter.gguf.archs import Memory
from fitter.gguf.model_spec import ModelSpec
from fitter.memory.backends.devices import Device
from fitter.memory.plan.buffers import CPU, Buffer, alloc_size, pad_to, row_bytes


def kv_cache_sizes(spec: ModelSpec, ctx: ContextParams) -> tuple[int, int]:
    """Cells of the full-attention cache and of the sliding-window cache (0 when the model has no SWA layers)."""
    size_base = ctx.n_ctx_seq
    if not any(spec.swa_layers[il] for il in range(spec.n_layer) if spec.kv_layer(il)):
        return size_base, 0
    # llama_kv_cache_iswa: the SWA cache holds the window per sequence plus one ubatch, padded to 256.
    unified = ctx.n_stream == 1
    size_swa = pad_to(min(size_base, spec.n_swa * (ctx.n_seq_max if unified else 1) + ctx.n_ubatch), 256)
    if ctx.swa_full:
        size_swa = size_base
    return size_base, size_swa


def kv_buffers(
    spec: ModelSpec, config: LaunchConfig, ctx: ContextParams, layer_dev: tuple[Device | None, ...]
) -> list[Buffer]:
    size_base, size_swa = kv_cache_sizes(spec, ctx)
    v_trans = ctx.v_trans
    v_width_max = max(spec.n_embd_v_gqa(il) for il in range(spec.n_layer))
    # One cache per kind (base, swa), one buffer per buffer type within it, in name order (std::map by name).
    caches: dict[tuple[bool, str], int] = defaultdict(int)
    devs: dict[str, Device | None] = {}
    for il in range(spec.n_layer):
        if not spec.kv_layer(il):  # create_memory's layer filter: recurrent layers, NextN blocks
            continue
        is_swa = spec.swa_layers[il]
        cells = size_swa if is_swa else size_base
        dev = None if config.no_kv_offload else layer_dev[il]
        name = dev.name if dev is not None else CPU
        devs[name] = dev
        k_width = spec.n_embd_k_gqa(il)
        k = (config.cache_type_k, (k_width, cells, ctx.n_stream))
        tensors = [k]
        if not spec.is_mla:  # MLA caches only K (has_v = !is_mla)
            v_width = v_width_max if v_trans else spec.n_embd_v_gqa(il)
            tensors.append((config.cache_type_v, (v_width, cells, ctx.n_stream)))
        for kind, (type_name, ne) in zip("kv", tensors, strict=False):
            n_bytes = row_bytes(type_name, ne[0]) * ne[1] * ne[2]
            _check_range(dev, kind, il, n_bytes, ctx)
            caches[(is_swa, name)] += alloc_size(dev, type_name, ne, n_bytes)
    buffers = []
    for (_, name), size in sorted(caches.items()):
        dev = devs[name]
        buffers.append(Buffer(name, "kv", dev.name if dev else CPU, size))
    index, state = indexer_buffers(spec, config, ctx, layer_dev), rs_buffers(spec, config, ctx, layer_dev)
    # a hybrid's indexer cache comes after its recurrent state (llama_memory_hybrid_idx builds on llama_memory_hybrid)
    return buffers + (state + index if spec.memory is Memory.HYBRID else index + state)


def _check_range(dev: Device | None, kind: str, il: int, n_bytes: int, ctx: ContextParams) -> None:
    """A cache tensor past the largest one its device's ops take (Vulkan: maxStorageBufferRange) makes llama.cpp
    abort when it schedules the first graph: the scheduler finds the tensor in a buffer whose backend cannot run
    it (ggml-backend.cpp `ggml_backend_sched_backend_id_from_cur`: "pre-allocated tensor (cache_k_l<i>) in a buffer
    (Vulkan0) that cannot run the operation")."""
    limit = dev.profile.max_op_bytes if dev is not None else None
    if dev is None or limit is None or n_bytes <= limit:
        return
    mib = 1024 * 1024
    raise LaunchConfigError(
        f"-c {ctx.n_ctx}: layer {il}'s {kind.upper()} cache would be {n_bytes / mib:.2f} MiB on {dev.name}, past the "
        f"largest tensor its ops take ({limit / mib:.2f} MiB, the device's maxStorageBufferRange), so llama.cpp "
        f"aborts loading (pre-allocated tensor cache_{kind}_l{il} in a buffer that cannot run the operation); use a "
        "smaller -c, a quantized cache (-ctk/-ctv q8_0), fewer layers on the device, or -nkvo")


def indexer_buffers(
    spec: ModelSpec, config: LaunchConfig, ctx: ContextParams, layer_dev: tuple[Device | None, ...]
) -> list[Buffer]:
    """A DSA model's indexer key cache (src/llama-kv-cache-dsa.cpp `llama_kv_cache_dsa`): a second llama_kv_cache,
    after the MLA cache, whose hparams have one key head of the indexer's size on every layer and stay MLA (so no V):
    per indexer layer one K tensor of the K cache's type, the MLA cache's cells and streams."""
    size_base, size_swa = kv_cache_sizes(spec, ctx)
    caches: dict[tuple[bool, str], int] = defaultdict(int)
    for il in range(spec.n_layer):
        if not (spec.indexer_layers and spec.indexer_layers[il]):
            continue
        is_swa = spec.swa_layers[il]
        dev = None if config.no_kv_offload else layer_dev[il]
        ne = (spec.indexer_width, size_swa if is_swa else size_base, ctx.n_stream)
        n_bytes = row_bytes(config.cache_type_k, ne[0]) * ne[1] * ne[2]
        caches[(is_swa, dev.name if dev is not None else CPU)] += alloc_size(dev, config.cache_type_k, ne, n_bytes)
    return [Buffer(name, "kv", name, size) for (_, name), size in sorted(caches.items())]


def rs_buffers(
    spec: ModelSpec, config: LaunchConfig, ctx: ContextParams, layer_dev: tuple[Device | None, ...]
) -> list[Buffer]:
    """Recurrent state (src/llama-memory-recurrent.cpp, the constructor): per recurrent layer an F32 conv row
    (n_embd_r) and SSM row (n_embd_s) for each of max(1, n_seq_max) sequences, on the layer's device unless -nkvo;
    one buffer per buffer type in name order, after the attention layers' KV cache (llama_memory_hybrid). Neither
    -c nor -ctk changes it. Counted as the KV kind: llama.cpp's memory breakdown puts both in "context"."""
    rows = max(1, ctx.n_seq_max)  # n_rs_seq (rollback snapshots) is 0 without speculative decoding
    sizes: dict[str, int] = defaultdict(int)
    for il in range(spec.n_layer):
        if not spec.rs_layer(il):
            continue
        dev = None if config.no_kv_offload else layer_dev[il]
        name = dev.name if dev is not None else CPU
        for width in (spec.n_embd_r, spec.n_embd_s):
            ne = (width, rows)
            sizes[name] += alloc_size(dev, "F32", ne, row_bytes("F32", width) * rows)
    return [Buffer(name, "kv", name, size) for name, size in sorted(sizes.items())]  # the CPU's name is "CPU"


def check_cache_types(spec: ModelSpec, config: LaunchConfig, ctx: ContextParams) -> None:
    """The KV-type rules llama_init_from_model checks against the model (src/llama-context.cpp)."""
    ctk, ctv = config.cache_type_k, config.cache_type_v
    if spec.is_mla and ctk != ctv:
        raise LaunchConfigError(
            f"-ctk {ctk} -ctv {ctv}: {spec.arch} uses MLA, whose V lives inside the K cache, so llama.cpp requires "
            "the same K and V cache type"
        )
    if not ctx.flash_attn:
        return
    for flag, type_name, head in (("-ctk", ctk, spec.head_dim_k), ("-ctv", ctv, spec.head_dim_v)):
        block = KV_CACHE_TYPES[type_name][0]
        if block > 1 and head % block:
            raise LaunchConfigError(
                f"{flag} {type_name}: its block of {block} does not divide the model's head size {head} "
                "(llama.cpp refuses quantized caches that do not tile the heads)"
            )
