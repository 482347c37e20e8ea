"""`-sm tensor` (LLAMA_SPLIT_MODE_TENSOR): how llama.cpp splits weights and the KV cache over the GPUs of its "Meta"
device, one slice per device (llama.cpp 0c1e570: src/llama-model.cpp `llama_meta_device_get_split_state`,
ggml/src/ggml-backend-meta.cpp).

The model sees one virtual device, `Meta(...)`: every offloaded layer goes to it, and each static tensor on it is cut
along one axis into per-device slices (or mirrored: a full copy on every device). Each device's buffer packs its
own slices with its own buffer type (`ggml_backend_meta_alloc_ctx_tensors_from_buft`); llama.cpp logs only the
largest device's size. The compute graph is planned at full size and that size is allocated on every device
(`ggml_backend_meta_buffer_type_alloc_buffer`).
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace

from fitter.errors import LaunchConfigError
from fitter.flags import ContextParams, LaunchConfig
from fitter.gguf._constants import GGML_QUANT_SIZES, GGMLQuantizationType
from fitter.gguf.model_spec import ModelSpec, TensorSpec
from fitter.memory.backends.devices import Device
from fitter.memory.plan.buffers import Buffer, alloc_size, row_bytes

__all__ = ["MAX_DEVICES", "NO_SM_TENSOR", "check_tensor_mode", "device_shares", "meta_buft_name", "meta_device",
           "row_parallel", "split_rows", "tensor_kv_buffers", "tensor_mode_runs", "tensor_model_buffers",
           "tensor_slices"]

# ggml/include/ggml-backend.h GGML_BACKEND_META_MAX_DEVICES: ggml_backend_meta_device asserts n_devs <= 16
MAX_DEVICES = 16

# src/llama-arch.cpp `llm_arch_supports_sm_tensor`: the deny-list (`default: return true`), as LLM_ARCH_NAMES spells
# each architecture in general.architecture
NO_SM_TENSOR = frozenset({
    "grok", "mpt", "plamo2", "minicpm3", "gemma3n", "mamba", "mamba2", "jamba", "falcon-h1", "olmo2", "olmoe",
    "deepseek2", "deepseek32", "hy_v4", "dots3note", "glm-dsa", "bitnet", "t5", "nemotron_h", "nemotron_h_moe",
    "granitehybrid", "minimax-01", "minimax-m2", "minimax-m3", "mistral4", "kimi-linear", "bailingmoe3", "kimi-k3",
    "glm5-next", "qwen3tts", "qwen4exp",
})

# The arches whose fused Q-gate and linear-attention layouts have their own segments ([TAG_SPLIT_QGATE_QWEN])
_QWEN_GATED = ("qwen3next", "qwen35", "qwen35moe", "qwen4exp")

MIRRORED = -1  # GGML_BACKEND_SPLIT_AXIS_MIRRORED / _PARTIAL: the full tensor on every device


def _pat(p: str) -> Callable[[str], re.Match[str] | None]:
    return re.compile(p).fullmatch  # std::regex_match: the whole name


# src/llama-model.cpp `llama_meta_device_get_split_state`: the patterns, verbatim
_Q_W, _KV_W, _QKV_W = _pat(r"blk\.\d*\.attn_q.weight"), _pat(r"blk\.\d*\.attn_(k|v).weight"), \
    _pat(r"blk\.\d*\.attn_qkv.weight")
_Q_B, _KV_B, _QKV_B = _pat(r"blk\.\d*\.attn_q\.bias"), _pat(r"blk\.\d*\.attn_(k|v)\.bias"), \
    _pat(r"blk\.\d*\.attn_qkv.bias")
_QK_NORM, _KV_CACHE = _pat(r"blk\.\d*\.attn_(q|k)_norm\.weight"), _pat(r"cache_(k|v)_l\d*")
_IDX_CACHE, _SINKS = _pat(r"cache_idx_(k|v)_l\d*"), _pat(r"blk\.\d*\.attn_sinks.weight")
_OUT_W, _OUT_B = _pat(r"blk\.\d*\.attn_output.weight"), _pat(r"blk\.\d*\.attn_output.bias")
_GATE_W = _pat(r"blk\.\d*\.attn_gate.weight")
_SSM_DT, _SSM_A = _pat(r"blk\.\d*\.ssm_dt.bias"), _pat(r"blk\.\d*\.ssm_a")
_SSM_ALPHA, _SSM_BETA, _SSM_BA = _pat(r"blk\.\d*\.ssm_alpha.weight"), _pat(r"blk\.\d*\.ssm_beta.weight"), \
    _pat(r"blk\.\d*\.ssm_ba.weight")
_R_CACHE, _PLE_CACHE, _S_CACHE = _pat(r"cache_r_l\d*"), _pat(r"cache_ple_r_l\d*"), _pat(r"cache_s_l\d*")
_CONV1D, _SSM_OUT = _pat(r"blk\.\d*\.ssm_conv1d.weight"), _pat(r"blk\.\d*\.ssm_out.weight")
_UP_W, _UP_B = _pat(r"blk\.\d*\.ffn_up(_exps)?.weight"), _pat(r"blk\.\d*\.ffn_up(_exps)?.bias")
_GATE_FW, _GATE_FB = _pat(r"blk\.\d*\.ffn_gate(_exps)?.weight"), _pat(r"blk\.\d*\.ffn_gate(_exps)?.bias")
_GATE_UP_W, _DOWN_W = _pat(r"blk\.\d*\.ffn_gate_up(_exps)?.weight"), _pat(r"blk\.\d*\.ffn_down(_exps)?.weight")
_DOWN_B, _DOWN_EXPS_B = _pat(r"blk\.\d*\.ffn_down.bias"), _pat(r"blk\.\d*\.ffn_down_exps.bias")
_OUTPUT_W, _OUTPUT_B = _pat(r"output\.weight"), _pat(r"output\.bias")


def check_tensor_mode(spec: ModelSpec, config: LaunchConfig, n_devices: int) -> None:
    """The refusals llama.cpp makes for -sm tensor, in its order: the architecture (src/llama-model.cpp
    `llama_model_create`), the device count (src/llama.cpp `llama_prepare_model_devices`; ggml-backend-meta.cpp
    `ggml_backend_meta_device` asserts at most 16), flash attention off (src/llama-context.cpp
    `llama_init_from_model`: "SPLIT_MODE_TENSOR requires flash_attn to be enabled")."""
    if spec.arch in NO_SM_TENSOR:
        raise LaunchConfigError(f"-sm tensor: llama.cpp has no tensor split for architecture {spec.arch!r} "
                                "(LLAMA_SPLIT_MODE_TENSOR not implemented for it); use -sm layer")
    if n_devices == 0:
        raise LaunchConfigError("-sm tensor: no GPU to split over (LLAMA_SPLIT_MODE_TENSOR needs >= 1 devices)")
    if n_devices > MAX_DEVICES:
        raise LaunchConfigError(f"-sm tensor: {n_devices} devices, past the {MAX_DEVICES} llama.cpp's Meta device "
                                "takes (GGML_BACKEND_META_MAX_DEVICES; it aborts); name at most 16 with -dev")
    if config.flash_attn == "off":
        raise LaunchConfigError("-fa off: llama.cpp's -sm tensor requires flash attention (SPLIT_MODE_TENSOR "
                                "requires flash_attn to be enabled, the context is not made); use -fa on or auto")


def tensor_mode_runs(spec: ModelSpec, config: LaunchConfig, n_devices: int) -> bool:
    """Whether llama.cpp would run `config` with -sm tensor over n_devices GPUs, two or more (one is allowed, but
    splits nothing): none of `check_tensor_mode`'s refusals."""
    try:
        check_tensor_mode(spec, replace(config, split_mode="tensor"), n_devices)
    except LaunchConfigError:
        return False
    return n_devices >= 2


