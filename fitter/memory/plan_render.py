"""Rendering a memory plan: the JSON shape of CONTRACTS.md and a human table. Pure functions."""

from __future__ import annotations

from typing import Any

from fitter.flags import ContextParams, pin
from fitter.gguf.projector import ProjectorSpec
from fitter.memory.fit.fit import FitResult
from fitter.memory.fit.fit_devices import expert_layers
from fitter.memory.plan.estimator import MemoryPlan
from fitter.memory.plan.host import HostMemory, host_memory
from fitter.units import MIB


def plan_json(plan: MemoryPlan, llama_cpp: dict[str, str]) -> dict[str, Any]:
    spec = plan.model
    return {
        "for": plan.config.consumer,
        "model": {
            "path": spec.path,
            "arch": spec.arch,
            "shards": spec.n_shards,
            "n_params": spec.n_params,
            "tensor_bytes": spec.tensor_bytes,
            "identity": spec.identity,
        },
        "context": _context_json(plan.context),
        "devices": {
            name: {"model": t.model, "kv": t.kv, "compute": t.compute, "output": t.output, "total": t.total,
                   **_overhead_json(plan, name)}
            for name, t in plan.totals().items()
        },
        "device_profiles": {d.name: {"kind": d.profile.kind, "validated": d.profile.validated}
                            for d in plan.devices},
        "buffers": [{"buft": b.buft, "kind": b.kind, "bytes": b.bytes, **({"model": b.model} if b.model else {})}
                    for b in plan.buffers],
        "projected": list(plan.projected),  # kinds whose buffers are llama.cpp's own projection, not fitter's rules
        "host": _host_json(host_memory(plan)),
        "tensors": [
            {
                "name": p.tensor.name,
                "type": p.tensor.type,
                "shape": p.tensor.shape,
                "bytes": p.tensor.n_bytes,
                "layer": p.tensor.layer,
                "role": p.tensor.role.value,
                "buft": p.buft,
            }
            for p in plan.placements
        ],
        "warnings": list(plan.warnings),
        "llama_cpp": dict(llama_cpp),
        **({"draft": _draft_json(plan.draft)} if plan.draft is not None else {}),
        **({"mmproj": _projector_json(plan.model.projector)} if plan.config.mmproj and plan.model.projector else {}),
    }


def _projector_json(p: ProjectorSpec) -> dict[str, Any]:
    """The projector (--mmproj): what it is and the context one image takes; its buffers are the plan's ones marked
    "model": "mmproj"."""
    return {"path": p.path, "projector_type": p.projector_type, "n_layer": p.n_layer, "n_embd": p.n_embd,
            "image_size": p.warmup_image_size, "tokens_per_image": p.tokens_per_image,
            "tensor_bytes": sum(t.n_bytes for t in p.tensors)}


def _host_json(h: HostMemory) -> dict[str, Any]:
    """What host RAM holds while serving (fitter.memory.plan.host), bytes."""
    return {"total": h.total, "mapped": h.mapped, "mapped_locked": h.locked, "anonymous": h.anonymous,
            "pinned": h.pinned, "shared": h.shared, "prompt_cache": h.prompt_cache}


def _context_json(ctx: ContextParams) -> dict[str, Any]:
    return {"n_ctx": ctx.n_ctx, "n_ctx_seq": ctx.n_ctx_seq, "n_seq_max": ctx.n_seq_max, "kv_unified": ctx.n_stream == 1,
            "n_batch": ctx.n_batch, "n_ubatch": ctx.n_ubatch, "flash_attn": ctx.flash_attn, "swa_full": ctx.swa_full}


def _draft_json(draft: MemoryPlan) -> dict[str, Any]:
    """The draft model (-md): what it is, its context and its tensors' buffer types; its buffers are the plan's
    ones marked "model": "draft", and the devices' totals count them."""
    spec, ctx = draft.model, draft.context
    return {
        "model": {"path": spec.path, "arch": spec.arch, "n_params": spec.n_params, "tensor_bytes": spec.tensor_bytes,
                  "identity": spec.identity},
        "context": {**_context_json(ctx), "n_outputs_max": ctx.n_outputs_max},
        "tensors": [{"name": p.tensor.name, "buft": p.buft} for p in draft.placements],
    }


def _mib(n: int) -> str:
    return f"{n / MIB:10.2f}"


