"""Dense and MoE transformers of llama.cpp 0c1e570 whose layers differ from llama's in their norms, residuals and
FFN: src/models/phi3.cpp, glm4.cpp, granite.cpp (granite and granitemoe: llama_model_granite_moe::graph is
granite's), olmo2.cpp, exaone4.cpp, cohere2.cpp, command-r.cpp, starcoder2.cpp, minimax-m2.cpp and
hunyuan-moe.cpp, one function per file, from the blocks of fitter.memory.graph.families.llama_like and
fitter.memory.graph.builder.
"""

from __future__ import annotations

from collections.abc import Callable

from fitter.errors import GGUFError
from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.builder import SOFTMAX, Builder
from fitter.memory.graph.families.llama_like import attn_out, ffn_scaled, lora_mm, moe_ffn, qkv_proj, rope_factors
from fitter.memory.graph.ggml_graph import Tensor


def build_norm(b: Builder, x: Tensor, weight: str | None, il: int, bias: str | None = None, rms: bool = True) -> Tensor:
    """build_norm (src/llama-graph.cpp 1598-1631): RMS_NORM or NORM (LLM_NORM), MUL by the weight, ADD the bias;
    graph_get_cb pins the result named "norm" to layer il's device (il >= 0, a weight or bias given)."""
    cur = g.dup_op("RMS_NORM" if rms else "NORM", x)
    w = b.w(weight) if weight else None
    bb = b.w(bias) if bias else None
    if (w is not None or bb is not None) and il >= 0:
        b.norm_pins.append((cur, il))
    if w is not None:
        cur = g.dup_op("MUL", cur, w)
    if bb is not None:
        cur = g.dup_op("ADD", cur, bb)
    return cur


def rope(b: Builder, x: Tensor, freqs: Tensor | None = None) -> Tensor:
    return g.dup_op("ROPE", x, b.pos, freqs)


def file_gating(b: Builder) -> int:
    """The file's `expert_gating_func` for a model that routes by it alone (minimax-m2, lfm2moe): 0 (NONE) is a
    GGML_ABORT in build_moe_ffn (src/llama-graph.cpp 2054-2073)."""
    spec = b.spec
    if spec.expert_gating == 0:
        raise GGUFError(f"{spec.path}: '{spec.arch}.expert_gating_func' is missing or 0, which llama.cpp's "
                        f"{spec.arch} graph aborts on (build_moe_ffn: no gating function)")
    return spec.expert_gating


def head(b: Builder, cur: Tensor, rms: bool = True, logit_scale: bool = False, norm_name: str = "output_norm") -> None:
    """The final norm (res->t_embd, with its bias where loaded), the lm_head with its scale and bias, and a logit
    SCALE (granite, cohere2, command-r) as res->t_logits."""
    cur = build_norm(b, cur, norm_name + ".weight", -1, norm_name + ".bias", rms)
    cur.is_output = True
    out_w = "output.weight" if "output.weight" in b.names else "token_embd.weight"
    logits = b.add_bias(lora_mm(b, out_w, cur, "output.scale"), "output.bias")
    if logit_scale:
        logits = g.dup_op("SCALE", logits)
    logits.is_output = True
    b.gf.expand(logits)


def last_rows(b: Builder, il: int, *ts: Tensor) -> tuple[Tensor, ...]:
    """The last layer keeps only the rows that are output (build_inp_out_ids), gathered in the order given."""
    if il != b.spec.n_layer - 1:
        return ts
    return tuple(g.get_rows(t, b.out_ids) for t in ts)


