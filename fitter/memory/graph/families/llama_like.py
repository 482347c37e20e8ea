"""The llama-shaped graphs of llama.cpp 0c1e570 beyond fitter.memory.graph.families.transformer's: src/models/
mistral3.cpp, qwen2.cpp, qwen2vl.cpp, qwen3vl.cpp, qwen3vlmoe.cpp, seed-oss.cpp, ernie4-5.cpp, ernie4-5-moe.cpp and
smollm3.cpp, one builder with each model's differences as a `Variant`; and the blocks of src/llama-graph.cpp they
(and fitter.memory.graph.families.llama4) build with the optional tensors every model may carry: `build_lora_mm`
with its `.scale` (1520-1553), `build_lora_mm_id` with per-expert scales (1555-1596), `build_qkv` with a fused
`attn_qkv` (1633-1760), `build_ffn` with biases and scales (1762-1961), `build_moe_ffn` (1963-2373).
"""

from __future__ import annotations

from dataclasses import dataclass

from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.builder import SOFTMAX, Builder
from fitter.memory.graph.ggml_graph import Tensor


@dataclass(frozen=True)
class Variant:
    """What a model's graph changes from src/models/llama.cpp's dense or Mixtral-style layer."""

    n_pos: int = 1  # positions per token: 4 for M-RoPE / IM-RoPE (llama_hparams::n_pos_per_embd)
    qk_norm: bool = False  # weighted Q and K norms before RoPE (build_norm(attn_q_norm / attn_k_norm, il))
    nope_step: int = 0  # every nope_step-th layer has no RoPE (smollm3: n_no_rope_layer_step = 4)
    wo_bias: bool = True  # build_attn is given attn_output.bias (ernie4-5 passes NULL though it loads it)
    ffn_biases: bool = False  # build_ffn is given ffn_{up,gate,down}.bias
    ffn_scales: bool = False  # build_ffn is given ffn_{up,gate,down}.scale
    exps_scales: bool = False  # build_moe_ffn is given ffn_{up,gate,down}_exps.scale
    ffn_norm: str = "ffn_norm"  # the FFN's pre-norm (seed-oss: post_attention_norm)
    output_bias: bool = False  # ADD(logits, output.bias) (qwen2)
    attn_temp: bool = False  # Q = MUL(Q, inp_attn_scale) when attention.temperature_scale != 0 (mistral3)
    deepstack: bool = False  # n_deepstack_layers widen the input; each of the first layers adds its slice
    moe: str = ""  # which layers route experts: "gate_inp" (the tensor is there), "all", "interleaved" (ernie4-5-moe)
    rope_factors: bool = False  # ROPE reads llama_model::get_rope_factors (mistral3, llama4)


VARIANTS: dict[str, Variant] = {
    # mistral3.cpp 93-235: llama's graph with the optional temperature scaling of Q
    "mistral3": Variant(ffn_biases=True, ffn_scales=True, exps_scales=True, attn_temp=True, moe="gate_inp",
                        rope_factors=True),
    "qwen2": Variant(output_bias=True),  # qwen2.cpp 53-154
    "qwen2vl": Variant(n_pos=4),  # qwen2vl.cpp 42-143: ggml_rope_multi, M-RoPE positions
    "qwen3vl": Variant(n_pos=4, qk_norm=True, deepstack=True),  # qwen3vl.cpp 60-197
    "qwen3vlmoe": Variant(n_pos=4, qk_norm=True, deepstack=True, moe="all"),  # qwen3vlmoe.cpp 64-190
    "seed_oss": Variant(ffn_norm="post_attention_norm"),  # seed-oss.cpp 49-151
    "ernie4_5": Variant(wo_bias=False),  # ernie4-5.cpp 76-164
    "ernie4_5-moe": Variant(wo_bias=False, moe="interleaved"),  # ernie4-5-moe.cpp 7-133
    "smollm3": Variant(nope_step=4, ffn_biases=True),  # smollm3.cpp 46-152
}
ARCHS = tuple(VARIANTS)


