"""The memory estimate: a pure function of (model spec, launch config, devices) → every buffer llama.cpp allocates.

No files, no GPU, no subprocess. Each rule names the llama.cpp source it mirrors (llama.cpp 0c1e570, the copy
vendored in llama-cpp-python 0.3.36).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace

from fitter.errors import LaunchConfigError
from fitter.flags import KV_CACHE_TYPES, ContextParams, LaunchConfig, TensorOverride, resolve_context
from fitter.flags.draft import draft_context_config
from fitter.gguf.archs import ARCHS
from fitter.gguf.model_spec import ModelSpec, Role, TensorSpec
from fitter.memory.backends.devices import CPU_AVX2, CpuProfile, Device, DeviceProfile
from fitter.memory.graph.builder import TIED_OUTPUT, BackendMap
from fitter.memory.graph.compute import auto_flash_attn_mismatch, backend_map, compute_bytes_by_device
from fitter.memory.graph.graph_replay import Replayed
from fitter.memory.graph.vulkan_ops import weight_supported
from fitter.memory.plan.buffers import CPU, KINDS, Buffer, Placement, alloc_size, pad_to, row_bytes
from fitter.memory.plan.device_choice import layer_devices, model_devices, pipeline_parallel
from fitter.memory.plan.kv_cache import check_cache_types, kv_buffers, kv_cache_sizes
from fitter.memory.plan.mmproj import projector_buffers
from fitter.memory.plan.projected import guess_warning
from fitter.memory.plan.tensor_split import check_tensor_mode, meta_device, tensor_kv_buffers, tensor_model_buffers

__all__ = ["CPU", "KINDS", "Buffer", "DeviceTotals", "MemoryPlan", "Placement", "alloc_size", "complete", "estimate",
           "first_failure", "kv_cache_sizes", "layer_devices", "model_devices", "pipeline_parallel", "place",
           "row_bytes"]


@dataclass(frozen=True)
class DeviceTotals:
    model: int
    kv: int
    compute: int
    output: int

    @property
    def total(self) -> int:
        return self.model + self.kv + self.compute + self.output


@dataclass(frozen=True)
class MemoryPlan:
    model: ModelSpec
    config: LaunchConfig
    context: ContextParams
    devices: tuple[Device, ...]
    buffers: tuple[Buffer, ...]
    placements: tuple[Placement, ...]
    layer_devices: tuple[str, ...]  # per layer, plus the output layer last
    warnings: tuple[str, ...]
    pipelined: bool = False  # the scheduler pipelines ubatches across the devices (n_copies > 1)
    projected: tuple[str, ...] = ()  # kinds taken from llama.cpp's own projection (fitter.memory.plan.projected)
    draft: MemoryPlan | None = None  # the draft model's own plan (-md); its buffers are in `buffers` too

    def totals(self) -> dict[str, DeviceTotals]:
        sums: dict[str, dict[str, int]] = {CPU: dict.fromkeys(KINDS, 0)}
        for d in self.devices:
            sums[d.name] = dict.fromkeys(KINDS, 0)
        for b in self.buffers:
            sums[b.device][b.kind] += b.bytes
        return {name: DeviceTotals(**s) for name, s in sums.items()}


# ----------------------------------------------------------------------------------------------------------------
# Weights → buffer types (src/llama-model-loader.cpp `create_tensor`, src/llama-model.cpp `make_cpu_buft_list`)


def _weight_op(t: TensorSpec) -> str:
    """The op llama.cpp tests a weight's buffer type with (llm_tensor_info_for in src/llama-arch.cpp)."""
    if t.name.endswith(".bias"):
        return "add_id" if t.role is Role.EXPERT else "add"
    if t.role is Role.EMBEDDING:
        return "get_rows"
    if t.role is Role.EXPERT:
        return "mul_mat_id"
    if t.role in (Role.ATTENTION, Role.DENSE_FFN, Role.SHARED_EXPERT, Role.OUTPUT, Role.ROUTER) and len(t.ne) == 2:
        return "mul_mat"
    return "other"


