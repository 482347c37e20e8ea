"""The warm-up graph libmtmd's clip context reserves its compute buffers with (tools/mtmd/clip.cpp `warmup` →
`reserve_compute_meta`: one image of `warmup_image_size`² through the projector's graph), rebuilt from a
projector's shapes node for node, scheduled on [the projector's device, the CPU] (clip_ctx's scheduler: no
parallel copies, op offload on) and allocated as ggml-alloc does.

Graphs rebuilt: `gemma3` (models/siglip.cpp: build_inp's patch convolution, clip_graph::build_vit, the average
pool, RMS norm and input projection), `mlp` (models/llava.cpp: the encoder up to its second-to-last layer and the
two-layer MLP) and the Qwen2-VL and Qwen2.5-VL mergers (models/qwen2vl.cpp: two patch kernels, M-RoPE, 2.5's
window attention, the 2×2 merger MLP) here; Qwen3-VL, Pixtral, Llama 4 and GLM-4V in
fitter.memory.graph.clip_models. The blocks (build_inp, build_norm, build_attn with flash attention, K and V cast
to F16, or without, build_ffn, build_vit's layer) are fitter.memory.graph.clip_builder's.
"""

from __future__ import annotations

from collections.abc import Callable

from fitter.gguf.projector import ProjectorSpec
from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.clip_builder import ClipBuilder, cast
from fitter.memory.graph.clip_models import glm4v, llama4, pixtral, qwen3vl
from fitter.memory.graph.ggml_graph import Graph, Tensor

CLIP_ARCHS = ("gemma3", "mlp", "qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger", "pixtral", "llama4",
              "glm4v")