# --- blocks (src/llama-graph.cpp) ---------------------------------------------------------------------------------


def lora_mm(b: Builder, weight: str, x: Tensor, scale: str | None = None) -> Tensor:
    """build_lora_mm: MUL_MAT, then MUL by the weight's `.scale` where the model passes it."""
    cur = b.mm(weight, x)
    s = b.w(scale) if scale else None
    return g.dup_op("MUL", cur, s) if s is not None else cur


def lora_mm_id(b: Builder, weight: str, x: Tensor, ids: Tensor, scale: str | None = None) -> Tensor:
    """build_lora_mm_id: MUL_MAT_ID; a per-expert scale is repeated over the tokens, gathered for the selected
    experts and multiplied in."""
    cur = g.mul_mat_id(b.weight(weight), x, ids)
    s = b.w(scale) if scale else None
    if s is None:
        return cur
    s = g.reshape(s, 1, s.ne[0], 1)
    s = g.new(s.type, 1, s.ne[1], x.ne[2], 1, op="REPEAT", src=(s,))
    return g.dup_op("MUL", cur, g.get_rows(s, ids))


def rope_factors(b: Builder, il: int) -> Tensor | None:
    """llama_model::get_rope_factors (src/llama-model.cpp 2337-2350): the layer's rope_freqs, else its long or short
    factors (one or the other by the context; the same shape, and either is a copy on the layer's own device, so
    which one changes nothing here)."""
    for name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        if name in b.names:
            return b.layer_weight(name, il)
    return None