def meta_buft_name(devices: tuple[Device, ...]) -> str:
    """The Meta device's (and buffer type's) name as llama.cpp 0c1e570 logs it: `Meta()` whatever the devices.
    ggml-backend-meta.cpp `ggml_backend_meta_device_context`'s constructor moves `simple_devs` into its member and
    then joins the names of the moved-from (empty) parameter."""
    return "Meta()"


def meta_device(devices: tuple[Device, ...]) -> Device:
    """The one device the model sees (ggml-backend-meta.cpp): free and total memory summed over the devices, the
    largest alignment (`ggml_backend_meta_buffer_type_get_alignment`), the devices' common host buffer type or none
    (`ggml_backend_meta_device_get_host_buffer_type`), no op offload (`offload_op = nullptr`), and the buffer-type
    rules of the first device: get_alloc_size is the max over the devices of the full tensor's size, the same for
    devices of one kind."""
    first = devices[0].profile
    hosts = {d.profile.host_buft for d in devices}
    host = first.host_buft if len(hosts) == 1 else None
    profile = replace(first, alignment=max(d.profile.alignment for d in devices), host_buft=host, op_offload=False)
    free = [d.free_bytes for d in devices]
    total = [d.total_bytes for d in devices]
    return replace(devices[0], name=meta_buft_name(devices), profile=profile,
                   free_bytes=sum(f for f in free if f is not None) if all(f is not None for f in free) else None,
                   total_bytes=sum(t for t in total if t is not None) if all(t is not None for t in total) else None)


