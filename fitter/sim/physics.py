"""Simulated machines: a deterministic performance model of llama.cpp on a GPU+CPU machine, driven by the
estimator's memory plan, for tuning without hardware (`--backend sim --machine NAME|FILE`).

A machine profile (`fitter/sim/machines/*.toml`, or any TOML file of the same keys) holds physical parameters only;
nothing in it refers to a flag or a configuration. Where each tensor lives, the KV cache, the context and the
device totals all come from `fitter.memory.plan.estimator.estimate`. The equations, for one ubatch of m tokens whose
queries attend n_kv cells on average:

    ubatch(m)  = Σ_work max(flops / F_dev, bytes / B_dev)          roofline of each weight and each layer's attention
               + Σ_cpu-resident weights bytes_w / B_pcie            op offload only: m ≥ 32 and a GPU (ggml-cuda.cu
                                                                     offload_op), the weights copied per ubatch;
                                                                     B_pcie: the pinned rate from a pinned host
                                                                     buffer (-lm none: CUDA_Host), else the mapped
               + hand_offs · t_split                                changes of device along the graph: the token
                                                                     embedding (CPU), then per layer its attention
                                                                     weights, attention, router, FFN or experts, and
                                                                     the output (graph splits − 1)
               + ops_gpu · t_launch + ops_cpu · t_sync · threads    kernel launches; a CPU barrier per op

  weight w:  bytes = its size (experts: × u, the share of experts any of the m tokens routes to,
             u = 1 − (1 − k/E)^(1 + (m − 1)·s) for top-k of E, s the layer's routing spread: the profile's
             routing_spread_first at the first expert layer to routing_spread_last at the last, linear; 1 (the
             default) is independent draws, u = 1 − (1 − k/E)^m), flops = 2 · elements · m (experts: × k/E;
             output: one row, as llama-bench asks logits of the last token only). It runs where it lives; under op
             offload the CPU-resident ones (not the token embedding, a row lookup) run on the first GPU.
  attention: on the device of the layer's KV (the CPU with -nkvo), bytes = n_kv' · (K + V row bytes of the cache
             types: q8_0 reads 34/64 of f16) + without flash attention 3 passes over the f32 scores
             (4 · n_head · m · n_kv'), flops = 2 · m · n_kv' · n_head · (d_k + d_v) + 2 per quantized KV element
             (dequantisation); n_kv' = min(n_kv, window) on sliding-window layers.
  GPU:       F = tflops, B = bandwidth (achieved, not nominal).
  CPU:       threads fill P-cores, then E-cores (speed e), then SMT siblings (gain s on compute, nothing on
             bandwidth: siblings share their core's miss slots); past the logical CPUs, time slicing scales both by
             logical / threads. With c and b those P-core equivalents, F = c · core_gflops and
             B = min(b · core_gbps, channels · MT/s · 8 B · efficiency): decode saturates at the memory limit.
             static_split w: that share of each op's work is one equal chunk per thread, run at n × the slowest
             thread's speed (harmonic blend with the rest). busy_cores: cores another job holds (P first), gone
             from the pool; past the free hardware threads each CPU op also waits barrier_wait_us.
  FA:        with -fa on, attention runs at fa_efficiency of its device's rates (the CPU's or the GPU's).

  -sm tensor: the Meta device's work is fitter.sim.tensor_parallel's (every GPU at once on its share, all-reduced
             over the GPUs' link per subgraph); it offloads no op, and a hand-off to it waits for its slowest GPU.

    decode t/s  = 1 / ubatch(1) at n_kv = depth + n/2                         (threads: -t)
    prefill t/s = n_prompt / Σ ubatch(m_i) over the -b/-ub chunks at n_kv = their mean position (-tb, else -t)

With S streams served at once (a workload's concurrency, llama-server's slots): a decode step is one ubatch of S
tokens, one per stream, whose attention reads each stream's own n_kv cells (aggregate decode = S / ubatch(S));
their S prompts share llama-server's batches, modelled as one prompt of S · n_prompt tokens at the depth (which
overstates attention past the depth for S > 1; time to first token is that prefill's time).

Each repetition's time is multiplied by 1 + noise · N(0, 1), drawn from a generator seeded by (the profile's seed,
the config however its flags are spelled, the threads, the test, the repetition): the same config gives the same
samples in any order. A model load takes file bytes / disk + GPU weight bytes / PCIe, and none when the model-level
flags repeat the previous trial's (llama-bench's rule, fitter.measure.worker.MODEL_LEVEL).
Memory is the plan: a GPU whose buffers plus the CUDA context exceed its free memory (total − reserved), or host
buffers (the model mapping included) over the RAM, fail with `oom` at the first buffer, in llama.cpp's order of
allocation (model, KV, compute, output), that does not fit.
"""