def _overhead_json(plan: MemoryPlan, name: str) -> dict[str, Any]:
    """CONTRACTS.md: a device's memory outside llama.cpp's buffers and where the figure comes from."""
    for d in plan.devices:
        if d.name == name and d.overhead is not None:
            return {"overhead": d.overhead.bytes, "overhead_source": d.overhead.source}
    return {}


def overhead_lines(devices: Any) -> list[str]:
    """One line per device that uses memory outside llama.cpp's buffers."""
    return [f"overhead {d.name}: {d.overhead.bytes / MIB:.2f} MiB outside llama.cpp's buffers, {d.overhead.source}"
            for d in devices if d.overhead is not None]


def plan_table(plan: MemoryPlan, llama_cpp: dict[str, str], per_tensor: bool = False) -> str:
    spec, ctx = plan.model, plan.context
    lines = [
        f"model   {spec.path}  ({spec.arch}, {spec.n_layer} layers, {spec.n_params / 1e9:.2f} B params, "
        f"{spec.tensor_bytes / MIB:.2f} MiB in {spec.n_shards} file{'s' if spec.n_shards > 1 else ''})",
        f"context n_ctx {ctx.n_ctx} ({ctx.n_seq_max} slot{'s' if ctx.n_seq_max > 1 else ''}, "
        f"{'unified' if ctx.n_stream == 1 else 'per-slot'} KV of {ctx.n_ctx_seq} cells), -b {ctx.n_batch}, "
        f"-ub {ctx.n_ubatch}, flash attention {'on' if ctx.flash_attn else 'off'}",
        f"flags   {' '.join(pin(plan.config, given=True)) or f'({plan.config.consumer} defaults)'}  "
        f"(for {plan.config.consumer})",
    ]
    if plan.draft is not None:
        draft, dctx = plan.draft.model, plan.draft.context
        lines.append(f"draft   {draft.path}  ({draft.arch}, {draft.n_layer} layers, "
                     f"{draft.tensor_bytes / MIB:.2f} MiB; its context n_ctx {dctx.n_ctx} for {dctx.n_seq_max} "
                     f"slot{'s' if dctx.n_seq_max > 1 else ''}, logits for {dctx.n_outputs_max} outputs; the model "
                     f"reserves {ctx.n_outputs_max})")
    projector = plan.model.projector
    if plan.config.mmproj and projector is not None:
        lines.append(f"mmproj  {projector.path}  ({projector.projector_type}, {projector.n_layer} layers, "
                     f"{sum(t.n_bytes for t in projector.tensors) / MIB:.2f} MiB; warm-up image "
                     f"{projector.warmup_image_size}², {projector.tokens_per_image} context tokens per image)")
    lines += ["", f"{'buffer':<28}{'kind':<9}{'MiB':>10}"]
    for b in plan.buffers:
        lines.append(f"{b.buft:<28}{b.kind:<9}{_mib(b.bytes)}" + (f"  ({b.model})" if b.model else ""))
    if plan.projected:
        lines.append(f"({' and '.join(plan.projected)}: llama.cpp's own projection per device, rounded up to the MiB)")
    lines += ["", f"{'device':<28}{'model':>10}{'kv':>10}{'compute':>10}{'output':>10}{'total':>10}"]
    for name, t in plan.totals().items():
        lines.append(f"{name:<28}{_mib(t.model)}{_mib(t.kv)}{_mib(t.compute)}{_mib(t.output)}{_mib(t.total)}")
    lines += overhead_lines(plan.devices)
    lines.append(host_memory(plan).line())
    for d in plan.devices:
        if d.profile.projected and not plan.projected:  # --projection never: the CPU's rules stood in
            lines.append(f"note: {d.name}: no rules for its backend in fitter: every buffer guessed with the CPU's "
                         "(--projection never)")
        elif any(x in d.profile.validated for x in ("not yet", "not validated", "no rules", "typical")):
            lines.append(f"note: {d.name}: {d.profile.validated}")
    if per_tensor:
        lines += ["", f"{'tensor':<40}{'type':<8}{'role':<14}{'buffer':<24}{'MiB':>10}"]
        for p in plan.placements:
            lines.append(
                f"{p.tensor.name:<40}{p.tensor.type:<8}{p.tensor.role.value:<14}{p.buft:<24}{_mib(p.tensor.n_bytes)}"
            )
    lines.append(f"\nrules matched against llama.cpp {llama_cpp['commit']} ({llama_cpp['source']})")
    return "\n".join(lines)