def _repacks(t: TensorSpec, op: str, cpu: CpuProfile) -> bool:
    """ggml-cpu/repack.cpp: extra_buffer_type::supports_op + ggml_repack_get_optimal_repack_type."""
    dims_ok = (op == "mul_mat" and len(t.ne) == 2) or (op == "mul_mat_id" and len(t.ne) == 3)
    if not dims_ok:
        return False
    return any(t.type == type_name and t.ne[1] % multiple == 0 for type_name, multiple in cpu.repack_types)


def _cpu_buft(t: TensorSpec, config: LaunchConfig, devices: tuple[Device, ...], cpu: CpuProfile) -> str:
    """First buffer type of the CPU list that accepts the weight: host buffer, CPU_REPACK, CPU."""
    host = next((d.profile.host_buft for d in devices if d.profile.host_buft), None)
    if host is not None:
        # "avoid using a host buffer when using mmap": the pinned host type becomes plain CPU.
        return CPU if config.mmap else host
    op = _weight_op(t)
    if not config.no_repack and _repacks(t, "mul_mat_id" if op == "add_id" else op, cpu):
        return "CPU_REPACK"
    return CPU


# Which tensor names each -ot pattern matches, per model spec: a fit tries ~100 rule lists built from the same ~40
# patterns over ~700 tensors. The entry holds the spec, so its id is not reused while the entry lives.
_RULE_HITS: dict[tuple[str, int], tuple[ModelSpec, frozenset[str]]] = {}
_RULE_HITS_KEPT = 4096


def _first_rules(spec: ModelSpec, names: tuple[str, ...], rules: tuple[TensorOverride, ...]) -> dict[str, int]:
    """Each tensor name's first matching rule (llama.cpp takes the first -ot rule that matches)."""
    first: dict[str, int] = {}
    for i, rule in enumerate(rules):
        key = (rule.pattern, id(spec))
        entry = _RULE_HITS.get(key)
        if entry is None or entry[0] is not spec:
            # TensorOverride.matches, for every name at once
            entry = (spec, frozenset(filter(re.compile(rule.pattern).search, names)))
            if len(_RULE_HITS) >= _RULE_HITS_KEPT:
                _RULE_HITS.clear()
            _RULE_HITS[key] = entry
        for name in entry[1]:
            first.setdefault(name, i)
    return first


def _device_takes(dev: Device, t: TensorSpec, n_expert_used: int) -> bool:
    """llama_model_loader `select_weight_buft`: the device's buffer type is the first of the layer's list, taken when
    its backend supports the weight's op (`weight_buft_supported`); only Vulkan's refuses ops fitter's models build,
    those with a tensor past the device's buffer range (fitter.memory.graph.vulkan_ops)."""
    if dev.profile.ops != "vulkan":
        return True
    return weight_supported(t.type, t.ne, _weight_op(t), n_expert_used, dev.profile.max_op_bytes)


