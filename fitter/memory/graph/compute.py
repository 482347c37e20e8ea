"""Compute buffers: the peak of llama.cpp's graph allocator, derived from each architecture's graph shapes.

For the architectures in `fitter.memory.graph.graphs.GRAPH_ARCHS` with every layer on one backend, the worst-case graph
is rebuilt node for node and ggml-alloc is replayed on it (fitter.memory.graph.graphs,
fitter.memory.graph.ggml_graph): that matches llama.cpp to within 1 % on every golden case. Otherwise (other
architectures, layers split across devices) the coarser phase model below gives the estimate; it is not validated
against llama.cpp (its errors on the CPU goldens were -38 % … +12 % before the graph replay replaced it
there), and the estimate says so.

The phase model. llama.cpp sizes compute buffers by reserving the worst-case prompt graph
(src/llama-context.cpp `sched_reserve`): n_tokens = min(n_ctx, n_ubatch) rounded up to a multiple of n_seq_max,
n_outputs = min(n_ctx, n_ubatch, n_outputs_max)
(llama-server: one per slot), every KV cell visible.
ggml-alloc (ggml/src/ggml-alloc.c) then places each node in a buffer, frees a tensor after its last consumer and
lets element-wise ops (add, mul, rms_norm, rope, soft_max, …) reuse their parent's memory. The buffer's size is the
allocator's high-water mark. This module computes that high-water mark from the live tensors of each phase of the
graph, with sizes from the model's shapes:

* graph inputs stay allocated while any layer still reads them: token ids, positions, output ids, and for every
  KV cache (full and sliding-window) its KQ mask (n_kv × n_tokens, f16 with flash attention, else f32,
  src/llama-graph.cpp `build_attn_inp_kq_mask`) and the K/V row indices (i64; the transposed V cache used without
  flash attention needs one index per element, src/llama-kv-cache.cpp `build_input_v_idxs`);
* attention (src/llama-graph.cpp `build_attn`): the residual, Q/K/V projections, and without flash attention the
  KQ scores n_kv × n_tokens × n_head f32 (soft_max runs in place) and the permuted, contiguous KQV result;
* feed-forward: routed experts hold gate, up and the activated product for n_expert_used × n_tokens rows
  (`build_moe_ffn`), dense blocks the same for n_ff, shared experts on top of the routed output;
* the output head: the final normalised activations, their get_rows by output ids and the logits
  n_vocab × n_outputs f32.

A device's buffer holds the phases of the layers placed on it; inputs are copied to every device that reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fitter.flags import ContextParams
from fitter.gguf.model_spec import ModelSpec
from fitter.memory.backends.devices import CPU_ALIGNMENT, Device
from fitter.memory.graph.builder import BackendMap, GraphParams
from fitter.memory.graph.ggml_graph import BufferType
from fitter.memory.graph.graph_replay import Replayed, flash_attn_devices_match, graph_compute_bytes
from fitter.memory.graph.graphs import replays
from fitter.memory.graph.op_rules import OpRules

F32 = 4
I32 = 4
SCHED_MAX_COPIES = 4  # GGML_SCHED_MAX_COPIES, ggml/CMakeLists.txt
I64 = 8


@dataclass(frozen=True)
class GraphShape:
    n_tokens: int
    n_outputs: int
    n_kv: tuple[int, int]  # cells visible to full-attention and sliding-window layers


def graph_shape(ctx: ContextParams, kv_sizes: tuple[int, int]) -> GraphShape:
    n_tokens = min(ctx.n_ctx, ctx.n_ubatch)
    # graph_reserve (src/llama-context.cpp 2528-2531) rounds the tokens up to a multiple of n_seqs (n_seq_max); the
    # outputs stay min(n_tokens, n_outputs_max) of the unrounded count (sched_reserve)
    n_seqs = max(ctx.n_seq_max, 1)
    return GraphShape(-(-n_tokens // n_seqs) * n_seqs, min(n_tokens, ctx.n_outputs_max), kv_sizes)


def _input_bytes(spec: ModelSpec, ctx: ContextParams, g: GraphShape, swa_layers: set[bool]) -> int:
    """Graph inputs read by the given kinds of layer (full attention: False, sliding window: True)."""
    T = g.n_tokens
    mask_elt = 2 if ctx.flash_attn else F32
    v_idx = T * (max(spec.n_embd_v_gqa(il) for il in range(spec.n_layer)) if ctx.v_trans else 1)
    total = 0
    for is_swa in swa_layers:
        n_kv = g.n_kv[1] if is_swa else g.n_kv[0]
        total += n_kv * T * mask_elt + T * I64 + (0 if spec.is_mla else v_idx * I64)
    return total


def _attention_bytes(spec: ModelSpec, ctx: ContextParams, g: GraphShape, il: int) -> int:
    T = g.n_tokens
    n_head = spec.n_head[il]
    n_kv = g.n_kv[1] if spec.swa_layers[il] else g.n_kv[0]
    residual = spec.n_embd * T * F32
    q = n_head * spec.head_dim_k * T * F32
    k = spec.n_embd_k_gqa(il) * T * F32
    v = spec.n_embd_v_gqa(il) * T * F32
    out = n_head * spec.head_dim_v * T * F32
    if ctx.flash_attn:
        return residual + q + k + v + out
    kq = n_kv * T * n_head * F32
    return residual + q + max(k + v, kq + 2 * out)


def _ffn_bytes(spec: ModelSpec, g: GraphShape, il: int) -> int:
    T = g.n_tokens
    residual = spec.n_embd * T * F32
    normed = spec.n_embd * T * F32
    is_moe = spec.n_expert > 0 and il >= spec.n_layer_dense_lead
    if not is_moe:
        return residual + normed + 3 * spec.n_ff[il] * T * F32
    k = spec.n_expert_used
    router = 2 * spec.n_expert * T * F32 + spec.n_expert * T * I32 + 2 * k * T * F32
    routed = 3 * spec.n_ff_exp * k * T * F32
    down = spec.n_embd * k * T * F32
    peak = residual + normed + router + max(routed, spec.n_ff_exp * k * T * F32 + down)
    if spec.n_expert_shared:
        shexp_ff = spec.n_ff_shexp or spec.n_ff_exp * spec.n_expert_shared
        peak = max(peak, residual + normed + spec.n_embd * T * F32 + 3 * shexp_ff * T * F32)
    return peak


def _output_bytes(spec: ModelSpec, g: GraphShape) -> int:
    return 2 * spec.n_embd * g.n_tokens * F32 + spec.n_vocab * g.n_outputs * F32


def backend_map(
    devices: tuple[Device, ...], layer_dev: tuple[Device | None, ...], weight_device: Mapping[str, str],
    kv_on_cpu: bool, op_offload: bool = True, pipeline_parallel: bool = False,
) -> BackendMap:
    """ggml_backend_sched's view of a placement: devices are backends 0…n-1, the CPU is backend n. `op_offload`:
    llama_context_params.op_offload (`--no-op-offload` turns it off); `pipeline_parallel`: the context's scheduler
    keeps GGML_SCHED_MAX_COPIES copies of its inputs (ggml-backend.cpp `ggml_backend_sched_new`)."""
    index = {d.name: i for i, d in enumerate(devices)}
    cpu = len(devices)
    return BackendMap(
        n_backends=cpu + 1,
        weight_backend={name: index.get(dev, cpu) for name, dev in weight_device.items()},
        layer_backend=tuple(index[d.name] if d is not None else cpu for d in layer_dev),
        kv_on_cpu=kv_on_cpu,
        full_offload=bool(devices) and all(d is not None for d in layer_dev),
        offload_min_batch=tuple(d.profile.offload_min_batch if op_offload and d.profile.op_offload else None
                                for d in devices),
        ops=tuple(OpRules(d.profile.ops, d.profile.max_op_bytes, d.profile.graph_optimize) for d in devices),
        n_copies=SCHED_MAX_COPIES if pipeline_parallel else 1,
    )


def auto_flash_attn_mismatch(
    spec: ModelSpec, ctx: ContextParams, backends: BackendMap, kv_sizes: tuple[int, int], cache_types: tuple[str, str],
    devices: tuple[Device, ...] = (), replayed: Replayed | None = None,
) -> int | None:
    """The first layer whose flash-attention op llama.cpp would place off the layer's device under `-fa auto`
    (then it turns flash attention off for the whole context), or None. With `replayed`, the probe graph's compute
    bytes on `devices` are kept for `compute_bytes_by_device`."""
    if not ctx.auto_fa or backends.n_backends == 1 or not replays(spec):
        return None
    n = ctx.n_seq_max  # the probe graph: one token per sequence
    params = GraphParams(n, n, kv_sizes, ctx.n_stream, True, *cache_types, backends, ctx.v_trans, n)
    return flash_attn_devices_match(spec, params, compute_bufts(devices), replayed)


def compute_bufts(devices: tuple[Device, ...]) -> tuple[BufferType, ...]:
    """The buffer types of the scheduler's compute buffers, devices first: each device's own, and for the CPU
    backend the host buffer type of the model's first device when it has one (src/llama-context.cpp: "use the
    host buffer of the first device CPU for faster transfer of the intermediate state"), else the CPU's."""
    own = tuple(BufferType(d.profile.alignment, d.profile.max_alloc) for d in devices)
    first = devices[0].profile if devices else None
    if first is not None and first.host_buft:
        return (*own, BufferType(first.host_alignment, first.host_max_alloc, first.host_extra))
    return (*own, BufferType(CPU_ALIGNMENT))