def qkv_proj(b: Builder, il: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """build_qkv (reshape=true): a fused attn_qkv's Q, K and V are views of its product (separate Q/K/V biases are
    concatenated into one), else three products with their scales and biases, reshaped to heads."""
    spec, pre, T = b.spec, f"blk.{il}.", x.ne[1]
    dk, dv, nh, nkv = spec.head_dim_k, spec.head_dim_v, spec.n_head[il], spec.n_head_kv[il]
    if pre + "attn_qkv.weight" in b.names:
        cur = lora_mm(b, pre + "attn_qkv.weight", x, pre + "attn_qkv.scale")
        biases = [pre + f"attn_{n}.bias" for n in "qkv"]
        if pre + "attn_qkv.bias" in b.names:
            cur = b.add_bias(cur, pre + "attn_qkv.bias")
        elif all(n in b.names for n in biases):
            qb, kb, vb = (b.weight(n) for n in biases)
            cur = g.dup_op("ADD", cur, g.concat(g.concat(qb, kb), vb))
        nq, nk = dk * nh, dk * nkv
        q = g.view(cur, (dk, nh, T), (dk * 4, cur.nb[1]))
        k = g.view(cur, (dk, nkv, T), (dk * 4, cur.nb[1]), nq * 4)
        v = g.view(cur, (dv, nkv, T), (dv * 4, cur.nb[1]), (nq + nk) * 4)
        return q, k, v
    q, k, v = (b.add_bias(lora_mm(b, pre + f"attn_{n}.weight", x, pre + f"attn_{n}.scale"), pre + f"attn_{n}.bias")
               for n in "qkv")
    return g.reshape(q, dk, nh, T), g.reshape(k, dk, nkv, T), g.reshape(v, dv, nkv, T)


def attn_out(b: Builder, il: int, q: Tensor, k: Tensor, v: Tensor, wo_bias: bool = True) -> Tensor:
    """build_attn's attention, then wo with its scale, then (where the model passes it) wo's bias."""
    pre = f"blk.{il}."
    cur = lora_mm(b, pre + "attn_output.weight", b.attention(il, q, k, v, None), pre + "attn_output.scale")
    return b.add_bias(cur, pre + "attn_output.bias") if wo_bias else cur


def ffn_scaled(b: Builder, x: Tensor, pre: str, suffix: str = "", biases: bool = False, scales: bool = False) -> Tensor:
    """build_ffn with SiLU and a parallel gate: up (+ bias, × scale), gate (+ bias, × scale), swiglu_split, down
    (+ bias, × scale)."""

    def proj(kind: str, src: Tensor) -> Tensor:
        name = f"{pre}ffn_{kind}{suffix}"
        cur = b.mm(name + ".weight", src)
        cur = b.add_bias(cur, name + ".bias") if biases else cur
        s = b.w(name + ".scale") if scales else None
        return g.dup_op("MUL", cur, s) if s is not None else cur

    up = proj("up", x)
    gate = proj("gate", x)
    return proj("down", g.glu("GLU", gate, up))


def moe_ffn(b: Builder, x: Tensor, il: int, gating: int, norm_w: bool, w_scale: float = 0.0, *,
        exps_scales: bool = False, probs_bias: bool = False, weight_before_ffn: bool = False) -> Tensor:
    """build_moe_ffn for the experts of layer il. `probs_bias`: the model passes exp_probs_b (a selection bias);
    `weight_before_ffn` (llama4): experts are chosen on the raw logits and the token's activations, repeated once per
    chosen expert, are weighted before the experts run (REPEAT, MUL) rather than their outputs after."""
    spec, pre = b.spec, f"blk.{il}."
    T, k, n_expert = x.ne[1], spec.n_expert_used, spec.n_expert
    logits = b.mm(pre + "ffn_gate_inp.weight", x)
    probs = g.dup_op("SOFT_MAX" if gating == SOFTMAX else "UNARY", logits)
    selection = probs
    if probs_bias and pre + "exp_probs_b.bias" in b.names:
        selection = g.dup_op("ADD", probs, b.weight(pre + "exp_probs_b.bias"))
    if weight_before_ffn:
        selection = logits
    selected = g.argsort_top_k(selection, k)
    weights = g.get_rows(g.reshape(probs, 1, n_expert, T), selected)
    if norm_w:
        w2 = g.reshape(weights, k, T)
        weights = g.reshape(g.dup_op("DIV", w2, g.clamp(g.sum_rows(w2))), 1, k, T)
    if w_scale not in (0.0, 1.0):
        weights = g.dup_op("SCALE", weights)
    b.gf.expand(weights)
    cur = g.reshape(x, spec.n_embd, 1, T)
    if weight_before_ffn:
        cur = g.dup_op("MUL", g.new(cur.type, spec.n_embd, k, T, op="REPEAT", src=(cur,)), weights)

    def scale(kind: str) -> str | None:
        return f"{pre}ffn_{kind}_exps.scale" if exps_scales else None

    up = lora_mm_id(b, pre + "ffn_up_exps.weight", cur, selected, scale("up"))
    if pre + "ffn_gate_exps.weight" in b.names:
        gate = lora_mm_id(b, pre + "ffn_gate_exps.weight", cur, selected, scale("gate"))
        act = g.glu("GLU", gate, up)
    else:  # no gate (ernie4-5-moe's is optional): SiLU of the up product
        act = g.dup_op("UNARY", up)
    experts = lora_mm_id(b, pre + "ffn_down_exps.weight", act, selected, scale("down"))
    if not weight_before_ffn:
        experts = g.dup_op("MUL", experts, weights)
    b.gf.expand(experts)
    views = [g.view(experts, (spec.n_embd, T), (experts.nb[2],), i * experts.nb[1]) for i in range(k)]
    for view in views:
        b.gf.expand(view)
    out = views[0]
    for view in views[1:]:
        out = b.gf.expand(g.dup_op("ADD", out, view))
    return g.cont(out) if k == 1 else out


def lm_head(b: Builder, cur: Tensor, bias: bool = False) -> None:
    """The final norm (res->t_embd), the lm_head with its scale (and qwen2's bias: res->t_logits)."""
    cur = b.norm(cur, "output_norm.weight")
    cur.is_output = True
    out_w = "output.weight" if "output.weight" in b.names else "token_embd.weight"
    logits = lora_mm(b, out_w, cur, "output.scale")
    if bias:
        logits = b.add_bias(logits, "output.bias")
    logits.is_output = True
    b.gf.expand(logits)


# --- the graph ------------------------------------------------------------------------------------------------------


def _is_moe(b: Builder, v: Variant, il: int) -> bool:
    if v.moe == "all":
        return True
    if v.moe == "interleaved":  # ernie4-5-moe.cpp 62-63
        step = b.spec.moe_layer_step
        return step > 0 and il >= b.spec.n_layer_dense_lead and (il + 1) % step == 0
    return v.moe == "gate_inp" and f"blk.{il}.ffn_gate_inp.weight" in b.names


def build_llama_like(b: Builder) -> None:
    """One llama-shaped graph (the `graph` constructors of the files and lines VARIANTS names): embeddings, then per
    layer norm, Q/K/V (Q/K norms, RoPE or none, the temperature MUL), attention and wo, the last layer's rows
    gathered, the residual, the FFN's norm, a dense or MoE FFN, the residual (and a deepstack slice); the head."""
    spec = b.spec
    v = VARIANTS[spec.arch]
    n_ds = spec.n_deepstack if v.deepstack else 0
    b.inputs(n_pos=v.n_pos, n_embd_inp=spec.n_embd * (1 + n_ds))
    # build_inp_attn_scale: F32 [1, 1, T] (llama-graph.cpp 2479-2492)
    attn_scale = g.input_tensor("F32", 1, 1, b.T, name="inp_attn_scale") if v.attn_temp and spec.attn_temp_scale \
        else None
    inp, last = b.embd, spec.n_layer - 1
    for il in range(spec.n_layer):
        pre = f"blk.{il}."
        inp_sa = inp
        cur = b.norm(inp, pre + "attn_norm.weight")
        q, k, val = qkv_proj(b, il, cur)
        if v.nope_step == 0 or (il + 1) % v.nope_step != 0:
            freqs = rope_factors(b, il) if v.rope_factors else None
            if v.qk_norm:
                q = b.norm(q, pre + "attn_q_norm.weight")
            q = g.dup_op("ROPE", q, b.pos, freqs)
            if v.qk_norm:
                k = b.norm(k, pre + "attn_k_norm.weight")
            k = g.dup_op("ROPE", k, b.pos, freqs)
        if attn_scale is not None:
            q = g.dup_op("MUL", q, attn_scale)
        cur = attn_out(b, il, q, k, val, v.wo_bias)
        if il == last:  # only the rows that are output (build_inp_out_ids)
            cur, inp_sa = g.get_rows(cur, b.out_ids), g.get_rows(inp_sa, b.out_ids)
        ffn_inp = g.dup_op("ADD", cur, inp_sa)
        cur = b.norm(ffn_inp, f"{pre}{v.ffn_norm}.weight")
        if not _is_moe(b, v, il):
            cur = ffn_scaled(b, cur, pre, biases=v.ffn_biases, scales=v.ffn_scales)
        else:
            normed = cur
            ernie = spec.arch == "ernie4_5-moe"
            cur = moe_ffn(b, cur, il, SOFTMAX, True, spec.expert_weights_scale, exps_scales=v.exps_scales,
                      probs_bias=ernie)
            if ernie and spec.n_ff_shexp > 0:  # the ungated shared expert
                cur = g.dup_op("ADD", cur, ffn_scaled(b, normed, pre, "_shexp"))
        cur = g.dup_op("ADD", cur, ffn_inp)
        if il < n_ds:  # deepstack: this layer's slice of the wide input (qwen3vl.cpp 152-156)
            ds = g.view(b.inp_embd, (spec.n_embd, b.T), (b.inp_embd.nb[1],), (il + 1) * spec.n_embd * 4)
            cur = g.dup_op("ADD", cur, ds)
        inp = cur
    lm_head(b, inp, v.output_bias)