def place_tensors(
    spec: ModelSpec, config: LaunchConfig, devices: tuple[Device, ...], layer_dev: tuple[Device | None, ...],
    cpu: CpuProfile,
) -> list[Placement]:
    by_name = {d.name: d for d in devices}
    placements = []
    tensors = list(spec.tensors)
    # A model without output.weight reuses token_embd for the output; llama.cpp creates a duplicate tensor in the
    # output layer's buffer (TENSOR_DUPLICATED in llama-model-loader.cpp).
    embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embd is not None and not any(t.name == "output.weight" for t in tensors):
        tensors.append(TensorSpec(TIED_OUTPUT, embd.type, embd.ne, embd.n_bytes, None, Role.OUTPUT, embd.shard,
                                  embd.offset))
    embd_buft = None
    first_rule = _first_rules(spec, tuple(t.name for t in tensors), config.overrides)
    for t in tensors:
        buft = None
        i = first_rule.get(t.name)
        if i is not None:
            rule = config.overrides[i]
            if rule.buft == CPU:
                buft = _cpu_buft(t, config, devices, cpu)
            elif rule.buft in by_name:
                buft = rule.buft
            else:
                allowed = ", ".join([CPU, *by_name]) or CPU
                raise LaunchConfigError(
                    f"-ot {rule.pattern}={rule.buft}: unknown buffer type {rule.buft!r}; available: {allowed}"
                )
        if buft is None:
            if t.role is Role.EMBEDDING:
                dev = None  # the input layer always stays on the CPU
            elif t.layer is None:
                dev = layer_dev[spec.n_layer]
            else:
                dev = layer_dev[t.layer]
            if dev is not None and not _device_takes(dev, t, spec.n_expert_used):
                dev = None  # the device's backend cannot run the weight's op: the next buffer type, the CPU's
            buft = dev.name if dev is not None else _cpu_buft(t, config, devices, cpu)
        if t.name == TIED_OUTPUT and embd_buft == buft:
            # llama_model_loader::create_tensor: a duplicate in the original's buffer type is the original itself
            continue
        if t is embd:
            embd_buft = buft
        placements.append(Placement(t, buft))
    return placements


def model_buffers(placements: list[Placement], config: LaunchConfig, devices: tuple[Device, ...]) -> list[Buffer]:
    by_name = {d.name: d for d in devices}
    buffers: list[Buffer] = []
    grouped: dict[str, list[TensorSpec]] = defaultdict(list)
    for p in placements:
        grouped[p.buft].append(p.tensor)
    for buft, tensors in grouped.items():
        if buft == CPU and config.mmap:
            # With mmap the CPU buffer is the byte range of each shard spanning its CPU tensors, so it includes
            # any other tensors lying between them (llama_model_loader::get_mapping_range).
            ranges: dict[int, tuple[int, int]] = {}
            for t in tensors:
                lo, hi = ranges.get(t.shard, (t.offset, t.offset + t.n_bytes))
                ranges[t.shard] = (min(lo, t.offset), max(hi, t.offset + t.n_bytes))
            for shard in sorted(ranges):
                lo, hi = ranges[shard]
                buffers.append(Buffer("CPU_Mapped", "model", CPU, hi - lo))
            continue
        dev = by_name.get(buft)
        host = _host_profile(buft, devices) if dev is None else None
        if host is not None:  # a pinned host buffer type: its own alignment, chunks and bytes per buffer
            sizes = [pad_to(t.n_bytes, host.host_alignment) for t in tensors]
            size = sum(sizes) + host.host_extra * len(chunked(sizes, host.host_max_alloc))
        else:
            size = sum(alloc_size(dev, t.type, t.ne, t.n_bytes) for t in tensors)
        buffers.append(Buffer(buft, "model", dev.name if dev else CPU, size))
    return buffers


def _host_profile(buft: str, devices: tuple[Device, ...]) -> DeviceProfile | None:
    """The profile of the device whose pinned host buffer type `buft` is (CUDA_Host, Vulkan_Host), or None."""
    return next((d.profile for d in devices if d.profile.host_buft == buft), None)


def chunked(sizes: list[int], max_size: int | None) -> list[int]:
    """The buffers ggml_backend_alloc_ctx_tensors_from_buft makes of tensors of these (aligned) sizes, in order: a
    new one when the next tensor would take the current one past the buffer type's maximum (ggml-alloc.c)."""
    out: list[int] = []
    cur = 0
    for size in sizes:
        if max_size is not None and cur > 0 and cur + size > max_size:
            out.append(cur)
            cur = size
        else:
            cur += size
    return [*out, cur] if cur > 0 else out


