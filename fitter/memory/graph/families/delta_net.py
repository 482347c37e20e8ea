"""Gated DeltaNet hybrids: src/models/qwen3next.cpp (Qwen3-Next), qwen35.cpp (Qwen3.5/3.6 dense) and qwen35moe.cpp
(Qwen3.5/3.6 MoE) of llama.cpp 0c1e570, on the hybrid memory (`build_inp_mem_hybrid`, src/llama-graph.cpp 3633-3642).

Every `full_attention_interval`-th layer (or as `attention.recurrent_layers` marks) is a gated full-attention layer
over the KV cache; the others are linear-attention layers: a short convolution over the conv state `r_l` and the
fused GATED_DELTA_NET op over the SSM state `s_l` (src/models/delta-net-base.cpp; `cparams.fused_gdn_ar` and
`fused_gdn_ch` are hard-coded true, src/llama-context.cpp 233-235, so the chunked fallback is never built). The
states are memory of their own, like the KV cache (src/llama-memory-recurrent.cpp: F32 `{n_embd_r or n_embd_s,
mem_size}` per recurrent layer, mem_size = max(1, n_seq_max), on the layer's device unless -nkvo). With
`cparams.embeddings_nextn_masked` false (src/llama-context.cpp 120) the last layer runs on every token: the output
norm's result is kept (t_h_nextn) and the output rows are taken after it.
"""

from __future__ import annotations

from collections.abc import Callable

from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.builder import SOFTMAX, Builder
from fitter.memory.graph.ggml_graph import Tensor
from fitter.memory.graph.recurrent_ops import cpy, gated_delta_net, repeat, scale_inplace, ssm_conv

ARCHS = ("qwen3next", "qwen35", "qwen35moe")
# LLAMA_ROPE_TYPE_IMROPE (src/llama-model.cpp llama_model_rope_type): n_pos_per_embd = 4 positions per token
_IMROPE = ("qwen35", "qwen35moe")
F32 = 4


class StateInput:
    """build_rs_inp_impl (src/llama-graph.cpp 3548-3570) for the reserve's full memory context: `rs_s_copy` I32
    [n_rs], n_rs = mem_size = n_seqs (get_n_rs, src/llama-memory-recurrent.cpp 1318), head 0, rs_z 0."""

    def __init__(self, b: Builder) -> None:
        self.n_seqs = b.p.n_seqs
        self.n_rs = max(1, b.p.n_seqs)
        s_copy = g.input_tensor("I32", self.n_rs, name="rs_s_copy")
        self.main = g.view(s_copy, (self.n_seqs,), ())
        self.extra = g.view(s_copy, (self.n_rs - self.n_seqs,), (), self.n_seqs * s_copy.nb[0])

    def cache(self, b: Builder, il: int, width: int) -> Tensor:
        """A layer's `cache_r_l` or `cache_s_l`: F32 {width, mem_size}, placed like the layer's KV cache."""
        t = g.data_tensor("F32", width, self.n_rs, weight=False)
        b.kv.append((t, il))
        return t

    def read(self, b: Builder, s: Tensor, size: int,
             rows: Callable[[Tensor, Tensor], Tensor] = g.get_rows) -> Tensor:
        """build_rs (src/llama-graph.cpp 3512-3546): clear state rs_z (an in-place SCALE, a view), gather the
        ubatch's states [size, n_seqs] (or `rows`: the model's get_state_rows on them and the ids), copy the extra
        states (none in the reserve)."""
        states = g.reshape(s, size, s.ne[1])
        b.gf.expand(scale_inplace(g.view(states, (size,), ())))
        out = rows(states, self.main)
        b.gf.expand(out)
        extra = g.get_rows(states, self.extra)
        rest = g.view(s, (size, self.n_rs - self.n_seqs), (s.nb[1],), self.n_seqs * s.nb[1])
        b.gf.expand(cpy(extra, rest))
        return out


