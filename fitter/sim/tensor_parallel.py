"""`-sm tensor`'s speed in the simulator: the Meta device's work run by every GPU at once, each on its own share.

llama.cpp 0c1e570's Meta backend (ggml/src/ggml-backend-meta.cpp `ggml_backend_meta_graph_compute`) cuts the graph
into subgraphs that end at a row-parallel product (attn_output, ssm_out, ffn_down, ffn_down_exps: each device holds
some input columns, so its output is a partial sum of the whole), runs each subgraph on every device at once, and
all-reduces the partial sums before the next one. Per subgraph:

    seconds = max_j Σ_work (max(flops · f_j / F_j, bytes · f_j / B_j) / fa_j + t_launch,j) + all-reduce

    f_j:        device j's share of the work's tensor (fitter.memory.plan.tensor_split.device_shares: its slice of the
                split weight, 1 for a mirrored one, every device reading it whole; attention: its share of the KV
                heads, the KV cache's own split); fa_j: the GPU's flash-attention rate on attention (-sm tensor
                forces flash attention on), 1 elsewhere.
    all-reduce: the generic butterfly of `allreduce_fallback`: ceil(log2 N) steps, each a copy of the f32 partial
                sum (n_embd × tokens × 4 bytes) to a partner and an ADD, plus one copy back to the devices past the
                largest power of two; each copy over the two GPUs' peer link (peer_latency_us + bytes / peer_gbps)
                or, without one, staged through host memory (host_copy_latency_us + bytes over each PCIe link).
                CUDA's NCCL and its internal two-GPU pipeline (ggml-cuda.cu ggml_backend_cuda_comm_allreduce_tensor)
                take the same steps' data over the same links; the profile's latencies stand for whichever runs.

The Meta device has no op offload (`offload_op = nullptr`): weights left on the CPU run there.
"""

from __future__ import annotations

from collections.abc import Sequence

from fitter.memory.plan.estimator import MemoryPlan
from fitter.memory.plan.tensor_split import device_shares, meta_buft_name, row_parallel
from fitter.sim.profile import Machine

ATTENTION = "attention"  # a work item's name for a layer's attention over its KV cache

# ((layer, step in the layer), tensor name or ATTENTION, flops, bytes): one piece of the Meta device's work
Work = tuple[tuple[int, int], str, float, float]


def allreduce_seconds(m: Machine, gpus: Sequence[str], n_bytes: float) -> float:
    """One all-reduce of n_bytes per device over `gpus` (ggml-backend-meta.cpp `allreduce_fallback`): the excess
    past the largest power of two folded in, the butterfly's steps, the reduced tensors copied back to the excess;
    each step as slow as its slowest copy, and an ADD launched on every device that receives."""
    n = len(gpus)
    if n < 2:
        return 0.0
    power = 1 << (n.bit_length() - 1)
    steps = (n - 1).bit_length()  # ceil(log2 n): the fold (when n is not a power of two) and log2(power) others
    copies = steps + (n != power)  # the copy back to the excess
    slowest = max(m.copy_seconds(a, b, n_bytes) for a in gpus for b in gpus if a != b)
    add = max(m.gpu_of(g).launch_us for g in gpus) * 1e-6
    return copies * slowest + steps * add


_SPLITS: dict[int, tuple[MemoryPlan, int, dict[str, tuple[list[float], bool]]]] = {}  # by the plan's id


def _split(plan: MemoryPlan, n: int, key: str, layer: int) -> tuple[list[float], bool]:
    """A tensor's (or layer's attention's) per-device shares and whether it is row-parallel: the same for every
    ubatch of a plan, so made once per plan (a prefill is many ubatches), for the tensors the Meta device holds."""
    held = _SPLITS.get(id(plan))
    if held is None or held[0] is not plan or held[1] != n:
        if len(_SPLITS) >= 16:
            _SPLITS.clear()
        spec, config = plan.model, plan.config
        types = {t.name: t.type for t in spec.tensors}
        known = {p.tensor.name: (device_shares(spec, p.tensor.name, p.tensor.type, p.tensor.ne, n,
                                               config.tensor_split, types), row_parallel(p.tensor.name, spec.arch))
                 for p in plan.placements if p.buft == meta_buft_name(plan.devices)}
        for il in range(spec.n_layer):  # attention: the KV cache's split, by whole KV heads
            known[f"{ATTENTION}{il}"] = (device_shares(spec, f"cache_k_l{il}", config.cache_type_k,
                                                       (spec.n_embd_k_gqa(il), 1, 1), n, config.tensor_split, types),
                                         False)
        held = _SPLITS[id(plan)] = (plan, n, known)
    return held[2][key]


def meta_seconds(m: Machine, plan: MemoryPlan, gpus: Sequence[str], work: Sequence[Work], n_tokens: int) -> float:
    """The Meta device's seconds for one ubatch of n_tokens: `work` is its pieces in graph order, each with the whole
    tensor's (or the whole attention's) flops and bytes."""
    spec = plan.model
    n = len(gpus)
    rates = [(m.gpu_of(g).tflops * 1e12, m.gpu_of(g).bandwidth_gbps * 1e9) for g in gpus]
    subgraphs: dict[tuple[int, int], list[float]] = {}
    reduced: set[tuple[int, int]] = set()
    for (layer, step), name, flops, size in work:
        part = (layer, 0 if step < 2 else 1)  # attention's subgraph ends at attn_output, the FFN's at ffn_down
        key = f"{ATTENTION}{layer}" if name == ATTENTION else name
        shares, row = _split(plan, n, key, layer)
        fa = [m.gpu_of(g).fa_efficiency for g in gpus] if name == ATTENTION else [1.0] * n
        if row:
            reduced.add(part)
        seconds = subgraphs.setdefault(part, [0.0] * n)
        for j, g in enumerate(gpus):
            f, b = rates[j]
            seconds[j] += max(flops * shares[j] / f, size * shares[j] / b) / fa[j] + m.gpu_of(g).launch_us * 1e-6
    partial = n_tokens * spec.n_embd * 4.0  # the f32 hidden state each device holds a partial sum of
    return sum(max(s) for s in subgraphs.values()) + len(reduced) * allreduce_seconds(m, gpus, partial)
