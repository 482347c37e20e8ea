"""The multimodal projector's buffers (`--mmproj`): libmtmd's clip context, which llama-server loads once the model,
its context and a draft are made (tools/server/server-context.cpp `load_model` → `mtmd_init_from_file`).

- Device (tools/mtmd/clip.cpp `clip_ctx::clip_ctx`, common/arg.cpp): `-mmdev` names it (`none`, like
  `--no-mmproj-offload`, keeps it on the CPU); else -dev's first device; else the build's first GPU-type device in
  registry order (ggml_backend_init_by_type: the local GPUs before RPC servers, which register after them), an
  integrated GPU only without one. `-sm`, `-mg` and `-ts` do not move it.
- Weights: one buffer of the device's default buffer type (no mmap, no repacking, no pinned host memory), each
  tensor padded to the buffer's alignment (ggml-alloc.c `ggml_backend_alloc_ctx_tensors_from_buft`).
- Compute: the warm-up graph (fitter.memory.graph.clip_graph) scheduled on [device, CPU] with the CPU backend's
  own buffer type; with `-fa auto` reserved with flash attention, and once more without it when the device cannot
  run an attention op (clip.cpp `warmup`; a buffer only grows).
"""

from __future__ import annotations

from fitter.errors import LaunchConfigError
from fitter.flags import ContextParams, LaunchConfig
from fitter.gguf.projector import ProjectorSpec
from fitter.memory.backends.devices import CPU_ALIGNMENT, Device
from fitter.memory.graph.clip_graph import CLIP_ARCHS, clip_graph
from fitter.memory.graph.compute import reserved
from fitter.memory.graph.ggml_graph import BufferType, allocate_buffers
from fitter.memory.graph.op_rules import OpRules
from fitter.memory.graph.sched import schedule
from fitter.memory.plan.buffers import CPU, Buffer, alloc_size
from fitter.memory.plan.device_choice import named_device

MODEL = "mmproj"  # Buffer.model of the projector's buffers


def projector_device(config: LaunchConfig, devices: tuple[Device, ...]) -> Device | None:
    """The device the projector's clip context runs on, None for the CPU."""
    if config.mmproj_device == "none":
        return None
    if config.mmproj_device:
        dev = named_device(config.mmproj_device, devices)
        if dev is None:  # common/arg.cpp parse_device_list
            names = ", ".join(d.name for d in devices) or "none"
            raise LaunchConfigError(f"-mmdev {config.mmproj_device}: llama.cpp has no device {config.mmproj_device!r} "
                                    f"here (invalid device); the devices are {names}")
        return dev
    if config.device_names:  # common/arg.cpp: the projector follows --device's first entry (none: the CPU)
        return None if config.device_names == ("none",) else named_device(config.device_names[0], devices)
    local = [d for d in devices if d.profile.kind != "rpc" and not d.profile.integrated]
    rpc = [d for d in devices if d.profile.kind == "rpc"]
    integrated = [d for d in devices if d.profile.integrated]
    return next(iter(local + rpc + integrated), None)


def _compute(p: ProjectorSpec, dev: Device | None, flash_attn: bool) -> tuple[list[tuple[int, ...]], bool]:
    """The compute buffers' chunks (device first when there is one, the CPU last) for one warm-up reservation, and
    whether every flash-attention node ran on the device."""
    if dev is None:
        graph = clip_graph(p, flash_attn, weight_backend=0)
        return allocate_buffers(graph, [BufferType(CPU_ALIGNMENT)], lambda t: 0), True
    graph = clip_graph(p, flash_attn, weight_backend=0)
    rules = OpRules(dev.profile.ops, dev.profile.max_op_bytes, dev.profile.graph_optimize)
    min_batch = dev.profile.offload_min_batch if dev.profile.op_offload else None
    copy, backend_of = schedule(graph, 2, (min_batch,), (rules,), 1)
    fa_on_device = all(rules.supports(n) for n in graph.nodes if n.op == "FLASH_ATTN_EXT")
    bufts = [BufferType(dev.profile.alignment, dev.profile.max_alloc), BufferType(CPU_ALIGNMENT)]
    return allocate_buffers(copy, bufts, backend_of, [rules.alloc_size(), None]), fa_on_device


# tools/mtmd/mtmd.cpp mtmd_decode_use_non_causal: the model attends to these projectors' image tokens both ways
NON_CAUSAL = ("gemma3", "gemma3nv", "gemma4v", "gemma4uv", "deepseek4v")


def check_image_batch(p: ProjectorSpec, ctx: ContextParams) -> None:
    """A projector whose image tokens the model decodes with non-causal attention needs them in one ubatch:
    libmtmd decodes an image -b tokens at a time, and llama.cpp aborts on a larger batch than -ub
    (src/llama-context.cpp: "non-causal attention requires n_ubatch >= n_tokens")."""
    need = min(ctx.n_batch, p.tokens_per_image)
    if p.projector_type in NON_CAUSAL and ctx.n_ubatch < need:
        raise LaunchConfigError(f"-ub {ctx.n_ubatch}: a {p.projector_type} projector's image is {p.tokens_per_image} "
                                f"tokens, decoded with non-causal attention in batches of -b {ctx.n_batch}, so "
                                f"llama.cpp aborts on the first image below -ub {need} (non-causal attention requires "
                                "n_ubatch >= n_tokens)")


def projector_buffers(p: ProjectorSpec, config: LaunchConfig, devices: tuple[Device, ...],
                      ctx: ContextParams) -> tuple[list[Buffer], list[str]]:
    """The projector's weight and compute buffers, and what the estimate says about them."""
    check_image_batch(p, ctx)
    dev = projector_device(config, devices)
    notes: list[str] = []
    weights = sum(alloc_size(dev, t.type, t.ne, t.n_bytes) for t in p.tensors)
    place = dev.name if dev is not None else CPU
    buffers = [Buffer(place, "model", place, weights, MODEL)]
    if p.projector_type not in CLIP_ARCHS:
        raise LaunchConfigError(f"--mmproj {p.path}: fitter rebuilds the warm-up graph of {', '.join(CLIP_ARCHS)} "
                                f"projectors; a {p.projector_type!r} projector's compute buffers are not modelled")
    chunks, fa_ok = _compute(p, dev, config.flash_attn != "off")
    if config.flash_attn == "auto" and not fa_ok:  # clip.cpp warmup: reserve again without flash attention
        again, _ = _compute(p, dev, False)
        chunks = [reserved(a, b) for a, b in zip(chunks, again, strict=True)]
        notes.append(f"--mmproj: {place} cannot run the projector's flash attention, so libmtmd turns it off there "
                     "(its buffers are the larger of both reservations)")
    sizes = [sum(c) for c in chunks]
    if dev is not None:
        buffers.append(Buffer(dev.name, "compute", dev.name, sizes[0], MODEL))
    buffers.append(Buffer(CPU, "compute", CPU, sizes[-1], MODEL))
    return buffers, notes