def _f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def split_rows(ne_s: int, g_s: int, n_dev: int, rotation: int, tensor_split: tuple[float, ...] = ()) -> list[int]:
    """One segment's elements per device (src/llama-model.cpp, the end of `llama_meta_device_get_split_state`): the
    running sum of -ts rotated by the layer's rotation, in float; each boundary rounded down to the granularity;
    the last device in rotated order takes the rest. Without -ts (all zero) the split is even."""
    ts = [float(tensor_split[i]) if i < len(tensor_split) else 0.0 for i in range(n_dev)]
    scan: list[float] = []
    for j in range(n_dev):
        v = _f32(ts[(j + rotation) % n_dev])
        scan.append(_f32(scan[-1] + v) if j > 0 else v)
    out = [0] * n_dev
    low = 0
    for j in range(n_dev - 1):
        if scan[-1] == 0.0:
            high = ne_s * (j + 1) // n_dev
        else:  # int64 * float / float in float, truncated on assignment
            high = math.trunc(_f32(_f32(_f32(float(ne_s)) * scan[j]) / scan[-1]))
        if high % g_s:
            high -= high % g_s
        out[(j + rotation) % n_dev] = high - low
        low = high
    out[(n_dev - 1 + rotation) % n_dev] = ne_s - low
    return out


def _blck(type_name: str) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]][0]


@dataclass(frozen=True)
class _Config:
    axis: int  # 0, 1 (ggml's ne index), or MIRRORED
    ref: str = ""  # the tensor whose block size sets the granularity (tensor_axis_0): "" = itself
    fallback: str = ""


def _config(name: str, arch: str) -> _Config:
    """`get_tensor_config`: the axis a tensor is split on and its reference tensor (DeepSeek-V4 and hrm_text, which
    fitter does not read or mirrors whole, aside)."""
    if arch == "hrm_text":  # "aliased cache slots cannot satisfy the meta-split invariants, so replicate all"
        return _Config(MIRRORED)
    if _IDX_CACHE(name) or _PLE_CACHE(name):
        return _Config(MIRRORED)
    attn = ("attn_output.weight", "ssm_out.weight")
    ffn = ("ffn_down.weight", "ffn_down_exps.weight")
    if _Q_W(name) or _KV_W(name) or _QKV_W(name) or _GATE_W(name):
        return _Config(1, *attn)
    if _Q_B(name) or _KV_B(name) or _QKV_B(name):
        return _Config(0, *attn)
    if _QK_NORM(name):
        return _Config(1, "attn_output.weight")  # MIRRORED when ne[1] == 1: see tensor_slices
    if _KV_CACHE(name) or _SINKS(name):
        return _Config(0, "attn_output.weight")
    if _OUT_W(name):
        return _Config(0)
    if _OUT_B(name):
        return _Config(MIRRORED)
    if _SSM_DT(name) or _SSM_A(name):
        return _Config(0, "ssm_out.weight")
    if _SSM_ALPHA(name) or _SSM_BETA(name) or _SSM_BA(name) or _CONV1D(name):
        return _Config(1, "ssm_out.weight")
    if _R_CACHE(name) or _S_CACHE(name):
        # "the LFM2 shortconv block runs fully mirrored, so its conv state must be mirrored too"
        return _Config(MIRRORED) if arch in ("lfm2", "lfm2moe") else _Config(0, "ssm_out.weight")
    if _SSM_OUT(name):
        return _Config(0)
    if _UP_W(name) or _GATE_FW(name) or _GATE_UP_W(name):
        return _Config(1, *ffn)
    if _UP_B(name) or _GATE_FB(name) or _DOWN_W(name):
        return _Config(0, *ffn)
    if _OUTPUT_W(name):
        return _Config(1)
    if _OUTPUT_B(name):
        return _Config(0)
    return _Config(MIRRORED)  # everything else, ffn_down(_exps).bias included (MIRRORED / PARTIAL)


