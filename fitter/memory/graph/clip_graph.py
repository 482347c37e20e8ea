"""The warm-up graph libmtmd's clip context reserves its compute buffers with (tools/mtmd/clip.cpp `warmup` →
`reserve_compute_meta`: one image of `warmup_image_size`² through the projector's graph), rebuilt from a
projector's shapes node for node, scheduled on [the projector's device, the CPU] (clip_ctx's scheduler: no
parallel copies, op offload on) and allocated as ggml-alloc does.

Graphs rebuilt: `gemma3` (models/siglip.cpp: build_inp's patch convolution, clip_graph::build_vit, the average
pool, RMS norm and input projection) and `mlp` (models/llava.cpp: the encoder up to its second-to-last layer and the
two-layer MLP). Attention is clip_graph::build_attn's, with flash attention (K and V cast to F16) or without.
"""

from __future__ import annotations

from collections.abc import Callable

from fitter.gguf.projector import ProjectorSpec
from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.ggml_graph import Graph, Tensor

CLIP_ARCHS = ("gemma3", "mlp")


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

    def inp(self) -> Tensor:
        """clip_graph::build_inp: the image through ggml_conv_2d (ggml.c: im2col to F16, a matmul, a permute made
        contiguous), transposed to [n_embd, n_patches], plus the patch bias."""
        p, side = self.p, self.p.warmup_image_size
        raw = g.input_tensor("F32", side, side, 3, 1, name="inp_raw")
        kernel = self.w("v.patch_embd.weight")
        assert kernel is not None
        n = self.n_patches_x
        col_type = "F32" if kernel.type == "BF16" else "F16"
        im2col = g.new(col_type, kernel.ne[0] * kernel.ne[1] * kernel.ne[2], n, n, 1, op="IM2COL",
                       src=(kernel, raw))
        mm = g.mul_mat(g.reshape(im2col, im2col.ne[0], n * n), g.reshape(kernel, im2col.ne[0], kernel.ne[3]))
        conv = g.cont(g.permute(g.reshape(mm, n, n, 1, kernel.ne[3]), 0, 1, 3, 2))
        cur = g.cont(g.transpose(g.reshape(conv, self.n_patches, p.n_embd, 1)))
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

    def attn(self, q_cur: Tensor, k_cur: Tensor, v_cur: Tensor, il: int) -> Tensor:
        """clip_graph::build_attn: Q, K and V added to the graph in that order first (ggml_build_forward_order)."""
        for t in (q_cur, k_cur, v_cur):
            self.gf.expand(t)
        q, k = g.permute(q_cur, 0, 2, 1, 3), g.permute(k_cur, 0, 2, 1, 3)
        if self.flash_attn:
            v = g.permute(v_cur, 0, 2, 1, 3)
            k = g.new("F16", *k.ne, op="CPY", src=(k,))  # ggml_cast
            v = g.new("F16", *v.ne, op="CPY", src=(v,))
            cur = g.flash_attn_ext(q, k, v, None, None)
            cur = g.reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        else:
            v = g.cont(g.permute(v_cur, 1, 2, 0, 3))
            kq = g.dup_op("SOFT_MAX", g.mul_mat(k, q), None)
            cur = g.permute(g.mul_mat(v, kq), 0, 2, 1, 3)
            cur = g.cont(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        return self.linear(cur, f"v.blk.{il}.attn_out")

    def ffn(self, x: Tensor, prefix: str, up: str = "ffn_up", down: str = "ffn_down") -> Tensor:
        """clip_graph::build_ffn without a gate: up (+ bias), the activation, down (+ bias)."""
        cur = g.dup_op("UNARY", self.linear(x, f"{prefix}.{up}"))
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


_BUILDERS: dict[str, Callable[[_Clip], Tensor]] = {"gemma3": _gemma3, "mlp": _mlp}


def clip_graph(p: ProjectorSpec, flash_attn: bool, weight_backend: int = 0) -> Graph:
    """The warm-up graph of projector `p`, its weights on backend `weight_backend` (0: the projector's device, or
    the CPU when it is the scheduler's only backend)."""
    c = _Clip(p, flash_attn, weight_backend)
    c.gf.expand(_BUILDERS[p.projector_type](c))
    return c.gf
