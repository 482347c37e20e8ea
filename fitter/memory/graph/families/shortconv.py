"""LFM2's short-convolution hybrids: src/models/lfm2.cpp (lfm2, and lfm2moe: llama_model_lfm2moe::graph is
lfm2's) of llama.cpp 0c1e570, on the hybrid memory (`build_inp_mem_hybrid`, or its iSWA twin where the file sets a
sliding window: every attention layer then slides). A layer without KV heads is a gated short convolution over its
conv state (n_embd_r = n_embd × (shortconv.l_cache - 1), fitter.memory.graph.families.delta_net.StateInput); the
others are attention with Q/K norms. lfm2's layers are all dense (n_layer_dense_lead = n_layer); lfm2moe routes
experts from `leading_dense_block_count` on.
"""

from __future__ import annotations

from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.builder import Builder
from fitter.memory.graph.families.classic import build_norm, file_gating, head, last_rows, rope
from fitter.memory.graph.families.delta_net import StateInput
from fitter.memory.graph.families.llama_like import attn_out, qkv_proj
from fitter.memory.graph.ggml_graph import Tensor
from fitter.memory.graph.recurrent_ops import cpy, ssm_conv

ARCHS = ("lfm2", "lfm2moe")
F32 = 4


def shortconv(b: Builder, rs: StateInput, il: int, x: Tensor) -> Tensor:
    """build_shortconv_block (lfm2.cpp 157-230) for a causal model without rollback snapshots (cparams.n_rs_seq 0):
    in_proj's three chunks b, c, x; (b × x) transposed after the stored conv state; its last d_conv columns copied
    back; SSM_CONV with the kernel, × c, out_proj."""
    spec, pre = b.spec, f"blk.{il}."
    ns = rs.n_seqs
    nst = x.ne[1] // ns
    cur = g.reshape(x, x.ne[0], nst, ns)
    bcx = b.mm(pre + "shortconv.in_proj.weight", cur)
    chunk = bcx.ne[0] // 3
    strides = (bcx.nb[1], bcx.nb[2])
    bb, c, xx = (g.view(bcx, (chunk, bcx.ne[1], bcx.ne[2]), strides, i * chunk * F32) for i in range(3))
    bx = g.transpose(g.dup_op("MUL", bb, xx))
    conv_state = rs.cache(b, il, spec.n_embd_r)
    d_conv = spec.n_embd_r // spec.n_embd
    conv = g.reshape(rs.read(b, conv_state, spec.n_embd_r), d_conv, spec.n_embd, ns)
    bx = g.concat(conv, bx)
    snap = g.view(bx, (d_conv, bx.ne[1], bx.ne[2]), (bx.nb[1], bx.nb[2]), (bx.ne[0] - d_conv) * F32)
    b.gf.expand(cpy(snap, g.view(conv_state, (d_conv * spec.n_embd, ns), (conv_state.nb[1],))))
    y = g.dup_op("MUL", c, ssm_conv(bx, b.weight(pre + "shortconv.conv.weight")))
    y = b.mm(pre + "shortconv.out_proj.weight", y)
    return g.reshape(y, y.ne[0], nst * ns)


def build_lfm2(b: Builder) -> None:
    """llama_model_lfm2::graph (lfm2.cpp 82-290): the embeddings (expanded first), per layer the operator norm, a
    short convolution or attention (Q/K norms, RoPE, wo without its bias), the residual, the FFN norm and a dense
    SwiGLU FFN or softmax/sigmoid-routed experts with the selection bias; the output norm (`token_embd_norm`)."""
    spec = b.spec
    b.inputs()
    if any(spec.swa_layers):  # build_inp_mem_hybrid_iswa (src/llama-graph.cpp 3655-3683) builds no K/V rotation inputs
        b.k_rot.clear()
        b.v_rot.clear()
    rs = StateInput(b)
    cur = b.embd
    for il in range(spec.n_layer):
        pre = f"blk.{il}."
        prev = cur
        cur = build_norm(b, cur, pre + "attn_norm.weight", il)
        if spec.recurrent_layers[il]:
            cur = shortconv(b, rs, il, cur)
        else:
            q, k, v = qkv_proj(b, il, cur)
            q = rope(b, build_norm(b, q, pre + "attn_q_norm.weight", il))
            k = rope(b, build_norm(b, k, pre + "attn_k_norm.weight", il))
            cur = attn_out(b, il, q, k, v, wo_bias=False)
        cur, prev = last_rows(b, il, cur, prev)
        cur = g.dup_op("ADD", prev, cur)
        ffn_in = build_norm(b, cur, pre + "ffn_norm.weight", il)
        if spec.arch == "lfm2moe" and il >= spec.n_layer_dense_lead:
            out = b.moe(ffn_in, il, file_gating(b), True, spec.expert_weights_scale)
        else:
            out = b.ffn(ffn_in, pre)
        cur = g.dup_op("ADD", cur, out)
    head(b, cur, norm_name="token_embd_norm")  # LLM_TENSOR_OUTPUT_NORM_LFM2