from __future__ import annotations

import itertools

from fitter.flags import KV_CACHE_TYPES
from fitter.gguf.model_spec import Role
from fitter.measure.types import BenchSpec, OomInfo
from fitter.memory.fit.fit_devices import expert_layers
from fitter.memory.plan.estimator import CPU, KINDS, Buffer, MemoryPlan, model_devices, row_bytes
from fitter.memory.plan.tensor_split import meta_buft_name
from fitter.sim.profile import Cpu, Machine
from fitter.sim.tensor_parallel import ATTENTION, Work, meta_seconds
from fitter.units import GIB, MIB

OP_OFFLOAD_MIN_BATCH = 32  # ggml-cuda.cu ggml_backend_cuda_device_offload_op: get_op_batch_size(op) >= 32
FA_OFF_PASSES = 3  # without flash attention the f32 KQ scores are written, soft-maxed in place, then read
DEQUANT_FLOPS = 2.0  # per element of a quantized KV cache read
# Order of a layer's work (for counting splits): attention weights and norms, the attention itself, then the FFN.
_STEP = {Role.ROUTER: 2, Role.SHARED_EXPERT: 3, Role.DENSE_FFN: 4, Role.EXPERT: 4}


def thread_capacity(cpu: Cpu, threads: int) -> tuple[float, float]:
    """(compute, bandwidth) of `threads` threads in P-core equivalents, on the cores `busy_cores` leaves free."""
    p_free = cpu.p_cores - min(cpu.busy_cores, cpu.p_cores)
    e_free = cpu.e_cores - min(max(cpu.busy_cores - cpu.p_cores, 0), cpu.e_cores)
    p = min(threads, p_free)
    e = min(max(threads - p_free, 0), e_free)
    s = min(max(threads - p_free - e_free, 0), p_free * (cpu.smt - 1))
    compute, bandwidth = p + e * cpu.e_core_speed + s * cpu.smt_gain, p + e * cpu.e_core_speed
    if cpu.static_split:
        # ggml-cpu splits most ops into one equal chunk per thread: the row-split ops (ops.cpp: dr = (nr + nth - 1) /
        # nth, ir0 = dr * ith) and mul_mat whenever its chunks are fewer than 4 per thread (ggml-cpu.c
        # ggml_compute_forward_mul_mat: "Re-chunk it by thread"); ggml_graph_compute_thread then waits at
        # ggml_barrier after every node, so such an op ends when the slowest thread ends: every thread runs at the
        # pace of the slowest (an E-core, or a P-core shared by two SMT siblings). Time is the harmonic blend.
        n = p + e + s
        slow_c = min(cpu.e_core_speed if e else 1.0, (1 + cpu.smt_gain) / 2 if s else 1.0)
        slow_b = min(cpu.e_core_speed if e else 1.0, 0.5 if s else 1.0)
        w = cpu.static_split
        compute = 1 / (w / (n * slow_c) + (1 - w) / compute)
        bandwidth = 1 / (w / (n * slow_b) + (1 - w) / bandwidth)
    scale = min(1.0, _free_logical(cpu) / threads)
    return compute * scale, bandwidth * scale


def _free_logical(cpu: Cpu) -> int:
    """Hardware threads not held by the other job: past them the OS time-slices llama.cpp's threads."""
    p_free = cpu.p_cores - min(cpu.busy_cores, cpu.p_cores)
    e_free = cpu.e_cores - min(max(cpu.busy_cores - cpu.p_cores, 0), cpu.e_cores)
    return p_free * cpu.smt + e_free