def reserved(before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, ...]:
    """A compute buffer's chunks after one more graph is reserved: ggml_gallocr_reserve_n makes the buffer anew (of
    the new graph's chunks) when a chunk grows or none was made, else keeps it (ggml-alloc.c)."""
    if not before or any(new > (before[i] if i < len(before) else 0) for i, new in enumerate(after)):
        return after
    return before


def compute_bytes_by_device(
    spec: ModelSpec,
    ctx: ContextParams,
    devices: tuple[Device, ...],
    layer_dev: tuple[Device | None, ...],
    backends: BackendMap,
    kv_sizes: tuple[int, int],
    cache_types: tuple[str, str],
    replayed: Replayed | None = None,
    prompt_only: bool = False,
) -> dict[str, int]:
    """Peak compute bytes per device name ("CPU" for the host); `replayed`: graphs this estimate sized already;
    `prompt_only`: the prompt graph alone (fitter.memory.fit.fit's judgments, see `complete`)."""
    g = graph_shape(ctx, kv_sizes)
    if not replays(spec):
        return _phase_bytes_by_device(spec, ctx, layer_dev, g)
    cpu = len(devices)
    bufts = compute_bufts(devices)
    # sched_reserve reserves the prompt graph and the one-token-per-sequence graph; a buffer is made anew only when
    # one of its chunks grows (one chunk unless its buffer type has a maximum size: the larger of the two graphs)
    chunks: list[tuple[int, ...]] = [()] * (cpu + 1)
    # (llama_context::graph_reserve: n_seq_max sequences; graph_shape rounded the tokens up to a multiple of them)
    n_seqs = ctx.n_seq_max
    graphs = [(g.n_tokens, g.n_outputs), (n_seqs, n_seqs)]
    for n_tokens, n_outputs in graphs[:1] if prompt_only else graphs:
        params = GraphParams(n_tokens, n_outputs, kv_sizes, ctx.n_stream, ctx.flash_attn, *cache_types, backends,
                             ctx.v_trans, n_seqs)
        sized = graph_compute_bytes(spec, params, bufts, replayed)
        chunks = [reserved(a, b) for a, b in zip(chunks, sized, strict=True)]
    peaks = [buft.bytes(c) for buft, c in zip(bufts, chunks, strict=True)]
    return {**{d.name: peaks[i] for i, d in enumerate(devices)}, "CPU": peaks[cpu]}


