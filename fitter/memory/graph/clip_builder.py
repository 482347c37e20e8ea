"""clip_graph's building blocks (tools/mtmd/clip.cpp `clip_graph`): the projector's weights as graph tensors, the
raw image, the patch convolution, build_inp, build_norm, build_mm with its bias, build_attn (flash attention with K
and V cast to F16, or soft-max attention), build_ffn and build_vit's encoder layer; the projector types' graphs
(fitter.memory.graph.clip_graph, clip_models) are made of them.
"""

from __future__ import annotations

from collections.abc import Callable

from fitter.gguf.projector import ProjectorSpec
from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.ggml_graph import Graph, Tensor


class ClipBuilder:
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
            k = cast(k, "F16")
            v = cast(v, "F16")
            if mask is not None:
                mask = cast(mask, "F16")
            cur = g.flash_attn_ext(q, k, v, mask, None)
            cur = g.reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        else:
            v = g.cont(g.permute(v_cur, 1, 2, 0, 3))
            kq = g.dup_op("SOFT_MAX", g.mul_mat(k, q), mask)
            cur = g.permute(g.mul_mat(v, kq), 0, 2, 1, 3)
            cur = g.cont(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        return self.linear(cur, f"v.blk.{il}.attn_out")

    def ffn(self, x: Tensor, prefix: str, up: str = "ffn_up", down: str = "ffn_down", gate: str = "ffn_gate") -> Tensor:
        """clip_graph::build_ffn: up (+ bias), the gate (+ bias) where there is one, the activation (a GLU of the
        two), down (+ bias)."""
        tmp = self.linear(x, f"{prefix}.{up}")
        if self.w(f"{prefix}.{gate}.weight") is not None:
            cur = g.glu("GLU", self.linear(x, f"{prefix}.{gate}"), tmp)
        else:
            cur = g.dup_op("UNARY", tmp)
        return self.linear(cur, f"{prefix}.{down}")

    def qkv_views(self, qkv: Tensor, n_pos: int, width: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K and V as views into a fused QKV's F32 rows, [d_head, n_head, n_pos] at offsets 0, `width` and twice
        that (build_vit: n_head·d_head; qwen3vl.cpp: n_embd)."""
        p, row = self.p, 4
        width = width or p.n_head * p.d_head
        q, k, v = (g.view(qkv, (p.d_head, p.n_head, n_pos), (row * p.d_head, qkv.nb[1]), row * width * i)
                   for i in range(3))
        return q, k, v

    def layer(self, inp_l: Tensor, il: int, n_pos: int, rms: bool = False,
              add_pos: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """One encoder layer of clip_graph::build_vit (llava.cpp's is the same for these tensors): a fused QKV
        (three views into one matmul) or separate Q, K and V, build_vit's add_pos (a RoPE) on Q and K where the
        model has one."""
        p, pre = self.p, f"v.blk.{il}"
        cur = self.norm(inp_l, f"{pre}.ln1", rms)
        if self.w(f"{pre}.attn_qkv.weight") is not None:
            q, k, v = self.qkv_views(self.linear(cur, f"{pre}.attn_qkv"), n_pos)
        else:
            q, k, v = (g.reshape(self.linear(cur, f"{pre}.{name}"), p.d_head, n_head, n_pos, 1)
                       for name, n_head in (("attn_q", p.n_head), ("attn_k", p.n_head_kv),
                                            ("attn_v", p.n_head_kv)))
        if add_pos is not None:
            q, k = add_pos(q), add_pos(k)
        cur = g.dup_op("ADD", self.attn(q, k, v, il), inp_l)
        inp_l = cur
        cur = self.ffn(self.norm(cur, f"{pre}.ln2", rms), pre)
        return g.dup_op("ADD", inp_l, cur)


def cast(t: Tensor, type_name: str) -> Tensor:
    """ggml_cast: a CPY into a new tensor of that type (its second source is itself, which changes no count)."""
    return g.new(type_name, *t.ne, op="CPY", src=(t,))
