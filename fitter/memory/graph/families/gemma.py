"""The Gemma family: src/models/gemma.cpp (Gemma), gemma2.cpp (Gemma 2) and gemma3.cpp (Gemma 3) of llama.cpp 0c1e570.

What they share, and what the transformer trunk (families/transformer.py) does not: the token embeddings scaled by
sqrt(n_embd) (a SCALE node), the queries scaled after RoPE (a SCALE node; build_attn's kq_scale is 1), and the
GELU-gated FFN (`ggml_geglu_split`: the GLU node of the SiLU FFN, same shape and sources). Gemma 2 and 3 add a norm
after attention (pinned: il >= 0) and one after the FFN that llama.cpp builds with il = -1, so graph_get_cb does not
pin it; the residual adds take the normed branches. Gemma 2 soft-caps the attention logits (without flash attention:
SCALE, tanh, SCALE before the softmax, build_attn_mha) and always the final logits; Gemma 3 the final logits only
when the file's `final_logit_softcapping` is non-zero, and has Q/K norms. Gemma 2 is always iSWA; Gemma 3 when the
file gives a sliding window (else `graph<false>` over one KV cache); Gemma one KV cache.
"""

from __future__ import annotations

from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.builder import Builder
from fitter.memory.graph.ggml_graph import Tensor

ARCHS = ("gemma", "gemma2", "gemma3")


def norm(b: Builder, x: Tensor, weight: str, il: int) -> Tensor:
    """build_norm (src/llama-graph.cpp 1597-1630) with LLM_NORM_RMS and a weight: RMS_NORM, then MUL. graph_get_cb
    (src/llama-context.cpp 2635-2659) pins the RMS_NORM ("norm") to layer il's device only when il >= 0."""
    cur = g.dup_op("RMS_NORM", x)
    if il >= 0:
        b.norm_pins.append((cur, il))
    return g.dup_op("MUL", cur, b.weight(weight))


def mm_scaled(b: Builder, weight: str, x: Tensor) -> Tensor:
    """build_lora_mm (src/llama-graph.cpp 1520-1553): the mat-mul, then a MUL by the weight's optional `.scale`
    tensor ({1}), which llama_model's generic pass loads for attention and FFN weights (src/llama-model.cpp
    1634-1668)."""
    cur = b.mm(weight, x)
    scale = b.w(weight.removesuffix(".weight") + ".scale")
    return g.dup_op("MUL", cur, scale) if scale is not None else cur


def qkv(b: Builder, il: int, x: Tensor, head_q: int, head_kv: int) -> tuple[Tensor, Tensor, Tensor]:
    """build_qkv (src/llama-graph.cpp 1646-1760) as llm_graph_context::build_qkv(layer, cur, n_embd_head, n_head,
    n_head_kv, il) calls it (reshape = true, no kqv clamp for these architectures): a fused `attn_qkv` is one mat-mul
    (its `.scale`, then its bias or the three separate biases concatenated) and Q/K/V views of it; separate weights are
    three mat-muls, each with its `.scale` and bias, reshaped to heads. `create_tensor_qkv` (src/llama-model.cpp
    3396-3432) loads either form."""
    spec = b.spec
    pre = f"blk.{il}."
    T = x.ne[1]
    n_q, n_kv = spec.n_head[il], spec.n_head_kv[il]
    if pre + "attn_qkv.weight" in b.names:
        fused = mm_scaled(b, pre + "attn_qkv.weight", x)
        bias = b.w(pre + "attn_qkv.bias")
        if bias is None and all(f"{pre}attn_{n}.bias" in b.names for n in "qkv"):
            q_b, k_b, v_b = (b.weight(f"{pre}attn_{n}.bias") for n in "qkv")
            bias = g.concat(g.concat(q_b, k_b), v_b)
        if bias is not None:
            fused = g.dup_op("ADD", fused, bias)
        f32 = fused.nb[0]
        q = g.view(fused, (head_q, n_q, T), (head_q * f32, fused.nb[1]))
        k = g.view(fused, (head_kv, n_kv, T), (head_kv * f32, fused.nb[1]), head_q * n_q * f32)
        v = g.view(fused, (head_kv, n_kv, T), (head_kv * f32, fused.nb[1]), (head_q * n_q + head_kv * n_kv) * f32)
        return q, k, v
    q = b.add_bias(mm_scaled(b, pre + "attn_q.weight", x), pre + "attn_q.bias")
    k = b.add_bias(mm_scaled(b, pre + "attn_k.weight", x), pre + "attn_k.bias")
    v = b.add_bias(mm_scaled(b, pre + "attn_v.weight", x), pre + "attn_v.bias")
    return g.reshape(q, head_q, n_q, T), g.reshape(k, head_kv, n_kv, T), g.reshape(v, head_kv, n_kv, T)