def compute_buffers(
    spec: ModelSpec,
    ctx: ContextParams,
    layer_dev: tuple[Device | None, ...],
    devices: tuple[Device, ...],
    backends: BackendMap,
    cache_types: tuple[str, str],
    replayed: Replayed | None = None,
    prompt_only: bool = False,
) -> list[Buffer]:
    """One compute buffer per backend (src/llama-context.cpp: the CPU backend uses the first device's pinned host
    buffer type when it has one)."""
    by_dev = compute_bytes_by_device(spec, ctx, devices, layer_dev, backends, kv_cache_sizes(spec, ctx), cache_types,
                                     replayed, prompt_only)
    buffers = [Buffer(d.name, "compute", d.name, by_dev[d.name]) for d in devices if d.name in by_dev]
    host = next((d.profile.host_buft for d in devices if d.profile.host_buft), None)
    buffers.append(Buffer(host or CPU, "compute", CPU, by_dev[CPU]))
    return buffers


# ----------------------------------------------------------------------------------------------------------------
# Output buffer (src/llama-context.cpp `output_reserve`)


def output_buffer(spec: ModelSpec, ctx: ContextParams, layer_dev: tuple[Device | None, ...]) -> Buffer:
    # Reserved at construction for n_seq_max outputs: logits n_vocab floats per output, in the pinned host buffer
    # type of the output layer's device when it has one (ggml-vulkan's adds 32 bytes to every buffer it makes)
    n_outputs_max = ctx.n_seq_max
    size = spec.n_vocab * n_outputs_max * 4
    out_dev = layer_dev[spec.n_layer]
    host = out_dev.profile.host_buft if out_dev is not None else None
    extra = out_dev.profile.host_extra if out_dev is not None and host else 0
    return Buffer(host or CPU, "output", CPU, size + extra)


def first_failure(plan: MemoryPlan, device: str, cap_bytes: int) -> str | None:
    """The stage at which a device with cap_bytes runs out, in llama.cpp's order of allocation: model buffers
    (load_tensors), then each KV buffer (llama_kv_cache), then compute (sched_reserve); the model's, then a draft's
    (tools/server/server-context.cpp `load_model`), then the projector's. None if everything fits."""
    used = 0
    for model in ("", "draft", "mmproj"):
        for kind in ("model", "kv", "compute"):
            for b in plan.buffers:
                if b.model == model and b.kind == kind and b.device == device:
                    used += b.bytes
                    if used > cap_bytes:
                        return kind
    return None


@dataclass(frozen=True)
class Placed:
    """An estimate before its compute buffers: the context, where every layer and weight goes, and the model and KV
    buffers, which the compute graph's replay cannot change (the `-fa auto` probe keeps the cache as it was made)."""

    ctx: ContextParams
    warnings: tuple[str, ...]
    devices: tuple[Device, ...]  # the model's devices (model_devices): -sm none keeps one
    layer_dev: tuple[Device | None, ...]
    placements: tuple[Placement, ...]
    buffers: tuple[Buffer, ...]  # model, then KV
    cpu: CpuProfile = CPU_AVX2  # a draft model is placed with it too
    meta: Device | None = None  # -sm tensor: the one device the model sees (fitter.memory.plan.tensor_split)

    def device_bytes(self) -> dict[str, int]:
        """Bytes per device so far: a lower bound of the plan's device totals (compute buffers only add)."""
        out: dict[str, int] = defaultdict(int)
        for b in self.buffers:
            out[b.device] += b.bytes
        return out