def _rates(m: Machine, dev: str, threads: int) -> tuple[float, float]:
    """(FLOP/s, bytes/s) of a device."""
    if dev == CPU:
        compute, bandwidth = thread_capacity(m.cpu, threads)
        return compute * m.cpu.core_gflops * 1e9, min(bandwidth * m.cpu.core_gbps, m.ram.gbps) * 1e9
    g = m.gpu_of(dev)
    return g.tflops * 1e12, g.bandwidth_gbps * 1e9


def ubatch_seconds(m: Machine, plan: MemoryPlan, n_tokens: int, n_kv: float, threads: int, n_seq: int = 1) -> float:
    """One llama_decode of n_tokens whose queries attend n_kv cells on average (the module's equation)."""
    return sum(ubatch_stages(m, plan, n_tokens, n_kv, threads, n_seq).values())


def ubatch_stages(m: Machine, plan: MemoryPlan, n_tokens: int, n_kv: float, threads: int,
                  n_seq: int = 1) -> dict[str, float]:
    """One ubatch's seconds on each device (the module's equation, its terms charged to the device that spends
    them: a hand-off to the device it hands off to, op offload's copies to the GPU that runs them). `n_seq`
    sequences share the ubatch's tokens: each reads its own n_kv cells."""
    spec, config = plan.model, plan.config
    # the scheduler's GPUs are the model's devices: under -sm none only -mg's (the plan lists every device given)
    gpus = [d.name for d in model_devices(config, plan.devices)]
    # -sm tensor: the scheduler's one GPU is the Meta device, run by every GPU at once (fitter.sim.tensor_parallel);
    # it offloads no op (ggml-backend-meta.cpp: offload_op = nullptr)
    meta = meta_buft_name(plan.devices) if config.split_mode == "tensor" and gpus else None
    offload = bool(gpus) and meta is None and not config.no_op_offload and n_tokens >= OP_OFFLOAD_MIN_BATCH
    k_share = spec.n_expert_used / spec.n_expert if spec.n_expert else 1.0
    used = expert_shares(m, plan, n_tokens)
    work: list[tuple[tuple[int, int], str, float, float, str]] = []  # (order, device, flops, bytes, name)
    pcie = pinned = 0.0
    host_bufts = {d.profile.host_buft for d in plan.devices if d.profile.host_buft}
    for p in plan.placements:
        t = p.tensor
        if t.role is Role.EMBEDDING:
            continue  # get_rows on the CPU: a row per token
        n_el = 1
        for d in t.ne:
            n_el *= d
        rows: float = 1 if t.role is Role.OUTPUT else n_tokens
        size: float = t.n_bytes
        if t.role is Role.EXPERT:
            rows, size = n_tokens * k_share, t.n_bytes * used[t.layer]
        dev = p.buft if p.buft in gpus or p.buft == meta else CPU
        if dev == CPU and offload:
            # ggml-backend.cpp ggml_backend_sched_backend_id_from_cur: the first backend that wants the op; the copy
            # DMAs straight from a pinned host buffer (-lm none: CUDA_Host), else through the driver's staging
            if p.buft in host_bufts:
                dev, pinned = gpus[0], pinned + size
            else:
                dev, pcie = gpus[0], pcie + size
        layer = spec.n_layer if t.layer is None else t.layer
        work.append(((layer, _STEP.get(t.role, 0)), dev, 2.0 * n_el * rows, size, t.name))
    for il in range(spec.n_layer_trunk):
        work.append(((il, 1), *_attention(m, plan, il, n_tokens, n_kv, n_seq), ATTENTION))
    work.sort(key=lambda w: w[0])
    stages = dict.fromkeys([CPU, *gpus] if meta is None else [CPU, meta], 0.0)
    if pcie or pinned:
        first = m.gpu_of(gpus[0])
        stages[gpus[0]] += pcie / first.pcie_gbps / 1e9 + pinned / (first.pcie_pinned_gbps or first.pcie_gbps) / 1e9
    rates = {dev: _rates(m, dev, threads) for dev in {CPU, *gpus}}
    on_meta: list[Work] = []
    for order, dev, flops, size, name in work:
        if dev == meta:
            on_meta.append((order, name, flops, size))
            continue
        f, b = rates[dev]
        stages[dev] += max(flops / f, size / b)
    if meta is not None:
        stages[meta] += meta_seconds(m, plan, gpus, on_meta, n_tokens)
    path = [CPU] + [w[1] for w in work]  # the token embedding is looked up on the CPU
    activation = n_tokens * spec.n_embd * 4.0  # the f32 hidden state a split hands to the next device
    for src, dst in itertools.pairwise(path):
        if src == dst:
            continue
        gpu = dst if dst != CPU else src
        if gpu == meta:  # a hand-off to or from the Meta device waits for its slowest GPU
            stages[gpu] += max(m.gpu_of(g).split_sync_us for g in gpus) * 1e-6
            continue
        stages[gpu] += m.gpu_of(gpu).split_sync_us * 1e-6
        if src != CPU and dst != CPU:
            # ggml-cuda.cu ggml_backend_cuda_cpy_tensor_async: cudaMemcpyPeerAsync, over the peer link or the host
            stages[dst] += activation / (m.peer_gbps(src, dst) * 1e9)
    for dev in gpus if meta is None else ():  # the Meta device's launches are in its own seconds
        stages[dev] += sum(w[1] == dev for w in work) * m.gpu_of(dev).launch_us * 1e-6
    sync = m.cpu.sync_us * threads
    if threads > _free_logical(m.cpu):
        # ggml_barrier spins (ggml_thread_cpu_relax) until every thread has arrived: with more threads than free
        # hardware threads one of them is descheduled at most barriers, and the op waits for the OS to run it again
        sync += m.cpu.barrier_wait_us
    stages[CPU] += sum(w[1] == CPU for w in work) * sync * 1e-6
    return stages


