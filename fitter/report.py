"""Rendering a memory plan: the JSON shape of CONTRACTS.md and a human table. Pure functions."""

from __future__ import annotations

from typing import Any

from fitter.estimator import MemoryPlan

MIB = 1024 * 1024


def plan_json(plan: MemoryPlan, llama_cpp: dict[str, str]) -> dict[str, Any]:
    spec = plan.model
    return {
        "model": {
            "path": spec.path,
            "arch": spec.arch,
            "shards": spec.n_shards,
            "n_params": spec.n_params,
            "tensor_bytes": spec.tensor_bytes,
            "identity": spec.identity,
        },
        "context": {
            "n_ctx": plan.context.n_ctx,
            "n_ctx_seq": plan.context.n_ctx_seq,
            "n_seq_max": plan.context.n_seq_max,
            "kv_unified": plan.context.n_stream == 1,
            "n_batch": plan.context.n_batch,
            "n_ubatch": plan.context.n_ubatch,
            "flash_attn": plan.context.flash_attn,
            "swa_full": plan.context.swa_full,
        },
        "devices": {
            name: {"model": t.model, "kv": t.kv, "compute": t.compute, "output": t.output, "total": t.total}
            for name, t in plan.totals().items()
        },
        "device_profiles": {d.name: {"kind": d.profile.kind, "validated": d.profile.validated}
                            for d in plan.devices},
        "buffers": [{"buft": b.buft, "kind": b.kind, "bytes": b.bytes} for b in plan.buffers],
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
    }


def _mib(n: int) -> str:
    return f"{n / MIB:10.2f}"


def plan_table(plan: MemoryPlan, llama_cpp: dict[str, str], per_tensor: bool = False) -> str:
    spec, ctx = plan.model, plan.context
    lines = [
        f"model   {spec.path}  ({spec.arch}, {spec.n_layer} layers, {spec.n_params / 1e9:.2f} B params, "
        f"{spec.tensor_bytes / MIB:.2f} MiB in {spec.n_shards} file{'s' if spec.n_shards > 1 else ''})",
        f"context n_ctx {ctx.n_ctx} ({ctx.n_seq_max} slot{'s' if ctx.n_seq_max > 1 else ''}, "
        f"{'unified' if ctx.n_stream == 1 else 'per-slot'} KV of {ctx.n_ctx_seq} cells), -b {ctx.n_batch}, "
        f"-ub {ctx.n_ubatch}, flash attention {'on' if ctx.flash_attn else 'off'}",
        f"flags   {' '.join(plan.config.flags) or '(llama-server defaults)'}",
        "",
        f"{'buffer':<28}{'kind':<9}{'MiB':>10}",
    ]
    for b in plan.buffers:
        lines.append(f"{b.buft:<28}{b.kind:<9}{_mib(b.bytes)}")
    lines += ["", f"{'device':<28}{'model':>10}{'kv':>10}{'compute':>10}{'output':>10}{'total':>10}"]
    for name, t in plan.totals().items():
        lines.append(f"{name:<28}{_mib(t.model)}{_mib(t.kv)}{_mib(t.compute)}{_mib(t.output)}{_mib(t.total)}")
    for d in plan.devices:
        if "not yet validated" in d.profile.validated:
            lines.append(f"note: {d.name}: {d.profile.validated}")
    if per_tensor:
        lines += ["", f"{'tensor':<40}{'type':<8}{'role':<14}{'buffer':<24}{'MiB':>10}"]
        for p in plan.placements:
            lines.append(
                f"{p.tensor.name:<40}{p.tensor.type:<8}{p.tensor.role.value:<14}{p.buft:<24}{_mib(p.tensor.n_bytes)}"
            )
    lines.append(f"\nrules matched against llama.cpp {llama_cpp['commit']} ({llama_cpp['source']})")
    return "\n".join(lines)