def build_delta_net(b: Builder) -> None:
    """The trunk of llama_model_qwen3next::graph / qwen35 / qwen35moe (qwen3next.cpp 138-223, qwen35.cpp 133-225,
    qwen35moe.cpp 156-249)."""
    spec = b.spec
    b.inputs()
    if spec.arch in _IMROPE:
        b.pos = g.input_tensor("I32", b.T * 4, name="inp_pos")  # build_inp_pos: n_tokens * n_pos_per_embd
    rs = StateInput(b)
    inp = b.embd
    for il in range(spec.n_layer_trunk):
        pre = f"blk.{il}."
        inp_sa = inp
        cur = b.norm(inp, pre + "attn_norm.weight")
        b.gf.expand(cur)
        cur = linear_attention(b, rs, il, cur) if spec.recurrent_layers[il] else gated_attention(b, il, cur)
        # no get_rows in the last layer: embeddings_nextn_masked is false
        cur = g.dup_op("ADD", cur, inp_sa)
        residual = cur
        cur = b.norm(cur, pre + "post_attention_norm.weight")
        cur = g.dup_op("ADD", _ffn_layer(b, il, cur), residual)
        inp = cur
    h = b.norm(inp, "output_norm.weight")
    h.is_output = True  # res->t_h_nextn
    embd = g.get_rows(h, b.out_ids)
    embd.is_output = True  # res->t_embd
    out_w = "output.weight" if "output.weight" in b.names else "token_embd.weight"
    logits = b.mm(out_w, embd)
    if b.shapes[out_w].type == "NVFP4":  # model.output_s: loaded for an NVFP4 output only (src/llama-model.cpp)
        logits = _scale(b, logits, "output.scale")
    logits.is_output = True  # res->t_logits
    b.gf.expand(logits)


def _scale(b: Builder, t: Tensor, name: str) -> Tensor:
    s = b.w(name)
    return g.dup_op("MUL", t, s) if s is not None else t


def _mm(b: Builder, name: str, x: Tensor, scaled: bool = True) -> Tensor:
    """build_lora_mm(w, cur, w_s) (src/llama-graph.cpp 1520-1553): the mat-mul, then MUL by `<name>.scale` where the
    architecture passes it (the generic loader pass loads any `.scale` beside a weight, src/llama-model.cpp
    1634-1712)."""
    out = b.mm(name + ".weight", x)
    return _scale(b, out, name + ".scale") if scaled else out


def _qkv(b: Builder, il: int, x: Tensor, n_q: int, n_k: int, n_v: int) -> tuple[Tensor, Tensor, Tensor]:
    """build_qkv with reshape = false (src/llama-graph.cpp 1647-1759): a fused `attn_qkv` gives three CONTs of its
    column views, separate weights their mat-muls (each with its `.scale` MUL, then its bias)."""
    pre = f"blk.{il}."
    if pre + "attn_qkv.weight" in b.names:
        qkv = _mm(b, pre + "attn_qkv", x)
        bias = b.w(pre + "attn_qkv.bias")
        biases = [b.w(pre + f"attn_{n}.bias") for n in "qkv"] if bias is None else []
        if bias is not None:
            qkv = g.dup_op("ADD", qkv, bias)
        elif all(t is not None for t in biases):
            q_b, k_b, v_b = (t for t in biases if t is not None)
            qkv = g.dup_op("ADD", qkv, g.concat(g.concat(q_b, k_b), v_b))
        T, row = x.ne[1], qkv.nb[1]
        return (g.cont(g.view(qkv, (n_q, T), (row,))), g.cont(g.view(qkv, (n_k, T), (row,), n_q * F32)),
                g.cont(g.view(qkv, (n_v, T), (row,), (n_q + n_k) * F32)))
    q = b.add_bias(_mm(b, pre + "attn_q", x), pre + "attn_q.bias")
    k = b.add_bias(_mm(b, pre + "attn_k", x), pre + "attn_k.bias")
    v = b.add_bias(_mm(b, pre + "attn_v", x), pre + "attn_v.bias")
    return q, k, v