def softcap(x: Tensor) -> Tensor:
    """ggml_scale(1/c), ggml_tanh, ggml_scale(c): three nodes of x's shape, each able to overwrite its source."""
    return g.dup_op("SCALE", g.dup_op("UNARY", g.dup_op("SCALE", x)))


def build_gemma(b: Builder) -> None:
    """llama_model_gemma::graph (src/models/gemma.cpp 41-139), llama_model_gemma2::graph (src/models/gemma2.cpp
    60-175) and llama_model_gemma3::graph<iswa> (src/models/gemma3.cpp 81-220), node for node."""
    spec = b.spec
    arch = spec.arch
    b.inputs()
    # ggml_scale(inpL, sqrtf(n_embd)): a node of its own after build_inp_embd's expand (the reserve's ubatch has
    # tokens, so gemma3 scales too)
    inp = g.dup_op("SCALE", b.embd)
    # gemma.cpp reshapes Q, K and V with n_embd_head_v; gemma2 and gemma3 with n_embd_head_k
    head = spec.head_dim_v if arch == "gemma" else spec.head_dim_k
    post_norms = arch != "gemma"
    last = spec.n_layer_trunk - 1
    for il in range(spec.n_layer_trunk):
        pre = f"blk.{il}."
        cur = norm(b, inp, pre + "attn_norm.weight", il)
        q, k, v = qkv(b, il, cur, head, head)
        if arch == "gemma3":  # Q norm, RoPE, K norm, RoPE; the DFS order is attention's expand order anyway
            q = norm(b, q, pre + "attn_q_norm.weight", il)
        q = g.dup_op("ROPE", q, b.pos)
        if arch == "gemma3":
            k = norm(b, k, pre + "attn_k_norm.weight", il)
        k = g.dup_op("ROPE", k, b.pos)
        q = g.dup_op("SCALE", q)  # f_attention_scale (gemma: 1/sqrt(n_embd_head)); kq_scale is 1
        # gemma2 is always built over the iSWA cache (build_attn_inp_kv_iswa), gemma3 when the file gives a window:
        # its order of expands (q, k, v) holds even where no layer slides
        cur = b.attention(il, q, k, v, None, softcap=arch == "gemma2", iswa=arch == "gemma2" or spec.n_swa > 0)
        cur = mm_scaled(b, pre + "attn_output.weight", cur)  # build_attn's wo with wo_s; wo_b is NULL here
        if il == last:  # inp_out_ids: the last layer only computes the rows that are output
            cur = g.get_rows(cur, b.out_ids)
            inp = g.get_rows(inp, b.out_ids)
        if post_norms:
            cur = norm(b, cur, pre + "post_attention_norm.weight", il)
        sa_out = g.dup_op("ADD", cur, inp)
        cur = norm(b, sa_out, pre + "ffn_norm.weight", il)
        # build_ffn(LLM_FFN_GELU, LLM_FFN_PAR) with no biases and no scales: up, gate, geglu_split(gate, up), down
        cur = b.ffn(cur, pre)
        if post_norms:
            cur = norm(b, cur, pre + "post_ffw_norm.weight", -1)  # il = -1: not pinned
        inp = g.dup_op("ADD", cur, sa_out)
    cur = norm(b, inp, "output_norm.weight", -1)
    cur.is_output = True  # res->t_embd
    # gemma and gemma2 always create `output` as token_embd duplicated (a file with output.weight too is refused:
    # a tensor not loaded); gemma3 takes output.weight when the file has it
    out_w = b.output_weight()
    logits = g.mul_mat(out_w, cur)
    if out_w.type == "NVFP4":  # output_s is loaded only for an NVFP4 output (src/llama-model.cpp 1775-1779)
        scale = b.w("output.scale")
        logits = g.dup_op("MUL", logits, scale) if scale is not None else logits
    if arch == "gemma2" or (arch == "gemma3" and spec.final_logit_softcapping):
        logits = softcap(logits)
    logits.is_output = True  # res->t_logits
    b.gf.expand(logits)
