"""The warm-up graph libmtmd's clip context reserves its compute buffers with (tools/mtmd/clip.cpp `warmup` →
`reserve_compute_meta`: one image of `warmup_image_size`² through the projector's graph), rebuilt from a
projector's shapes node for node, scheduled on [the projector's device, the CPU] (clip_ctx's scheduler: no
parallel copies, op offload on) and allocated as ggml-alloc does.

Graphs rebuilt: `gemma3` (models/siglip.cpp: build_inp's patch convolution, clip_graph::build_vit, the average
pool, RMS norm and input projection), `mlp` (models/llava.cpp: the encoder up to its second-to-last layer and the
two-layer MLP) and the Qwen2-VL and Qwen2.5-VL mergers (models/qwen2vl.cpp: two patch kernels, M-RoPE, 2.5's
window attention, the 2×2 merger MLP). Attention is clip_graph::build_attn's, with flash attention (K and V cast
to F16) or without.
"""

from __future__ import annotations

from collections.abc import Callable

from fitter.gguf.projector import ProjectorSpec
from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.ggml_graph import Graph, Tensor

CLIP_ARCHS = ("gemma3", "mlp", "qwen2vl_merger", "qwen2.5vl_merger")


class _Clip:
    """clip_graph: the builder's shapes and the graph it adds nodes to (ctx0, gf)."""

    def __init__(self, p: ProjectorSpec, flash_attn: bool, weight_backend: int) -> None:
        self.p, self.flash_attn = p, flash_attn
        self.gf = Graph()
        self.weights = {t.name: g.data_tensor(t.type, *t.ne, name=t.name, backend=weight_backend)
                        for t in p.tensors}
        side = p.warmup_image_size
        self.n_patches_x = side // p.patch_size
        self.n_patches = self.n_patches_x * self.n_patches_x

    def w(self, name: str) -> Tensor | None:
        return self.weights.get(name)

    def raw(self) -> Tensor:
        side = self.p.warmup_image_size
        return g.input_tensor("F32", side, side, 3, 1, name="inp_raw")

    def conv(self, kernel: Tensor, raw: Tensor) -> Tensor:
        """ggml_conv_2d with the patch as stride (ggml.c: im2col to F16, a matmul, a permute made contiguous):
        [n_patches_x, n_patches_y, n_embd, 1]."""
        n = self.n_patches_x
        col_type = "F32" if kernel.type == "BF16" else "F16"
        im2col = g.new(col_type, kernel.ne[0] * kernel.ne[1] * kernel.ne[2], n, n, 1, op="IM2COL",
                       src=(kernel, raw))
        mm = g.mul_mat(g.reshape(im2col, im2col.ne[0], n * n), g.reshape(kernel, im2col.ne[0], kernel.ne[3]))
        return g.cont(g.permute(g.reshape(mm, n, n, 1, kernel.ne[3]), 0, 1, 3, 2))

    def inp(self) -> Tensor:
        """clip_graph::build_inp: the image through the patch convolution, transposed to [n_embd, n_patches], plus
        the patch bias."""
        kernel = self.w("v.patch_embd.weight")
        assert kernel is not None
        conv = self.conv(kernel, self.raw())
        cur = g.cont(g.transpose(g.reshape(conv, self.n_patches, self.p.n_embd, 1)))
        bias = self.w("v.patch_embd.bias")
        return g.dup_op("ADD", cur, bias) if bias is not None else cur

    def norm(self, x: Tensor, prefix: str, rms: bool = False) -> Tensor:
        """clip_graph::build_norm: NORM (or RMS_NORM), times the weight, plus the bias."""
        cur = g.dup_op("RMS_NORM" if rms else "NORM", x)
        for suffix, op in (("weight", "MUL"), ("bias", "ADD")):
            t = self.w(f"{prefix}.{suffix}")
            if t is not None:
                cur = g.dup_op(op, cur, t)
        return cur

    def linear(self, x: Tensor, prefix: str) -> Tensor:
        w = self.w(f"{prefix}.weight")
        assert w is not None, prefix
        cur = g.mul_mat(w, x)
        b = self.w(f"{prefix}.bias")
        return g.dup_op("ADD", cur, b) if b is not None else cur

    def attn(self, q_cur: Tensor, k_cur: Tensor, v_cur: Tensor, il: int, mask: Tensor | None = None) -> Tensor:
        """clip_graph::build_attn: Q, K and V added to the graph in that order first (ggml_build_forward_order)."""
        for t in (q_cur, k_cur, v_cur):
            self.gf.expand(t)
        q, k = g.permute(q_cur, 0, 2, 1, 3), g.permute(k_cur, 0, 2, 1, 3)
        if self.flash_attn:
            v = g.permute(v_cur, 0, 2, 1, 3)
            k = _cast(k, "F16")
            v = _cast(v, "F16")
            if mask is not None:
                mask = _cast(mask, "F16")
            cur = g.flash_attn_ext(q, k, v, mask, None)
            cur = g.reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        else:
            v = g.cont(g.permute(v_cur, 1, 2, 0, 3))
            kq = g.dup_op("SOFT_MAX", g.mul_mat(k, q), mask)
            cur = g.permute(g.mul_mat(v, kq), 0, 2, 1, 3)
            cur = g.cont(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        return self.linear(cur, f"v.blk.{il}.attn_out")

    def ffn(self, x: Tensor, prefix: str, up: str = "ffn_up", down: str = "ffn_down") -> Tensor:
        """clip_graph::build_ffn: up (+ bias), the gate (+ bias) where there is one, the activation (a GLU of the
        two), down (+ bias)."""
        tmp = self.linear(x, f"{prefix}.{up}")
        if self.w(f"{prefix}.ffn_gate.weight") is not None:
            cur = g.glu("GLU", self.linear(x, f"{prefix}.ffn_gate"), tmp)
        else:
            cur = g.dup_op("UNARY", tmp)
        return self.linear(cur, f"{prefix}.{down}")

    def layer(self, inp_l: Tensor, il: int, n_pos: int) -> Tensor:
        """One encoder layer of clip_graph::build_vit (llava.cpp's is the same for these tensors)."""
        p, pre = self.p, f"v.blk.{il}"
        cur = self.norm(inp_l, f"{pre}.ln1")
        q, k, v = (g.reshape(self.linear(cur, f"{pre}.{name}"), p.d_head, n_head, n_pos, 1)
                   for name, n_head in (("attn_q", p.n_head), ("attn_k", p.n_head_kv), ("attn_v", p.n_head_kv)))
        cur = g.dup_op("ADD", self.attn(q, k, v, il), inp_l)
        inp_l = cur
        cur = self.ffn(self.norm(cur, f"{pre}.ln2"), pre)
        return g.dup_op("ADD", inp_l, cur)


def _cast(t: Tensor, type_name: str) -> Tensor:
    """ggml_cast: a CPY into a new tensor of that type (its second source is itself, which changes no count)."""
    return g.new(type_name, *t.ne, op="CPY", src=(t,))


def _qwen2vl(c: _Clip) -> Tensor:
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
            mask = _cast(mask, "F16")
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


def _gemma3(c: _Clip) -> Tensor:
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


def _mlp(c: _Clip) -> Tensor:
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


_BUILDERS: dict[str, Callable[[_Clip], Tensor]] = {"gemma3": _gemma3, "mlp": _mlp, "qwen2vl_merger": _qwen2vl,
                                                   "qwen2.5vl_merger": _qwen2vl}


def clip_graph(p: ProjectorSpec, flash_attn: bool, weight_backend: int = 0) -> Graph:
    """The warm-up graph of projector `p`, its weights on backend `weight_backend` (0: the projector's device, or
    the CPU when it is the scheduler's only backend)."""
    c = _Clip(p, flash_attn, weight_backend)
    c.gf.expand(_BUILDERS[p.projector_type](c))
    return c.gf