def gated_attention(b: Builder, il: int, x: Tensor) -> Tensor:
    """build_layer_attn (qwen3next.cpp 236-312, qwen35.cpp 254-333, qwen35moe.cpp 278-357): Q and its gate from one
    projection, Q/K norms, RoPE, attention over the KV cache, the output gated by sigmoid(gate)."""
    spec = b.spec
    pre = f"blk.{il}."
    d, n_head, n_head_kv, T = spec.head_dim_k, spec.n_head[il], spec.n_head_kv[il], x.ne[1]
    q_full, k, v = _qkv(b, il, x, 2 * d * n_head, d * n_head_kv, d * n_head_kv)
    if spec.arch == "qwen3next":
        q_full = g.reshape(q_full, 2 * d, n_head, T, 1)
        nb: tuple[int, ...] = (q_full.nb[1], q_full.nb[2], q_full.nb[3])
        q = g.view(q_full, (d, n_head, T, 1), nb)
        gate = g.view(q_full, (d, n_head, T, 1), nb, d * F32)
    else:
        nb = (2 * d * F32, 2 * d * n_head * F32)
        q = g.view(q_full, (d, n_head, T), nb)
        gate = g.view(q_full, (d, n_head, T), nb, d * F32)
    k = g.reshape(k, d, n_head_kv, T)
    v = g.reshape(v, d, n_head_kv, T)
    q = b.norm(q, pre + "attn_q_norm.weight")
    k = b.norm(k, pre + "attn_k_norm.weight")
    q = g.dup_op("ROPE", q, b.pos)  # ggml_rope_ext, or ggml_rope_multi (same op and shape)
    k = g.dup_op("ROPE", k, b.pos)
    cur = b.attention(il, q, k, v, None)
    gate = g.dup_op("UNARY", g.cont(gate, d * n_head, T))  # ggml_cont_2d, ggml_sigmoid
    cur = g.dup_op("MUL", cur, gate)
    return _mm(b, pre + "attn_output", cur)