def _phase_bytes_by_device(
    spec: ModelSpec, ctx: ContextParams, layer_dev: tuple[Device | None, ...], g: GraphShape
) -> dict[str, int]:
    """Peak compute bytes per device from the live tensors of each phase of the layers it runs."""
    T = g.n_tokens
    names = [d.name if d is not None else "CPU" for d in layer_dev]
    base_inputs = T * I32 + T * I32 + g.n_outputs * I32  # tokens, positions, output ids
    out: dict[str, int] = {}
    for name in dict.fromkeys(names):
        layers = [il for il in range(spec.n_layer_trunk) if names[il] == name]
        kinds = {spec.swa_layers[il] for il in layers}
        inputs = _input_bytes(spec, ctx, g, kinds) + (base_inputs if name == "CPU" or layers else 0)
        peak = 0
        for il in layers:
            peak = max(peak, _attention_bytes(spec, ctx, g, il), _ffn_bytes(spec, g, il))
        total = inputs + peak
        if names[spec.n_layer] == name:
            # The output head runs after the last layer has released the KV inputs.
            total = max(total, base_inputs + _output_bytes(spec, g))
        out[name] = total
    if "CPU" not in out:
        # token embedding lookup always runs on the CPU (the input layer stays there)
        out["CPU"] = base_inputs + spec.n_embd * T * F32
    return out