def fit_json(
    result: FitResult, flags: list[str], command: str, emulated: bool, verify: dict[str, Any] | None
) -> dict[str, Any]:
    """CONTRACTS.md `fitter fit --json`, plus the command line, the budgets and an optional verification load."""
    totals = result.plan.totals()
    devices = {}
    for d in result.plan.devices:
        t = totals[d.name]
        free = d.free_bytes if d.free_bytes is not None else d.total_bytes or 0
        devices[d.name] = {
            "model": t.model, "kv": t.kv, "compute": t.compute, "output": t.output, "total": t.total,
            "free": free, "free_after": free - t.total, "budget": result.budgets[d.name],
            **_overhead_json(result.plan, d.name),
        }
    out: dict[str, Any] = {
        "fits": result.fits,
        "flags": flags,
        "command": command,
        "emulated": emulated,
        "devices": devices,
        "host": {"model": totals["CPU"].model, "kv": totals["CPU"].kv, "compute": totals["CPU"].compute,
                 "output": totals["CPU"].output, "total": totals["CPU"].total},
        "layers": {"expert_layers_on_device": result.expert_layers_on_device, "n_layer": result.plan.model.n_layer,
                   "n_expert_layers": len(expert_layers(result.plan.model))},
        "shortfall": result.shortfall,
        "suggestions": list(result.suggestions),
        "warnings": list(result.plan.warnings),
    }
    if verify is not None:
        out["verify"] = verify
    return out


def fit_table(result: FitResult, command: str, emulated: bool, verify: dict[str, Any] | None) -> str:
    plan = result.plan
    lines = [f"model   {plan.model.path}  ({plan.model.arch}, {plan.model.n_layer} layers)"]
    if emulated and any(d.profile.kind == "vulkan" for d in plan.devices):
        lines.append("device  emulated Vulkan GPU (llama.cpp's Vulkan backend on Mesa's lavapipe, capped): real "
                     "placement and out-of-memory behaviour, CPU speed")
    elif emulated:
        shape = ", CUDA-shaped" if any(d.profile.cuda_rules for d in plan.devices) else ""
        lines.append(f"device  emulated GPU (a capped llama.cpp RPC device on 127.0.0.1{shape}): real placement and "
                     "out-of-memory behaviour, CPU speed")
    lines += ["", f"{'device':<28}{'model':>10}{'kv':>10}{'compute':>10}{'total':>10}{'free':>10}{'after':>10}"]
    totals = plan.totals()
    for d in plan.devices:
        t = totals[d.name]
        free = d.free_bytes if d.free_bytes is not None else d.total_bytes or 0
        lines.append(f"{d.name:<28}{_mib(t.model)}{_mib(t.kv)}{_mib(t.compute)}{_mib(t.total)}{_mib(free)}"
                     f"{_mib(free - t.total)}")
    t = totals["CPU"]
    lines.append(f"{'host (RAM)':<28}{_mib(t.model)}{_mib(t.kv)}{_mib(t.compute)}{_mib(t.total)}")
    lines += overhead_lines(plan.devices)
    lines.append(host_memory(plan).line())
    lines.append("")
    if result.fits:
        lines.append(f"fits: experts of {result.expert_layers_on_device}/{len(expert_layers(plan.model))} expert "
                     f"layers on the GPU, context {plan.context.n_ctx}")
        lines.append(command)
    else:
        assert result.shortfall is not None
        ngl = result.config.n_gpu_layers
        ngl_text = "all" if ngl < 0 else str(ngl)
        lightest = "with nothing offloaded" if ngl == 0 else f"at -ngl {ngl_text} with every expert on the CPU"
        lines.append(f"does not fit: {result.shortfall / MIB:.0f} MiB over budget {lightest}")
        lines += [f"  try {s}" for s in result.suggestions]
    if verify is not None:
        state = "loaded" if verify["loaded"] else f"FAILED to load: {verify['error']}"
        lines.append(f"verify: {state}; device peak {verify['device_peak_bytes'] / MIB:.2f} MiB of "
                     f"{verify['device_cap_bytes'] / MIB:.0f} MiB")
    return "\n".join(lines)