def place(
    spec: ModelSpec, config: LaunchConfig, devices: tuple[Device, ...] = (), cpu: CpuProfile = CPU_AVX2
) -> Placed:
    """The first part of `estimate`: everything but the compute graph's replay."""
    ctx = resolve_context(config, spec.n_ctx_train)
    rules = ARCHS.get(spec.arch)
    forced_off = rules is not None and not rules.flash_attn and config.flash_attn != "off"
    if forced_off:  # src/llama-context.cpp llama_init_from_model, before the quantized-V check
        if KV_CACHE_TYPES[config.cache_type_v][0] > 1:
            raise LaunchConfigError(
                f"-ctv {config.cache_type_v}: llama.cpp forces flash attention off for {spec.arch}, and a quantized V "
                "cache requires it; use -ctv f16")
        forced = (f"-fa {config.flash_attn}: flash attention is not compatible with {spec.arch}, so llama.cpp "
                  "forces it off")
        ctx = replace(ctx, flash_attn=False, auto_fa=False, v_trans=True, warnings=(*ctx.warnings, forced))
    check_cache_types(spec, config, ctx)
    if ctx.n_outputs_max < ctx.n_seq_max:
        # src/llama-context.cpp: the constructor's output_reserve(n_seq_max) asserts n_seq_max <= n_outputs_max
        raise LaunchConfigError(
            f"-b {ctx.n_batch} with {ctx.n_seq_max} sequences (-np): llama.cpp aborts making the context, its logits "
            "reserved for fewer outputs than sequences (src/llama-context.cpp output_reserve); give -b >= -np")
    warnings = list(ctx.warnings)
    if devices and config.n_gpu_layers == -1 and config.fit and config.split_mode == "tensor":
        # common/fit.cpp common_params_fit_impl throws for TENSOR; common_fit_params logs it and the load goes on
        warnings.append("--fit: llama.cpp does not fit -sm tensor (llama_params_fit is not implemented for "
                        "SPLIT_MODE_TENSOR) and loads every layer as given; this estimate offloads all")
    elif devices and config.n_gpu_layers == -1 and config.fit:
        warnings.append("-ngl auto: llama-server's --fit may keep layers on the CPU; this estimate offloads all")
    devices = model_devices(config, devices)
    if config.split_mode == "tensor":
        return _place_tensor(spec, config, ctx, warnings, devices, cpu)
    unmapped = [d.name for d in devices if not d.profile.mmap]
    if config.load_mode == "auto" and unmapped:
        # src/llama-model.cpp: in load mode auto, a model device that cannot map the file (caps.mmap_support false:
        # an integrated GPU) turns mmap off: the host's weights are copied into a buffer of their own
        config = replace(config, load_mode="none")
        warnings.append(f"{', '.join(unmapped)}: the device cannot map the model file (an integrated GPU), so "
                        "llama.cpp loads the weights without mmap (-lm auto acts as -lm none)")
    layer_dev = layer_devices(spec, config, devices)
    placements = place_tensors(spec, config, devices, layer_dev, cpu)
    buffers = model_buffers(placements, config, devices) + kv_buffers(spec, config, ctx, layer_dev)
    return Placed(ctx, tuple(warnings), devices, layer_dev, tuple(placements), tuple(buffers), cpu)


def _place_tensor(spec: ModelSpec, config: LaunchConfig, ctx: ContextParams, warnings: list[str],
                  devices: tuple[Device, ...], cpu: CpuProfile) -> Placed:
    """`place` under -sm tensor: the layers go to the one Meta device as to a single GPU (src/llama-model.cpp
    `load_tensors`: splits = {1.0}), flash attention is on (src/llama-context.cpp `llama_init_from_model`), and the
    Meta device's weights and KV cache are split per device (fitter.memory.plan.tensor_split). The Meta device maps
    nothing from the file (buffer_from_host_ptr false), so load mode auto stays as it is."""
    check_tensor_mode(spec, config, len(devices))
    if config.flash_attn == "auto":
        warnings.append("-sm tensor: llama.cpp turns flash attention on, which the tensor split requires")
    if len(devices) > 1:  # ggml-backend-meta.cpp graph_compute: the reduction scratch, made at the first compute
        steps = (len(devices) - 1).bit_length()  # ceil(log2(n_devs))
        partial = 4 * spec.n_embd * ctx.n_ubatch * (spec.n_expert_used if spec.n_expert else 1)
        warnings.append(f"-sm tensor: each device also takes {steps} x {partial / 2**20:.2f} MiB of all-reduce "
                        "scratch at the first compute (the largest row-parallel output, f32), plus NCCL's own "
                        "memory on CUDA: outside llama.cpp's logged buffers, not in this estimate")
    if len(devices) == 1:  # src/llama-context.cpp llama_init_from_model
        warnings.append(f"-sm tensor on one device ({devices[0].name}): llama.cpp warns it is not recommended")
    ctx = replace(ctx, flash_attn=True, auto_fa=False, v_trans=False)
    check_cache_types(spec, config, ctx)
    meta = meta_device(devices)
    layer_dev = layer_devices(spec, replace(config, tensor_split=()), (meta,))
    placements = place_tensors(spec, config, (meta,), layer_dev, cpu)
    on_meta = [p.tensor for p in placements if p.buft == meta.name]
    buffers = tensor_model_buffers(spec, on_meta, devices, config.tensor_split)
    buffers += model_buffers([p for p in placements if p.buft != meta.name], config, devices)
    offloaded = tuple(d is not None and not config.no_kv_offload for d in layer_dev[:spec.n_layer])
    kv = tensor_kv_buffers(spec, config, ctx, kv_cache_sizes(spec, ctx), devices, offloaded)
    if not all(offloaded):  # the cache of layers on the CPU (or all of it under -nkvo) is the CPU's as ever
        host_layers = tuple(None if off else d for d, off in zip(layer_dev, offloaded, strict=False))
        kv += [b for b in kv_buffers(spec, config, ctx, (*host_layers, layer_dev[-1])) if b.device == CPU]
    return Placed(ctx, tuple(warnings), devices, layer_dev, tuple(placements), tuple(buffers + kv), cpu, meta)