def _layer(name: str) -> int | None:
    m = re.match(r"blk\.(\d+)\.", name) or re.match(r"cache_\w*?_l(\d+)$", name)
    return int(m.group(1)) if m else None


def _is_recr(spec: ModelSpec, il: int) -> bool:
    return bool(spec.recurrent_layers) and bool(spec.recurrent_layers[il])


def _rotation(spec: ModelSpec, il: int | None, n_dev: int) -> int:
    """`get_il_eff(il) % n_devices`: earlier layers of the same kind (recurrent, SWA); n_layer() for the rest."""
    if il is None:
        return spec.n_layer_trunk % n_dev
    kind = (_is_recr(spec, il), spec.swa_layers[il])
    return sum((_is_recr(spec, p), spec.swa_layers[p]) == kind for p in range(il)) % n_dev


def _segments(spec: ModelSpec, name: str, ne_axis: int, il: int) -> list[tuple[int, int]]:
    """`get_split_segments`: (elements, repeats) of the fused parts of a tensor along its split axis."""
    if spec.arch in _QWEN_GATED:
        if not _is_recr(spec, il) and (_QKV_W(name) or _QKV_B(name)):
            return [(spec.n_head[il] * spec.head_dim_k * 2, 1), (spec.n_embd_v_gqa(il), 2)]
        key_dim, value_dim = spec.ssm_d_state * spec.ssm_n_group, spec.ssm_d_state * spec.ssm_dt_rank
        if spec.arch == "qwen3next":
            if _QKV_W(name) or _CONV1D(name):
                return [(key_dim, 2), (value_dim, 1)]
            if _R_CACHE(name):
                return [(key_dim * (spec.ssm_d_conv - 1), 2), (value_dim * (spec.ssm_d_conv - 1), 1)]
        else:
            ratio = spec.ssm_dt_rank // spec.ssm_n_group
            if _QKV_W(name) or _CONV1D(name):
                return [(key_dim, 2 + ratio)]
            if _GATE_W(name) or _SSM_OUT(name):
                return [(key_dim, ratio)]
            if _SSM_DT(name) or _SSM_A(name) or _SSM_ALPHA(name) or _SSM_BETA(name):
                return [(spec.ssm_n_group, ratio)]
            if _R_CACHE(name):
                return [(key_dim * (spec.ssm_d_conv - 1), 2 + ratio)]
            if _S_CACHE(name):
                return [(spec.ssm_n_group * spec.ssm_d_state * spec.ssm_d_state, ratio)]
        if _GATE_UP_W(name):
            return [(spec.n_ff_exp, 2)]
        return [(ne_axis, 1)]
    if _QKV_W(name) or _QKV_B(name):
        q, k, v = spec.n_head[il] * spec.head_dim_k, spec.n_embd_k_gqa(il), spec.n_embd_v_gqa(il)
        return [(q, 1), (k, 2)] if k == v else [(q, 1), (k, 1), (v, 1)]
    if (_UP_W(name) or _UP_B(name)) and ne_axis == 2 * spec.n_ff[il]:  # Phi-3's fused up + gate
        return [(spec.n_ff[il], 2)]
    if _GATE_UP_W(name):
        return [(spec.n_ff_exp, 2)]
    return [(ne_axis, 1)]