def expert_shares(m: Machine, plan: MemoryPlan, n_tokens: int) -> dict[int | None, float]:
    """Per expert layer, the share of its experts a ubatch of n_tokens reads (the module's u): its routing spread
    taken linearly from the profile's first expert layer's to its last's."""
    spec = plan.model
    k_share = spec.n_expert_used / spec.n_expert if spec.n_expert else 1.0
    layers = expert_layers(spec)
    first, last = m.routing_spread_first, m.routing_spread_last
    out: dict[int | None, float] = {}
    for i, il in enumerate(layers):
        spread = first + (last - first) * (i / (len(layers) - 1) if len(layers) > 1 else 0.0)
        out[il] = 1 - (1 - k_share) ** (1 + (n_tokens - 1) * spread)
    return out


def _attention(m: Machine, plan: MemoryPlan, il: int, n_tokens: int, n_kv: float,
               n_seq: int = 1) -> tuple[str, float, float]:
    """(device, flops, bytes) of layer il's attention over its KV cache, in the unfused path's terms: each of the
    `n_seq` sequences in the ubatch reads its own cells, each token attends its own sequence's."""
    spec, config, ctx = plan.model, plan.config, plan.context
    dev = CPU if config.no_kv_offload else plan.layer_devices[il]
    cells = min(n_kv, spec.n_swa) if spec.swa_layers[il] and spec.n_swa else n_kv
    k_el, v_el = spec.n_embd_k_gqa(il), 0 if spec.is_mla else spec.n_embd_v_gqa(il)
    cell_bytes = row_bytes(config.cache_type_k, k_el) + (row_bytes(config.cache_type_v, v_el) if v_el else 0)
    heads = spec.n_head[il]
    flops = 2.0 * n_tokens * cells * heads * (spec.head_dim_k + spec.head_dim_v)
    quantized = sum(el for el, t in ((k_el, config.cache_type_k), (v_el, config.cache_type_v))
                    if KV_CACHE_TYPES[t][0] > 1)
    flops += DEQUANT_FLOPS * cells * quantized
    size = n_seq * cells * cell_bytes + n_tokens * cell_bytes  # read the cache, write the new cells
    if not ctx.flash_attn:
        size += FA_OFF_PASSES * 4.0 * heads * n_tokens * cells
        return dev, flops, size
    # the fused kernel (ggml_compute_forward_flash_attn_ext on the CPU: one query row at a time, every KV cell
    # dequantised and dotted per row, no reuse across the ubatch's queries) may run below the rate of the unfused
    # path's batched mul_mats: llama.cpp #27086 measures ~2x the instructions of a whole pp512 on Neoverse-V2
    if dev == meta_buft_name(plan.devices):  # -sm tensor: each GPU's own rate, on its share (tensor_parallel)
        return dev, flops, size
    fa = m.gpu_of(dev).fa_efficiency if dev != CPU else m.cpu.fa_efficiency
    return dev, flops / fa, size / fa