def linear_attention(b: Builder, rs: StateInput, il: int, x: Tensor) -> Tensor:
    """build_layer_attn_linear (qwen3next.cpp 395-563, qwen35.cpp 335-468, qwen35moe.cpp 359-492) with
    build_conv_state and build_recurrent_attn (delta-net-base.cpp 449-606)."""
    spec = b.spec
    pre = f"blk.{il}."
    next_ = spec.arch == "qwen3next"  # Qwen3-Next: ssm_ba, no `.scale` MULs in this layer, REPEATed q/k heads
    scaled = not next_
    ns = rs.n_seqs
    nst = x.ne[1] // ns
    d_inner, head_k, n_k, n_v = spec.ssm_d_inner, spec.ssm_d_state, spec.ssm_n_group, spec.ssm_dt_rank
    head_v = d_inner // n_v
    if next_ and pre + "attn_qkv.weight" not in b.names:
        qkv, z = _legacy_qkvz(b, il, x, nst, ns)
    else:
        qkv = _mm(b, pre + "attn_qkv", x, scaled)
        qkv = g.reshape(qkv, qkv.ne[0], nst, ns)
        z = _mm(b, pre + "attn_gate", x, scaled)
    if next_:
        ba = g.reshape(b.mm(pre + "ssm_ba.weight", x), 2 * n_v // n_k, n_k, nst, ns)
        strides = (ba.nb[1], ba.nb[2], ba.nb[3])
        beta = g.dup_op("UNARY", g.cont(g.view(ba, (n_v // n_k, n_k, nst, ns), strides)))  # sigmoid
        beta = g.reshape(beta, 1, n_v, nst, ns)
        alpha = g.cont(g.view(ba, (n_v // n_k, n_k, nst, ns), strides, n_v // n_k * F32), n_v, nst, ns)
    else:
        beta = g.dup_op("UNARY", g.reshape(_mm(b, pre + "ssm_beta", x), 1, n_v, nst, ns))  # sigmoid
        alpha = g.reshape(_mm(b, pre + "ssm_alpha", x), n_v, nst, ns)
    alpha = g.dup_op("UNARY", g.dup_op("ADD", alpha, b.weight(pre + "ssm_dt.bias")))  # softplus
    gate = g.reshape(g.dup_op("MUL", alpha, b.weight(pre + "ssm_a")), 1, n_v, nst, ns)
    conv_states_all = rs.cache(b, il, spec.n_embd_r)
    ssm_states_all = rs.cache(b, il, spec.n_embd_s)
    kernel = b.weight(pre + "ssm_conv1d.weight")
    conv_input = _conv_state(b, rs, conv_states_all, qkv, kernel.ne[0], d_inner + 2 * n_k * head_k)
    state = g.reshape(rs.read(b, ssm_states_all, spec.n_embd_s), head_v, head_v, n_v, ns)
    conv = g.dup_op("UNARY", ssm_conv(conv_input, kernel))  # silu
    row = (2 * head_k * n_k + head_v * n_v) * F32
    q = g.view(conv, (head_k, n_k, nst, ns), (head_k * F32, row, row * nst))
    k = g.view(conv, (head_k, n_k, nst, ns), (head_k * F32, row, row * nst), head_k * n_k * F32)
    v = g.view(conv, (head_v, n_v, nst, ns), (head_v * F32, row, row * nst), 2 * head_k * n_k * F32)
    q = g.dup_op("SCALE", g.dup_op("RMS_NORM", q))  # build_gdn_l2_norm (src/models/models.h 14-18)
    k = g.dup_op("SCALE", g.dup_op("RMS_NORM", k))
    if next_ and n_k != n_v:  # qwen35/qwen35moe skip it with the fused op (qwen35.cpp 438)
        q, k = (g.reshape(repeat(g.reshape(t, head_k, 1, n_k, nst * ns), head_k, n_v // n_k, n_k, nst * ns),
                          head_k, n_v, nst, ns) for t in (q, k))
    out = _recurrent_attn(b, ssm_states_all, q, k, v, gate, beta, state)
    # build_norm_gated: RMS norm (pinned) times ssm_norm, times silu(z)
    normed = b.norm(out, pre + "ssm_norm.weight")
    cur = g.dup_op("MUL", normed, g.dup_op("UNARY", g.reshape(z, head_v, n_v, nst, ns)))
    cur = _mm(b, pre + "ssm_out", g.reshape(cur, head_v * n_v, nst, ns), scaled)
    return g.reshape(cur, spec.n_embd, nst * ns)


def _legacy_qkvz(b: Builder, il: int, x: Tensor, nst: int, ns: int) -> tuple[Tensor, Tensor]:
    """build_qkvz's legacy path (qwen3next.cpp 336-392): one `ssm_in` projection split per key head into q, k, v
    and z; z and the flattened q, k, v are CONTs, q|k|v two CONCATs."""
    spec = b.spec
    head_k, n_k, n_v = spec.ssm_d_state, spec.ssm_n_group, spec.ssm_dt_rank
    head_v = spec.ssm_d_inner // n_v
    width_v = head_v * n_v // n_k
    mixed = g.reshape(b.mm(f"blk.{il}.ssm_in.weight", x), 2 * head_k + 2 * width_v, n_k, nst, ns)
    strides = (mixed.nb[1], mixed.nb[2], mixed.nb[3])
    query = g.view(mixed, (head_k, n_k, nst, ns), strides)
    key = g.view(mixed, (head_k, n_k, nst, ns), strides, head_k * F32)
    value = g.view(mixed, (width_v, n_k, nst, ns), strides, 2 * head_k * F32)
    z = g.cont(g.view(mixed, (width_v, n_k, nst, ns), strides, (2 * head_k + width_v) * F32))
    q_flat = g.cont(query, head_k * n_k, nst, ns)
    k_flat = g.cont(key, head_k * n_k, nst, ns)
    v_flat = g.cont(value, head_v * n_v, nst, ns)
    return g.concat(g.concat(q_flat, k_flat), v_flat), z


def _conv_state(b: Builder, rs: StateInput, conv_states_all: Tensor, qkv: Tensor, d_conv: int,
                channels: int) -> Tensor:
    """build_conv_state (delta-net-base.cpp 449-525, n_rs_seq = 0): the stored conv state before the new tokens,
    and the last d_conv - 1 columns copied back into the cache."""
    ns = rs.n_seqs
    conv_states = g.reshape(rs.read(b, conv_states_all, conv_states_all.ne[0]), d_conv - 1, channels, ns)
    conv_input = g.concat(conv_states, g.transpose(qkv))
    last = g.view(conv_input, (d_conv - 1, channels, ns), (conv_input.nb[1], conv_input.nb[2]),
                  (conv_input.ne[0] - conv_states.ne[0]) * F32)
    update = g.view(conv_states_all, ((d_conv - 1) * channels, ns), (conv_states_all.nb[1],))
    b.gf.expand(cpy(last, update))
    return conv_input


def _recurrent_attn(b: Builder, ssm_states_all: Tensor, q: Tensor, k: Tensor, v: Tensor, gate: Tensor,
                    beta: Tensor, state: Tensor) -> Tensor:
    """build_recurrent_attn without rollback snapshots (delta-net-base.cpp 527-553) over build_delta_net_fused
    (delta-net-base.cpp 373-423): one GATED_DELTA_NET node; its output and new state are views of it, the state
    copied into the cache at once."""
    s_v, n_v, ns = state.ne[0], state.ne[2], state.ne[3]
    nst = q.ne[2]
    result = gated_delta_net(q, k, v, gate, beta, state)
    out = g.view(result, (s_v, n_v, nst, ns), (s_v * F32, s_v * n_v * F32, s_v * n_v * nst * F32))
    new_state = g.view(result, (s_v, s_v, n_v, ns), (s_v * F32, s_v * s_v * F32, s_v * s_v * n_v * F32),
                       s_v * n_v * nst * ns * F32)
    dst = g.view(ssm_states_all, (ssm_states_all.ne[0], ns), (ssm_states_all.nb[1],))
    b.gf.expand(cpy(new_state, dst))
    return out


def _ffn(b: Builder, x: Tensor, pre: str, suffix: str, scaled: bool) -> Tensor:
    """build_ffn(SILU, PAR) with the weights' `.scale` MULs after each mat-mul (src/llama-graph.cpp 1762-1958)."""
    up = _mm(b, f"{pre}ffn_up{suffix}", x, scaled)
    gate = _mm(b, f"{pre}ffn_gate{suffix}", x, scaled)
    return _mm(b, f"{pre}ffn_down{suffix}", g.glu("GLU", gate, up), scaled)


def _ffn_layer(b: Builder, il: int, x: Tensor) -> Tensor:
    """build_layer_ffn (qwen3next.cpp 565-625, qwen35.cpp 470-483, qwen35moe.cpp 494-547): qwen35's dense FFN, else
    softmax-routed experts with normalised weights (every qwen3next and qwen35moe layer has them: the loaders require
    `ffn_gate_inp`) and a shared expert gated by sigmoid(ffn_gate_inp_shexp · x)."""
    spec = b.spec
    pre = f"blk.{il}."
    if spec.arch == "qwen35":
        return _ffn(b, x, pre, "", scaled=True)
    cur = b.moe(x, il, SOFTMAX, norm_w=True, w_scale=spec.expert_weights_scale, scales=True)
    if pre + "ffn_up_shexp.weight" not in b.names:
        return cur
    shared = _ffn(b, x, pre, "_shexp", scaled=True)
    shared_gate = g.dup_op("UNARY", b.mm(pre + "ffn_gate_inp_shexp.weight", x))  # sigmoid, [1, T]
    return g.dup_op("ADD", cur, g.dup_op("MUL", shared, shared_gate))