def _qwen2vl(c: ClipBuilder) -> Tensor:
    """models/qwen2vl.cpp for the Qwen2-VL and Qwen2.5-VL mergers: two patch kernels summed, the 2×2 patch blocks
    made adjacent, M-RoPE on Q and K (4 positions a patch), 2.5's window attention (patches reordered by window,
    a mask on all but every n_wa_pattern-th layer), then four patches' rows through the merger MLP."""
    p = c.p
    rms = p.projector_type == "qwen2.5vl_merger"
    raw = c.raw()
    k0, k1 = c.w("v.patch_embd.weight"), c.w("v.patch_embd.weight.1")
    assert k0 is not None and k1 is not None
    cur = g.dup_op("ADD", c.conv(k0, raw), c.conv(k1, raw))
    nx = c.n_patches_x
    cur = g.cont(g.permute(cur, 1, 2, 0, 3), p.n_embd * 2, nx // 2, nx, 1)
    cur = g.permute(g.reshape(cur, p.n_embd * 2, nx // 2, 2, nx // 2), 0, 2, 1, 3)
    cur = g.cont(cur, p.n_embd, c.n_patches, 1)
    n_pos = c.n_patches
    positions = g.input_tensor("I32", n_pos * 4, name="positions")
    if c.w("v.pre_ln.weight") is not None:
        cur = c.norm(cur, "v.pre_ln", rms)
    mask = None
    if p.n_wa_pattern > 0:
        inv_window_idx = g.input_tensor("I32", n_pos // 4, name="inv_window_idx")
        mask = g.input_tensor("F32", n_pos, n_pos, name="window_mask")
        if c.flash_attn:
            mask = cast(mask, "F16")
        cur = g.reshape(g.get_rows(g.reshape(cur, p.n_embd * 4, n_pos // 4), inv_window_idx), p.n_embd, n_pos, 1)
    for il in range(p.n_layer):
        pre = f"v.blk.{il}"
        full = p.n_wa_pattern <= 0 or (il + 1) % p.n_wa_pattern == 0
        inp_l = cur
        cur = c.norm(cur, f"{pre}.ln1", rms)
        q, k, v = (g.reshape(c.linear(cur, f"{pre}.{name}"), p.d_head, p.n_head, n_pos)
                   for name in ("attn_q", "attn_k", "attn_v"))
        q, k = g.dup_op("ROPE", q, positions), g.dup_op("ROPE", k, positions)  # ggml_rope_multi
        cur = g.dup_op("ADD", c.attn(q, k, v, il, None if full else mask), inp_l)
        inp_l = cur
        cur = g.dup_op("ADD", inp_l, c.ffn(c.norm(cur, f"{pre}.ln2", rms), pre))
    if c.w("v.post_ln.weight") is not None:
        cur = c.norm(cur, "v.post_ln", rms)
    cur = g.reshape(cur, p.n_embd * 4, n_pos // 4, 1)
    cur = c.linear(g.dup_op("UNARY", c.linear(cur, "mm.0")), "mm.2")
    if p.n_wa_pattern > 0:
        window_idx = g.input_tensor("I32", n_pos // 4, name="window_idx")
        width = cur.ne[0]
        cur = g.reshape(g.get_rows(g.reshape(cur, width, n_pos // 4), window_idx), width, n_pos // 4, 1)
    return cur


def _gemma3(c: ClipBuilder) -> Tensor:
    """models/siglip.cpp for PROJECTOR_TYPE_GEMMA3."""
    p = c.p
    cur = c.inp()
    pos = c.w("v.position_embd.weight")
    if pos is not None:
        cur = g.dup_op("ADD", cur, pos)
    cur = g.reshape(cur, p.n_embd, c.n_patches)
    if c.w("v.pre_ln.weight") is not None:
        cur = c.norm(cur, "v.pre_ln")
    for il in range(p.n_layer):
        cur = c.layer(cur, il, c.n_patches)
    if c.w("v.post_ln.weight") is not None:
        cur = c.norm(cur, "v.post_ln")
    cur = g.reshape(cur, p.n_embd, c.n_patches, 1)
    n = c.n_patches_x
    cur = g.cont(g.transpose(cur), n, n, p.n_embd, 1)
    pooled = n // p.n_merge
    cur = g.new("F32", pooled, pooled, p.n_embd, 1, op="POOL_2D", src=(cur,))
    cur = g.cont(g.transpose(g.reshape(cur, pooled * pooled, p.n_embd, 1)))
    cur = g.dup_op("MUL", g.dup_op("RMS_NORM", cur), c.w("mm.soft_emb_norm.weight"))
    proj = c.w("mm.input_projection.weight")
    assert proj is not None
    return g.mul_mat(g.cont(g.transpose(proj)), cur)


def _mlp(c: ClipBuilder) -> Tensor:
    """models/llava.cpp for PROJECTOR_TYPE_MLP: layers 0 … n_layer-2 (the default feature layer is the
    second-to-last), then mm.0, GELU, mm.2."""
    p = c.p
    cls = c.w("v.class_embd")
    n_pos = c.n_patches + (1 if cls is not None else 0)
    cur = c.inp()
    if cls is not None:
        cur = g.new(cur.type, cur.ne[0], cur.ne[1] + 1, cur.ne[2], 1, op="CONCAT", src=(cur, cls))
    positions = g.input_tensor("I32", n_pos, name="positions")
    pos = c.w("v.position_embd.weight")
    assert pos is not None
    cur = g.dup_op("ADD", cur, g.get_rows(pos, positions))
    if c.w("v.pre_ln.weight") is not None:
        cur = c.norm(cur, "v.pre_ln")
    for il in range(p.n_layer - 1):
        cur = c.layer(cur, il, n_pos)
    if c.w("v.post_ln.weight") is not None:
        cur = c.norm(cur, "v.post_ln")
    cur = g.reshape(cur, p.n_embd, n_pos)  # the llava projector's input: the patches' rows (no class token)
    cur = g.get_rows(cur, g.input_tensor("I32", c.n_patches, name="patches"))
    cur = g.dup_op("UNARY", c.linear(cur, "mm.0"))
    return c.linear(cur, "mm.2")


_BUILDERS: dict[str, Callable[[ClipBuilder], Tensor]] = {"gemma3": _gemma3, "mlp": _mlp, "qwen2vl_merger": _qwen2vl,
                                                   "qwen2.5vl_merger": _qwen2vl, "qwen3vl_merger": qwen3vl,
                                                   "pixtral": pixtral, "llama4": llama4, "glm4v": glm4v}


def clip_graph(p: ProjectorSpec, flash_attn: bool, weight_backend: int = 0) -> Graph:
    """The warm-up graph of projector `p`, its weights on backend `weight_backend` (0: the projector's device, or
    the CPU when it is the scheduler's only backend)."""
    c = ClipBuilder(p, flash_attn, weight_backend)
    c.gf.expand(_BUILDERS[p.projector_type](c))
    return c.gf