def _short_of_pipeline(placed: Placed, devices: tuple[Device, ...], compute: list[Buffer]) -> str | None:
    """The first device whose free memory cannot hold its model, KV and pipelined compute buffers (llama.cpp then
    reserves again without pipeline parallelism), or None. A device of unknown free memory is taken to hold it."""
    used = dict(placed.device_bytes())
    for b in compute:
        used[b.device] = used.get(b.device, 0) + b.bytes
    for d in devices:
        free = d.free_bytes if d.free_bytes is not None else d.total_bytes
        if free is not None and used.get(d.name, 0) > free:
            return d.name
    return None


def complete(spec: ModelSpec, config: LaunchConfig, devices: tuple[Device, ...], placed: Placed,
             prompt_only: bool = False) -> MemoryPlan:
    """The rest of `estimate`: the `-fa auto` probe and the compute buffers, on `place`'s result for the same
    (spec, config, devices). The plan lists every device given; with -sm none all but one hold nothing.

    `prompt_only` sizes the prompt graph alone: llama.cpp's buffers are the larger of it and the one-token graph
    (the `-fa auto` probe, still scheduled for its check), which is the larger on the host, rarely on a device. The
    fit judges devices with it and estimates what it returns in full (fitter.memory.fit.fit)."""
    ctx, layer_dev, placements = placed.ctx, placed.layer_dev, placed.placements
    used = placed.devices if placed.meta is None else (placed.meta,)  # -sm tensor: the scheduler sees one device
    warnings = list(placed.warnings)
    guess = guess_warning(spec, devices)
    if guess is not None:
        warnings.append(guess)
    cache_types = (config.cache_type_k, config.cache_type_v)
    # the Meta device has no offload_op (ggml-backend-meta.cpp), and the scheduler pipelines only with -sm layer
    backends = backend_map(used, layer_dev, {p.tensor.name: p.buft for p in placements}, config.no_kv_offload,
                           not config.no_op_offload and placed.meta is None, pipeline_parallel(spec, config, used))
    replayed = Replayed()  # this estimate's graphs only
    bad_layer = auto_flash_attn_mismatch(spec, ctx, backends, kv_cache_sizes(spec, ctx), cache_types, used,
                                         None if prompt_only else replayed)
    if bad_layer is not None:
        ctx = replace(ctx, flash_attn=False)
        warnings.append(
            f"-fa auto: layer {bad_layer}'s flash attention would run off the layer's device, so llama.cpp turns "
            "flash attention off (its V cache stays untransposed); pin it with -fa on or off"
        )
    buffers = list(placed.buffers)
    compute = compute_buffers(spec, ctx, layer_dev, used, backends, cache_types, replayed, prompt_only)
    short = _short_of_pipeline(placed, used, compute) if backends.n_copies > 1 else None
    if short is not None:
        # src/llama-context.cpp `sched_reserve`: "compute buffer allocation failed, retrying without pipeline
        # parallelism": a fresh scheduler with one copy of the inputs
        backends = replace(backends, n_copies=1)
        compute = compute_buffers(spec, ctx, layer_dev, used, backends, cache_types, None, prompt_only)
        warnings.append(f"{short}: pipeline parallelism's compute buffers do not fit its free memory, so llama.cpp "
                        "retries without it (one copy of the scheduler's inputs)")
    if placed.meta is not None:
        # ggml-backend-meta.cpp `ggml_backend_meta_buffer_type_alloc_buffer`: the graph is planned at full size and
        # that size is allocated on every device
        meta = placed.meta.name
        compute = [c for b in compute for c in ([replace(b, device=d.name) for d in placed.devices]
                                                 if b.device == meta else [b])]
    buffers += compute
    buffers.append(output_buffer(spec, ctx, layer_dev))
    draft = _draft_plan(spec, config, devices, ctx, buffers, placed.cpu, prompt_only)
    if draft is not None:
        buffers += [replace(b, model="draft") for b in draft.buffers]
        warnings += [f"the draft model (-md): {w}" for w in draft.warnings if w not in warnings]  # its own only
    if config.mmproj:  # loaded last (tools/server/server-context.cpp load_model)
        if spec.projector is None:
            raise LaunchConfigError(f"--mmproj {config.mmproj}: the projector's header was not read, so its memory "
                                    "cannot be estimated")
        mmproj, notes = projector_buffers(spec.projector, config, devices, ctx)
        buffers += mmproj
        warnings += notes
    return MemoryPlan(
        model=spec,
        config=config,
        context=ctx,
        devices=devices,
        buffers=tuple(buffers),
        placements=placements,
        layer_devices=tuple(d.name if d else CPU for d in layer_dev),
        warnings=tuple(warnings),
        pipelined=backends.n_copies > 1,
        draft=draft,
    )