def decode_seconds(m: Machine, plan: MemoryPlan, bench: BenchSpec) -> float:
    """-n tokens generated one at a time after -d tokens of context, in each of the bench's streams at once: a
    step is one ubatch of a token per stream (llama-server batches its slots' next tokens, server-context.cpp
    update_slots)."""
    n = bench.streams
    return bench.n_gen * ubatch_seconds(m, plan, n, bench.n_depth + bench.n_gen / 2, bench.threads, n_seq=n)


def prefill_seconds(m: Machine, plan: MemoryPlan, n_prompt: int, depth: int, threads: int) -> float:
    """n_prompt tokens after depth tokens, in batches of -b split into ubatches of -ub (llama_decode). With pipeline
    parallelism (plan.pipelined) a batch's ubatches flow through the devices as a pipeline: the first ubatch takes
    every device's stage in turn, each further one adds the slowest stage (ggml-backend.cpp: the scheduler's
    n_copies input copies let device i run ubatch u while device i+1 runs ubatch u-1)."""
    ctx = plan.context
    seconds, done = 0.0, 0
    while done < n_prompt:
        batch = min(n_prompt - done, ctx.n_batch)
        stages = [ubatch_stages(m, plan, min(ctx.n_ubatch, batch - start),
                                depth + done + start + min(ctx.n_ubatch, batch - start) / 2, threads)
                  for start in range(0, batch, ctx.n_ubatch)]
        if plan.pipelined and len(stages) > 1:
            seconds += sum(stages[0].values()) + sum(max(s.values()) for s in stages[1:])
        else:
            seconds += sum(sum(s.values()) for s in stages)
        done += batch
    return seconds


def speeds(m: Machine, plan: MemoryPlan, bench: BenchSpec) -> tuple[float, float]:
    """Noise-free (prefill, decode) tokens per second, of all the bench's streams together."""
    tb = bench.threads_batch or bench.threads
    n = bench.streams
    pp = n * bench.n_prompt / prefill_seconds(m, plan, n * bench.n_prompt, bench.n_depth, tb) if bench.n_prompt else 0.0
    tg = n * bench.n_gen / decode_seconds(m, plan, bench) if bench.n_gen else 0.0
    return pp, tg


def out_of_memory(m: Machine, plan: MemoryPlan) -> tuple[OomInfo, str, int, list[Buffer]] | None:
    """The first buffer, in llama.cpp's order of allocation, that a GPU (free memory less the CUDA context) or the
    RAM cannot hold: (what failed, its device, that device's capacity, the buffers allocated before); None: fits."""
    caps = {CPU: round(m.ram.gib * GIB)}
    for d in plan.devices:
        caps[d.name] = (d.free_bytes or 0) - context_bytes(m, d.name)
    used = dict.fromkeys(caps, 0)
    done: list[Buffer] = []
    for kind in KINDS:
        for b in plan.buffers:
            if b.kind != kind:
                continue
            if used[b.device] + b.bytes > caps[b.device]:
                return OomInfo(kind, b.buft, b.bytes), b.device, caps[b.device], done
            used[b.device] += b.bytes
            done.append(b)
    return None


def context_bytes(m: Machine, device: str = "CUDA0") -> int:
    """The CUDA context of a GPU: its memory beyond llama.cpp's buffers."""
    return round(m.gpu_of(device).context_mib * MIB) if m.gpus else 0
