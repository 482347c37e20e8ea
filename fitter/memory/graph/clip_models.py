"""More projector types' warm-up graphs (tools/mtmd/models/*.cpp), built from fitter.memory.graph.clip_builder's
blocks node for node: the Qwen3-VL merger (models/qwen3vl.cpp), Pixtral and Mistral Small 3.x's patch merger
(models/pixtral.cpp), Llama 4's
(models/llama4.cpp) and GLM-4.5V / 4.6V's (models/glm4v.cpp).
"""

from __future__ import annotations

from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.clip_builder import ClipBuilder
from fitter.memory.graph.ggml_graph import Tensor


def _merge_rows(t: Tensor, n_embd: int, nx: int) -> Tensor:
    """The Qwen-VL mergers' 2×2 patch blocks made adjacent (qwen3vl.cpp "spatial merge"): [n_embd, nx*nx] rows
    reordered so each block's four patches follow one another."""
    t = g.cont(t, n_embd * 2, nx // 2, nx, 1)
    t = g.permute(g.reshape(t, n_embd * 2, nx // 2, 2, nx // 2), 0, 2, 1, 3)
    return g.cont(t, n_embd, nx * nx, 1)


def _conv_patches(kernel: Tensor, x: Tensor) -> Tensor:
    """ggml_conv_2d with the kernel's size as its stride and no padding (ggml.c: an IM2COL to F16, F32 for a BF16
    kernel, a matmul, a permute made contiguous): [OW, OH, OC, N]."""
    ow, oh, n = x.ne[0] // kernel.ne[0], x.ne[1] // kernel.ne[1], x.ne[3]
    k = kernel.ne[0] * kernel.ne[1] * kernel.ne[2]
    col = g.new("F32" if kernel.type == "BF16" else "F16", k, ow, oh, n, op="IM2COL", src=(kernel, x))
    mm = g.mul_mat(g.reshape(col, k, n * oh * ow), g.reshape(kernel, k, kernel.ne[3]))
    return g.cont(g.permute(g.reshape(mm, ow, oh, n, kernel.ne[3]), 0, 1, 3, 2))


def resized_positions(c: ClipBuilder) -> Tensor:
    """clip_graph::resize_position_embeddings (clip.cpp): the learned table as is when the image's patch grid is
    its own, otherwise interpolated to the grid (an UPSCALE) and made contiguous rows."""
    pos = c.w("v.position_embd.weight")
    assert pos is not None
    n = c.n_patches_x
    side = int(pos.ne[1] ** 0.5)
    if side == n:
        return pos
    e = c.p.n_embd
    cur = g.permute(g.reshape(pos, e, side, side), 2, 0, 1, 3)
    cur = g.new(cur.type, n, n, e, 1, op="UPSCALE", src=(cur,))  # ggml_interpolate
    return g.cont(g.permute(cur, 1, 2, 0, 3), e, n * n)


def qwen3vl(c: ClipBuilder) -> Tensor:
    """models/qwen3vl.cpp: two patch kernels summed, the 2×2 blocks made adjacent, the patch bias, the learned
    position table (interpolated to the grid) reordered the same way, layers with a fused QKV (views into one
    matmul) and M-RoPE, the deepstack layers' merged features (norm, fc1, GELU, fc2) concatenated after the merger
    MLP's output."""
    p = c.p
    raw = c.raw()
    k0, k1 = c.w("v.patch_embd.weight"), c.w("v.patch_embd.weight.1")
    assert k0 is not None and k1 is not None
    nx = c.n_patches_x
    cur = g.dup_op("ADD", c.conv(k0, raw), c.conv(k1, raw))
    cur = _merge_rows(g.permute(cur, 1, 2, 0, 3), p.n_embd, nx)
    cur = g.dup_op("ADD", cur, c.w("v.patch_embd.bias"))
    cur = g.dup_op("ADD", cur, _merge_rows(resized_positions(c), p.n_embd, nx))
    n_pos = c.n_patches
    positions = g.input_tensor("I32", n_pos * 4, name="positions")
    if c.w("v.pre_ln.weight") is not None:
        cur = c.norm(cur, "v.pre_ln")
    deepstack: Tensor | None = None
    for il in range(p.n_layer):
        pre = f"v.blk.{il}"
        inp_l = cur
        q, k, v = c.qkv_views(c.linear(c.norm(cur, f"{pre}.ln1"), f"{pre}.attn_qkv"), n_pos, p.n_embd)
        q, k = g.dup_op("ROPE", q, positions), g.dup_op("ROPE", k, positions)  # ggml_rope_multi
        cur = g.dup_op("ADD", c.attn(q, k, v, il), inp_l)
        inp_l = cur
        cur = g.dup_op("ADD", inp_l, c.ffn(c.norm(cur, f"{pre}.ln2"), pre))
        ds = f"v.deepstack.{il}"
        if c.w(f"{ds}.fc1.weight") is not None:  # clip_layer::has_deepstack
            feat = c.norm(g.reshape(cur, p.n_embd * p.n_merge ** 2, n_pos // p.n_merge ** 2, 1), f"{ds}.norm")
            feat = c.linear(g.dup_op("UNARY", c.linear(feat, f"{ds}.fc1")), f"{ds}.fc2")
            deepstack = feat if deepstack is None else g.concat(deepstack, feat)
    if c.w("v.post_ln.weight") is not None:
        cur = c.norm(cur, "v.post_ln")
    cur = g.reshape(cur, p.n_embd * 4, n_pos // 4, 1)
    cur = c.linear(g.dup_op("UNARY", c.linear(cur, "mm.0")), "mm.2")
    return cur if deepstack is None else g.concat(cur, deepstack)


def _concat1(a: Tensor, b: Tensor) -> Tensor:
    """ggml_concat along dim 1."""
    return g.new(a.type, a.ne[0], a.ne[1] + b.ne[1], a.ne[2], a.ne[3], op="CONCAT", src=(a, b))


def pixtral(c: ClipBuilder) -> Tensor:
    """models/pixtral.cpp: build_inp, build_vit with RMS norms and a 2D RoPE on Q and K (clip_graph::build_rope_2d:
    two ROPEs, by row then by column), Mistral Small 3.x's patch merger where the file has one (an RMS norm, the
    grid transposed, n_merge × n_merge blocks unfolded by an IM2COL whose kernel is a view, a matmul), the
    LLaVA MLP with GELU, and an [IMG_BREAK] row ending every image row but the last (a zeroed leaf plus the token,
    concatenated, viewed)."""
    p = c.p
    n, n_pos = c.n_patches_x, c.n_patches
    pos_h = g.input_tensor("I32", n_pos, name="pos_h")
    pos_w = g.input_tensor("I32", n_pos, name="pos_w")

    def rope_2d(t: Tensor) -> Tensor:
        return g.dup_op("ROPE", g.dup_op("ROPE", t, pos_h), pos_w)

    cur = g.reshape(c.inp(), p.n_embd, n_pos)  # build_vit: the batch flattened
    if c.w("v.pre_ln.weight") is not None:
        cur = c.norm(cur, "v.pre_ln", rms=True)
    for il in range(p.n_layer):
        cur = c.layer(cur, il, n_pos, rms=True, add_pos=rope_2d)
    if c.w("v.post_ln.weight") is not None:
        cur = c.norm(cur, "v.post_ln", rms=True)
    cur = g.reshape(cur, p.n_embd, n_pos, 1)
    m = p.n_merge
    if c.w("mm.patch_merger.weight") is not None:
        cur = g.dup_op("MUL", g.dup_op("RMS_NORM", cur), c.w("mm.input_norm.weight"))
        cur = g.cont(g.permute(g.reshape(cur, p.n_embd, n, n), 2, 0, 1, 3))
        kernel = g.view(cur, (m, m, cur.ne[2]), (0, 0))
        cur = g.new("F32", cur.ne[2] * m * m, n // m, n // m, 1, op="IM2COL", src=(kernel, cur))
        cur = c.linear(g.reshape(cur, cur.ne[0], cur.ne[1] * cur.ne[2]), "mm.patch_merger")
    cur = c.linear(g.dup_op("UNARY", c.linear(cur, "mm.1")), "mm.2")
    brk = c.w("v.token_embd.img_break")
    if brk is None:
        return cur
    side, width = n // m, cur.ne[0]
    tok = g.dup_op("SCALE", g.new(cur.type, width, 1, side))  # ggml_new_tensor_3d, cleared by a scale of 0
    tmp = _concat1(g.reshape(cur, width, side, side), g.dup_op("ADD", tok, brk))
    return g.view(tmp, (width, side * side + side - 1), (tmp.nb[1],))


def llama4(c: ClipBuilder) -> Tensor:
    """models/llama4.cpp: the patches unfolded by an IM2COL (the patch matrix reshaped as its kernel) and one
    matmul, the [CLS] row concatenated, build_vit with the learned positions added and a 2D RoPE (by column, then
    by row), the [CLS] row viewed away, the pixel shuffle (n_merge² patches a row: a permute made contiguous twice),
    the adapter MLP (two matmuls, each followed by GELU) and the projection."""
    p = c.p
    n, n_patches = c.n_patches_x, c.n_patches
    n_pos = n_patches + 1
    pos_h = g.input_tensor("I32", n_pos, name="pos_h")
    pos_w = g.input_tensor("I32", n_pos, name="pos_w")

    def rope_2d(t: Tensor) -> Tensor:
        return g.dup_op("ROPE", g.dup_op("ROPE", t, pos_w), pos_h)

    raw = c.raw()
    patch, cls, pos = c.w("v.patch_embd.weight"), c.w("v.class_embd"), c.w("v.position_embd.weight")
    assert patch is not None and cls is not None and pos is not None
    kernel = g.reshape(patch, p.patch_size, p.patch_size, 3, p.n_embd)
    cur = g.new("F32", 3 * p.patch_size ** 2, n, n, 1, op="IM2COL", src=(kernel, raw))
    cur = g.reshape(g.mul_mat(patch, cur), p.n_embd, n_patches)
    cur = _concat1(cur, cls)
    cur = g.reshape(g.dup_op("ADD", cur, pos), p.n_embd, n_pos)  # build_vit: learned positions, batch flattened
    if c.w("v.pre_ln.weight") is not None:
        cur = c.norm(cur, "v.pre_ln")
    for il in range(p.n_layer):
        cur = c.layer(cur, il, n_pos, add_pos=rope_2d)
    if c.w("v.post_ln.weight") is not None:
        cur = c.norm(cur, "v.post_ln")
    cur = g.reshape(cur, p.n_embd, n_pos, 1)
    cur = g.view(cur, (p.n_embd, n_patches), (cur.nb[1],))
    m = p.n_merge
    cur = g.permute(g.reshape(cur, p.n_embd * m, n // m, n, 1), 0, 2, 1, 3)
    cur = g.cont(g.cont(cur, p.n_embd * m * m, n // m, n // m, 1), p.n_embd * m * m, n_patches // (m * m))
    for name in ("mm.model.mlp.1.weight", "mm.model.mlp.2.weight"):
        cur = g.dup_op("UNARY", g.mul_mat(c.weights[name], cur))
    return g.mul_mat(c.weights["mm.model.fc.weight"], cur)


def glm4v(c: ClipBuilder) -> Tensor:
    """models/glm4v.cpp: two patch kernels summed and their 2×2 blocks made adjacent, the patch bias, the post-conv
    RMS norm where the file has one, the learned position table (interpolated to the grid) reordered the same way,
    build_vit with RMS norms and M-RoPE on Q and K, the patch merger (each n_merge × n_merge block through a
    convolution of its own size, plus its bias), the FC projector (a matmul, a LayerNorm, GELU) and the gated FFN
    projector."""
    p = c.p
    raw = c.raw()
    k0, k1 = c.w("v.patch_embd.weight"), c.w("v.patch_embd.weight.1")
    assert k0 is not None and k1 is not None
    nx, n_pos = c.n_patches_x, c.n_patches
    positions = g.input_tensor("I32", n_pos * 4, name="positions")
    cur = g.dup_op("ADD", c.conv(k0, raw), c.conv(k1, raw))
    cur = _merge_rows(g.permute(cur, 1, 2, 0, 3), p.n_embd, nx)
    cur = g.dup_op("ADD", cur, c.w("v.patch_embd.bias"))
    if c.w("v.norm_embd.weight") is not None:
        cur = c.norm(cur, "v.norm_embd", rms=True)
    if c.w("v.position_embd.weight") is not None:  # build_vit adds it
        cur = g.dup_op("ADD", cur, _merge_rows(resized_positions(c), p.n_embd, nx))
    cur = g.reshape(cur, p.n_embd, n_pos)

    def rope(t: Tensor) -> Tensor:
        return g.dup_op("ROPE", t, positions)  # ggml_rope_multi

    if c.w("v.pre_ln.weight") is not None:
        cur = c.norm(cur, "v.pre_ln", rms=True)
    for il in range(p.n_layer):
        cur = c.layer(cur, il, n_pos, rms=True, add_pos=rope)
    if c.w("v.post_ln.weight") is not None:
        cur = c.norm(cur, "v.post_ln", rms=True)
    m = p.n_merge
    n_out = n_pos // (m * m)
    cur = g.cont(g.permute(g.reshape(g.reshape(cur, p.n_embd, n_pos, 1), p.n_embd, m, m, n_out), 2, 0, 1, 3))
    merger = c.w("mm.patch_merger.weight")
    assert merger is not None
    cur = _conv_patches(merger, cur)
    cur = g.dup_op("ADD", g.reshape(cur, cur.ne[2], n_out), c.w("mm.patch_merger.bias"))
    cur = g.dup_op("UNARY", c.norm(c.linear(cur, "mm.model.fc"), "mm.post_norm"))  # ggml_gelu_erf
    return c.ffn(cur, "mm", up="up", down="down", gate="gate")