def _granularity(spec: ModelSpec, name: str, ne: tuple[int, ...], blck: int, il: int, n_seg: int,
                 n_dev: int) -> list[int]:
    """`get_split_granularity`: each segment's split is a multiple of this (whole heads, whole quant blocks)."""
    if _is_recr(spec, il):  # linear attention
        head_dim = spec.ssm_d_state
        g_qkv = math.lcm(math.lcm(blck, 128), head_dim)
        for match, g in ((lambda n: _QKV_W(n) or _GATE_W(n) or _CONV1D(n) or _SSM_OUT(n), g_qkv),
                         (lambda n: _SSM_DT(n) or _SSM_A(n) or _SSM_ALPHA(n) or _SSM_BETA(n), g_qkv // head_dim),
                         (_SSM_BA, 2 * (g_qkv // head_dim)),
                         (_R_CACHE, g_qkv * (spec.ssm_d_conv - 1)),
                         (_S_CACHE, g_qkv * head_dim)):
            if match(name):
                return [g] * n_seg
    else:  # regular attention
        n_gqa = spec.n_head[il] // spec.n_head_kv[il] if spec.n_head_kv[il] else 0
        n_embd_q = n_gqa * spec.head_dim_k
        bsp = blck  # "to handle head sizes like 80, only increase granularity while it doesn't cause underutilization"
        while bsp < 128 and bsp * n_dev < n_embd_q:
            bsp *= 2
        g_q = math.lcm(n_embd_q, bsp)
        g_head = g_q // spec.head_dim_k
        gated = spec.arch in _QWEN_GATED
        if _SINKS(name):
            return [g_head]
        if _Q_W(name) or _Q_B(name):
            return [math.lcm(2 * n_embd_q, bsp) if gated else g_q]
        if _OUT_W(name):
            return [g_head * spec.head_dim_v]
        if _GATE_W(name):
            return [g_head if ne[1] == spec.n_head[il] else g_q]
        g_kv = g_q // n_gqa if n_gqa else 0
        g_v = (g_kv // spec.head_dim_k) * spec.head_dim_v
        if _KV_W(name) or _KV_B(name) or _KV_CACHE(name):
            return [g_v if ("attn_v" in name or "cache_v" in name) else g_kv]
        if _QKV_W(name) or _QKV_B(name):
            if gated:
                return [math.lcm(2 * n_embd_q, bsp), g_kv]
            return [g_q, g_kv, g_v] if n_seg == 3 else [g_q, g_kv]
    if _UP_W(name) or _UP_B(name) or _GATE_FW(name) or _GATE_FB(name) or _GATE_UP_W(name) or _DOWN_W(name):
        return [math.lcm(blck, 128)]
    return [1]


def tensor_slices(spec: ModelSpec, name: str, type_name: str, ne: tuple[int, ...], n_dev: int,
                  tensor_split: tuple[float, ...] = (), types: dict[str, str] | None = None) -> list[tuple[int, ...]]:
    """Each device's slice shape of a tensor on the Meta device (ggml-backend-meta.cpp `init_tensor_impl`: the split
    axis holds Σ_s ne[s][j]·nr[s]; a mirrored tensor keeps its full shape on every device). `types`: the model's
    tensor types by name, for the reference tensor whose block size sets the granularity."""
    cfg = _config(name, spec.arch)
    if cfg.axis == MIRRORED or (_QK_NORM(name) and (len(ne) < 2 or ne[1] == 1)):
        return [ne] * n_dev
    il = _layer(name)
    ref_type = type_name
    if cfg.ref:
        prefix = f"blk.{il}." if il is not None else ""
        types = types or {}
        ref_type = types.get(prefix + cfg.ref) or types.get(prefix + cfg.fallback) or ""
        if not ref_type:  # get_tensor_config_impl: GGML_ASSERT(tensor_axis_0 != nullptr)
            raise LaunchConfigError(f"-sm tensor: {name} is split by {prefix + cfg.ref}, which the model lacks, so "
                                    "llama.cpp aborts loading it; use -sm layer")
    segments = _segments(spec, name, ne[cfg.axis], il or 0)
    grans = _granularity(spec, name, ne, _blck(ref_type), il or 0, len(segments), n_dev)
    rotation = _rotation(spec, il, n_dev)
    extent = [0] * n_dev
    for (ne_s, nr_s), g_s in zip(segments, grans, strict=True):
        for j, n in enumerate(split_rows(ne_s, g_s, n_dev, rotation, tensor_split)):
            extent[j] += n * nr_s
    return [(*ne[:cfg.axis], e, *ne[cfg.axis + 1:]) for e in extent]


def device_shares(spec: ModelSpec, name: str, type_name: str, ne: tuple[int, ...], n_dev: int,
                  tensor_split: tuple[float, ...] = (), types: dict[str, str] | None = None) -> list[float]:
    """Each device's share of a tensor's elements on the Meta device: its slice over the whole (1.0 on every
    device for a mirrored tensor)."""
    whole = math.prod(ne)
    return [math.prod(s) / whole if whole else 1.0
            for s in tensor_slices(spec, name, type_name, ne, n_dev, tensor_split, types)]


def row_parallel(name: str, arch: str) -> bool:
    """A weight split by its input columns (attn_output, ssm_out, ffn_down, ffn_down_exps): each device's product is
    a partial sum of the whole output, which ggml-backend-meta.cpp's graph_compute all-reduces before the next
    subgraph (`get_tensor_config`: split axis 0 of a matrix)."""
    return name.endswith(".weight") and not _SINKS(name) and _config(name, arch).axis == 0  # sinks: one per head


def _slice_bytes(type_name: str, ne: tuple[int, ...]) -> int:
    """ggml_nbytes of a contiguous slice."""
    n = row_bytes(type_name, ne[0])
    for d in ne[1:]:
        n *= d
    return n


def tensor_model_buffers(spec: ModelSpec, tensors: list[TensorSpec], devices: tuple[Device, ...],
                         tensor_split: tuple[float, ...]) -> list[Buffer]:
    """One model buffer per device for the tensors on the Meta buffer type: Σ GGML_PAD(alloc_size(slice), align) in
    the device's own buffer type (ggml-backend-meta.cpp `ggml_backend_meta_alloc_ctx_tensors_from_buft`; a device's
    padding rules see its slice's ne0)."""
    types = {t.name: t.type for t in spec.tensors}
    sizes = [0] * len(devices)
    for t in tensors:
        for j, ne in enumerate(tensor_slices(spec, t.name, t.type, t.ne, len(devices), tensor_split, types)):
            sizes[j] += alloc_size(devices[j], t.type, ne, _slice_bytes(t.type, ne))
    name = meta_buft_name(devices)
    return [Buffer(name, "model", d.name, s) for d, s in zip(devices, sizes, strict=True)]


def tensor_kv_buffers(spec: ModelSpec, config: LaunchConfig, ctx: ContextParams, kv_sizes: tuple[int, int],
                      devices: tuple[Device, ...], offloaded: tuple[bool, ...]) -> list[Buffer]:
    """The KV cache on the Meta device (src/llama-kv-cache.cpp: cache_k_l<il>/cache_v_l<il> of
    [n_embd_{k,v}_gqa, kv_size, n_stream], V untransposed as flash attention is forced on): split by whole KV heads
    like attn_k/attn_v, one buffer per device for each cache (the base one, then the sliding-window one of an iSWA
    model: llama_kv_cache_iswa), each logged as the largest device's. Layers kept on the CPU (`offloaded` False, -ngl
    short of all) are the caller's."""
    types = {t.name: t.type for t in spec.tensors}
    out: list[Buffer] = []
    name = meta_buft_name(devices)
    for swa in (False, True):
        sizes = [0] * len(devices)
        any_layer = False
        for il in range(spec.n_layer):
            if not spec.kv_layer(il) or spec.swa_layers[il] != swa or not offloaded[il]:
                continue
            any_layer = True
            cells = kv_sizes[1] if swa else kv_sizes[0]
            for kind, type_name, width in (("k", config.cache_type_k, spec.n_embd_k_gqa(il)),
                                           ("v", config.cache_type_v, spec.n_embd_v_gqa(il))):
                full = (width, cells, ctx.n_stream)
                for j, ne in enumerate(tensor_slices(spec, f"cache_{kind}_l{il}", type_name, full, len(devices),
                                                     config.tensor_split, types)):
                    sizes[j] += alloc_size(devices[j], type_name, ne, _slice_bytes(type_name, ne))
        if any_layer:
            out += [Buffer(name, "kv", d.name, s) for d, s in zip(devices, sizes, strict=True)]
    return out + _rs_buffers(spec, ctx, devices, offloaded, types, config.tensor_split)


def _rs_buffers(spec: ModelSpec, ctx: ContextParams, devices: tuple[Device, ...], offloaded: tuple[bool, ...],
                types: dict[str, str], tensor_split: tuple[float, ...]) -> list[Buffer]:
    """A hybrid's recurrent state on the Meta device (src/llama-memory-recurrent.cpp: cache_r_l<il>, cache_s_l<il>
    of F32 [n_embd_r|n_embd_s, max(1, n_seq_max)]), split on axis 0 by whole heads (mirrored for LFM2); after the KV
    cache (llama_memory_hybrid)."""
    rows = max(1, ctx.n_seq_max)
    sizes = [0] * len(devices)
    any_layer = False
    for il in range(spec.n_layer):
        if not spec.rs_layer(il) or not offloaded[il]:
            continue
        any_layer = True
        for kind, width in (("r", spec.n_embd_r), ("s", spec.n_embd_s)):
            for j, ne in enumerate(tensor_slices(spec, f"cache_{kind}_l{il}", "F32", (width, rows), len(devices),
                                                 tensor_split, types)):
                sizes[j] += alloc_size(devices[j], "F32", ne, _slice_bytes("F32", ne))
    name = meta_buft_name(devices)
    return [Buffer(name, "kv", d.name, s) for d, s in zip(devices, sizes, strict=True)] if any_layer else []