def _draft_plan(spec: ModelSpec, config: LaunchConfig, devices: tuple[Device, ...], ctx: ContextParams,
                buffers: list[Buffer], cpu: CpuProfile, prompt_only: bool) -> MemoryPlan | None:
    """The draft model's plan (-md): llama-server loads it once the model and its context are made
    (tools/server/server-context.cpp `load_model`), so its layers split over what the devices have left
    (llama_model_load reads their free memory then), and its context is the model's (fitter.flags.draft). Under
    llama-server's own --fit the draft takes the per-device layer counts the fit wrote into -ts instead
    (common/fit.cpp set_ngl_tensor_split_tbo), which this estimate, like every one with -ngl auto, does not know;
    fitter's plans and exports pin -fit off."""
    if not config.draft_model:
        return None
    if spec.draft is None:
        raise LaunchConfigError(f"-md {config.draft_model}: the draft model's header was not read, so its memory "
                                "cannot be estimated")
    used: dict[str, int] = defaultdict(int)
    for b in buffers:
        used[b.device] += b.bytes
    left = tuple(replace(d, free_bytes=max(0, d.free_bytes - used[d.name])) if d.free_bytes is not None else d
                 for d in devices)
    draft_config = draft_context_config(config, ctx.n_ctx)
    return complete(spec.draft, draft_config, left, place(spec.draft, draft_config, left, cpu), prompt_only)


def estimate(
    spec: ModelSpec,
    config: LaunchConfig,
    devices: tuple[Device, ...] = (),
    cpu: CpuProfile = CPU_AVX2,
) -> MemoryPlan:
    """Every buffer llama.cpp will allocate for this model, these flags and these devices."""
    return complete(spec, config, devices, place(spec, config, devices, cpu))