def swiglu_seq(b: Builder, x: Tensor, pre: str) -> Tensor:
    """build_ffn(up, down, LLM_FFN_SWIGLU, LLM_FFN_SEQ): the fused up product [2 n_ff], ggml_swiglu of its two
    halves (a GLU with one source, half as wide: ggml.c ggml_glu_impl), down."""
    up = b.mm(pre + "ffn_up.weight", x)
    act = g.new(up.type, up.ne[0] // 2, *up.ne[1:], op="GLU", src=(up, None))
    return b.mm(pre + "ffn_down.weight", act)


def phi3(b: Builder) -> None:
    """phi3.cpp 70-191 (phi3 disables SWA, so never the iswa graph): RMS norms, RoPE with the long/short factors,
    Q scaled after RoPE, a fused-up SwiGLU FFN, the head's optional bias."""
    b.inputs()
    inp = b.embd
    for il in range(b.spec.n_layer):
        pre = f"blk.{il}."
        residual = inp
        freqs = rope_factors(b, il)
        cur = build_norm(b, inp, pre + "attn_norm.weight", il)
        q, k, v = qkv_proj(b, il, cur)
        q = g.dup_op("SCALE", rope(b, q, freqs))
        k = rope(b, k, freqs)
        cur = attn_out(b, il, q, k, v)
        cur, residual = last_rows(b, il, cur, residual)
        residual = g.dup_op("ADD", cur, residual)
        cur = build_norm(b, residual, pre + "ffn_norm.weight", il)
        inp = g.dup_op("ADD", residual, swiglu_seq(b, cur, pre))
    head(b, inp)


def glm4(b: Builder) -> None:
    """glm4.cpp 60-168: RMS norms before and after attention and the FFN, M-RoPE (4 positions per token) where the
    file sets rope sections, wo without its bias, a fused-up SwiGLU FFN."""
    spec = b.spec
    b.inputs(n_pos=4 if spec.use_mrope else 1)
    inp = b.embd
    for il in range(spec.n_layer):
        pre = f"blk.{il}."
        inp_sa = inp
        cur = build_norm(b, inp, pre + "attn_norm.weight", il)
        q, k, v = qkv_proj(b, il, cur)
        cur = attn_out(b, il, rope(b, q), rope(b, k), v, wo_bias=False)
        cur, inp_sa = last_rows(b, il, cur, inp_sa)
        cur = build_norm(b, cur, pre + "post_attention_norm.weight", il)
        ffn_inp = g.dup_op("ADD", cur, inp_sa)
        cur = build_norm(b, ffn_inp, pre + "ffn_norm.weight", il)
        cur = build_norm(b, swiglu_seq(b, cur, pre), pre + "post_ffw_norm.weight", il)
        inp = g.dup_op("ADD", cur, ffn_inp)
    head(b, inp)


def granite(b: Builder) -> None:
    """granite.cpp 100-280 (granite, granitemoe): the embeddings and the residual branches SCALEd where the file
    sets embedding_scale / residual_scale, RoPE only where `rope.scaling.finetuned` (granitemoe always), an FFN with
    biases or softmax-routed experts with an ungated shared expert, the logits SCALEd by 1/logit_scale (always)."""
    spec = b.spec
    has_rope = spec.arch != "granite" or spec.rope_finetuned
    b.inputs()
    inp = b.embd
    if spec.embedding_scale:  # build_inp_embd (src/llama-graph.cpp 2444-2452)
        inp = g.dup_op("SCALE", inp)
    for il in range(spec.n_layer):
        pre = f"blk.{il}."
        inp_sa = inp
        cur = build_norm(b, inp, pre + "attn_norm.weight", il)
        q, k, v = qkv_proj(b, il, cur)
        if has_rope:
            freqs = rope_factors(b, il)
            q, k = rope(b, q, freqs), rope(b, k, freqs)
        cur = attn_out(b, il, q, k, v)
        cur, inp_sa = last_rows(b, il, cur, inp_sa)
        if spec.residual_scale:
            cur = g.dup_op("SCALE", cur)
        ffn_inp = g.dup_op("ADD", cur, inp_sa)
        cur = build_norm(b, ffn_inp, pre + "ffn_norm.weight", il)
        if pre + "ffn_gate_inp.weight" not in b.names:
            cur = ffn_scaled(b, cur, pre, biases=True)
        else:
            normed = cur
            cur = moe_ffn(b, cur, il, SOFTMAX, True, spec.expert_weights_scale)
            if spec.n_ff_shexp > 0:
                cur = g.dup_op("ADD", cur, b.ffn(normed, pre, "_shexp"))
        if spec.residual_scale:
            cur = g.dup_op("SCALE", cur)
        inp = g.dup_op("ADD", cur, ffn_inp)
    head(b, inp, logit_scale=True)


def _post_norm_layer(b: Builder, il: int, inp: Tensor, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """olmo2's and exaone4's layer after Q/K/V: attention, wo without its bias, the post-attention norm, the
    residual, the SwiGLU FFN on the sum itself, the post-FFN norm (build_norm with il = -1: never pinned)."""
    pre = f"blk.{il}."
    cur = attn_out(b, il, q, k, v, wo_bias=False)
    cur, inp_sa = last_rows(b, il, cur, inp)
    cur = build_norm(b, cur, pre + "post_attention_norm.weight", il)
    ffn_inp = g.dup_op("ADD", cur, inp_sa)
    cur = build_norm(b, b.ffn(ffn_inp, pre), pre + "post_ffw_norm.weight", -1)
    return g.dup_op("ADD", cur, ffn_inp)


def olmo2(b: Builder) -> None:
    """olmo2.cpp 60-167: no pre-norm; Q/K/V unreshaped (build_qkv reshape=false), RMS norms over the whole Q and K
    rows, then reshaped to heads and roped."""
    spec = b.spec
    b.inputs()
    inp = b.embd
    for il in range(spec.n_layer):
        pre, T = f"blk.{il}.", b.T
        q, k, v = qkv_flat(b, il, inp)
        q = build_norm(b, q, pre + "attn_q_norm.weight", il)
        k = build_norm(b, k, pre + "attn_k_norm.weight", il)
        dk, dv = spec.head_dim_k, spec.head_dim_v
        q = rope(b, g.reshape(q, dk, spec.n_head[il], T))
        k = rope(b, g.reshape(k, dk, spec.n_head_kv[il], T))
        v = g.reshape(v, dv, spec.n_head_kv[il], T)
        inp = _post_norm_layer(b, il, inp, q, k, v)
    head(b, inp)


def qkv_flat(b: Builder, il: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """build_qkv with reshape=false (src/llama-graph.cpp 1651-1700): a fused attn_qkv's rows as CONTs of its views,
    else three products with their scales and biases, left 2-D."""
    spec, pre, T = b.spec, f"blk.{il}.", x.ne[1]
    nq, nk = spec.head_dim_k * spec.n_head[il], spec.n_embd_k_gqa(il)
    if pre + "attn_qkv.weight" in b.names:
        cur = b.add_bias(lora_mm(b, pre + "attn_qkv.weight", x, pre + "attn_qkv.scale"), pre + "attn_qkv.bias")
        q = g.view(cur, (nq, T), (cur.nb[1],))
        k = g.view(cur, (nk, T), (cur.nb[1],), nq * 4)
        v = g.view(cur, (spec.n_embd_v_gqa(il), T), (cur.nb[1],), (nq + nk) * 4)
        return g.cont(q), g.cont(k), g.cont(v)
    q, k, v = (b.add_bias(lora_mm(b, pre + f"attn_{n}.weight", x, pre + f"attn_{n}.scale"), pre + f"attn_{n}.bias")
               for n in "qkv")
    return q, k, v


def exaone4(b: Builder) -> None:
    """exaone4.cpp 60-150: no pre-norm; RMS norms over Q and K heads, RoPE (with the rope factors) on sliding-window
    layers, or on every layer of a model without them."""
    spec = b.spec
    b.inputs()
    inp = b.embd
    any_swa = any(spec.swa_layers)
    for il in range(spec.n_layer):
        pre = f"blk.{il}."
        freqs = rope_factors(b, il)
        q, k, v = qkv_proj(b, il, inp)
        q = build_norm(b, q, pre + "attn_q_norm.weight", il)
        k = build_norm(b, k, pre + "attn_k_norm.weight", il)
        if spec.swa_layers[il] or not any_swa:
            q, k = rope(b, q, freqs), rope(b, k, freqs)
        inp = _post_norm_layer(b, il, inp, q, k, v)
    head(b, inp)


def cohere(b: Builder) -> None:
    """cohere2.cpp 40-145 and command-r.cpp 20-120: LayerNorms without bias, attention and the FFN in parallel on
    the same normed input, both added to the residual; cohere2 over its iSWA cache with RoPE (and rope factors) only
    on sliding-window layers and an FFN with scales; command-r with optional LayerNorm'd Q/K."""
    spec = b.spec
    cohere2 = spec.arch == "cohere2"
    b.inputs()
    inp = b.embd
    for il in range(spec.n_layer):
        pre = f"blk.{il}."
        cur = build_norm(b, inp, pre + "attn_norm.weight", il, rms=False)
        ffn_inp = cur
        freqs = rope_factors(b, il) if cohere2 else None
        q, k, v = qkv_proj(b, il, cur)
        if cohere2:
            if spec.swa_layers[il]:
                q, k = rope(b, q, freqs), rope(b, k, freqs)
        else:
            if pre + "attn_q_norm.weight" in b.names:
                q = build_norm(b, q, pre + "attn_q_norm.weight", il, rms=False)
            q = rope(b, q)
            if pre + "attn_k_norm.weight" in b.names:
                k = build_norm(b, k, pre + "attn_k_norm.weight", il, rms=False)
            k = rope(b, k)
        cur = lora_mm(b, pre + "attn_output.weight", b.attention(il, q, k, v, None, iswa=cohere2),
                      pre + "attn_output.scale")
        attn = b.add_bias(cur, pre + "attn_output.bias")
        attn, inp, ffn_inp = last_rows(b, il, attn, inp, ffn_inp)
        cur = ffn_scaled(b, ffn_inp, pre, scales=cohere2)
        cur = g.dup_op("ADD", cur, inp)
        inp = g.dup_op("ADD", cur, attn)
    head(b, inp, rms=False, logit_scale=spec.logit_scale != 0.0)


def starcoder2(b: Builder) -> None:
    """starcoder2.cpp 50-140: LayerNorms with biases, RoPE, a sequential GELU FFN with biases."""
    b.inputs()
    inp = b.embd
    for il in range(b.spec.n_layer):
        pre = f"blk.{il}."
        inp_sa = inp
        cur = build_norm(b, inp, pre + "attn_norm.weight", il, pre + "attn_norm.bias", rms=False)
        q, k, v = qkv_proj(b, il, cur)
        cur = attn_out(b, il, rope(b, q), rope(b, k), v)
        cur, inp_sa = last_rows(b, il, cur, inp_sa)
        ffn_inp = g.dup_op("ADD", cur, inp_sa)
        cur = build_norm(b, ffn_inp, pre + "ffn_norm.weight", il, pre + "ffn_norm.bias", rms=False)
        cur = b.add_bias(b.mm(pre + "ffn_up.weight", cur), pre + "ffn_up.bias")
        cur = b.add_bias(b.mm(pre + "ffn_down.weight", g.dup_op("UNARY", cur)), pre + "ffn_down.bias")
        inp = g.dup_op("ADD", cur, ffn_inp)
    head(b, inp, rms=False)


def minimax_m2(b: Builder) -> None:
    """minimax-m2.cpp 70-160: Q/K/V unreshaped (build_qkv reshape=false) with RMS norms over the whole Q and K rows,
    reshaped and roped; every layer's experts routed by the file's gating function with the selection bias."""
    spec = b.spec
    b.inputs()
    inp = b.embd
    for il in range(spec.n_layer):
        pre, T = f"blk.{il}.", b.T
        inp_sa = inp
        cur = build_norm(b, inp, pre + "attn_norm.weight", il)
        q, k, v = qkv_flat(b, il, cur)
        q = build_norm(b, q, pre + "attn_q_norm.weight", il)
        k = build_norm(b, k, pre + "attn_k_norm.weight", il)
        q = rope(b, g.reshape(q, spec.head_dim_k, spec.n_head[il], T))
        k = rope(b, g.reshape(k, spec.head_dim_k, spec.n_head_kv[il], T))
        v = g.reshape(v, spec.head_dim_v, spec.n_head_kv[il], T)
        cur = attn_out(b, il, q, k, v, wo_bias=False)
        cur, inp_sa = last_rows(b, il, cur, inp_sa)
        ffn_inp = g.dup_op("ADD", cur, inp_sa)
        cur = build_norm(b, ffn_inp, pre + "ffn_norm.weight", il)
        cur = b.moe(cur, il, file_gating(b), True, spec.expert_weights_scale)
        inp = g.dup_op("ADD", cur, ffn_inp)
    head(b, inp)


def hunyuan_moe(b: Builder) -> None:
    """hunyuan-moe.cpp 60-170: RoPE (with the rope factors) before the Q/K norms; every layer's ungated-by-router
    shared FFN beside softmax-routed experts, summed (experts first)."""
    spec = b.spec
    b.inputs()
    inp = b.embd
    for il in range(spec.n_layer):
        pre = f"blk.{il}."
        inp_sa = inp
        cur = build_norm(b, inp, pre + "attn_norm.weight", il)
        freqs = rope_factors(b, il)
        q, k, v = qkv_proj(b, il, cur)
        k = build_norm(b, rope(b, k, freqs), pre + "attn_k_norm.weight", il)
        q = build_norm(b, rope(b, q, freqs), pre + "attn_q_norm.weight", il)
        cur = attn_out(b, il, q, k, v)
        cur, inp_sa = last_rows(b, il, cur, inp_sa)
        ffn_inp = g.dup_op("ADD", cur, inp_sa)
        cur = build_norm(b, ffn_inp, pre + "ffn_norm.weight", il)
        mlp = b.ffn(cur, pre, "_shexp")
        experts = moe_ffn(b, cur, il, SOFTMAX, True, spec.expert_weights_scale)
        inp = g.dup_op("ADD", g.dup_op("ADD", experts, mlp), ffn_inp)
    head(b, inp)


BUILDERS: dict[str, Callable[[Builder], None]] = {
    "phi3": phi3, "glm4": glm4, "granite": granite, "granitemoe": granite, "olmo2": olmo2, "exaone4": exaone4,
    "cohere2": cohere, "command-r": cohere, "starcoder2": starcoder2, "minimax-m2": minimax_m2,
    "hunyuan-moe": hunyuan_moe,
}
