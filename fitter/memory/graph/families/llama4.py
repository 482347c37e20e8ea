"""Llama 4's graph: src/models/llama4.cpp (llama_model_llama4::graph, 104-268) in llama.cpp 0c1e570.

Chunked attention in 3 of each 4 layers (the iSWA cache pair; without it, `attention.sliding_window` = 0, one cache
and RoPE in every layer but the last), NoPE layers (every `n_no_rope_layer_step`-th: 4, or n_layer without chunks)
whose Q is scaled by the attention temperature input instead of rotated, an L2 norm of the rotated Q and K (unless
the model has 128 experts, `use_kq_norm`), dense and MoE layers interleaved (a layer routes where it has
`ffn_gate_inp`), and the MoE of build_moe_ffn's `weight_before_ffn` path beside an always-present shared expert.
"""

from __future__ import annotations

from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.builder import SIGMOID, Builder
from fitter.memory.graph.families.llama_like import attn_out, ffn_scaled, lm_head, moe_ffn, qkv_proj, rope_factors

ARCHS = ("llama4",)


def build_llama4(b: Builder) -> None:
    spec = b.spec
    b.inputs()
    # build_inp_attn_scale, always built (F32 [1, 1, T], llama-graph.cpp 2479-2492); only NoPE layers read it
    attn_scale = g.input_tensor("F32", 1, 1, b.T, name="inp_attn_scale")
    # llama4.cpp 8-11: `attention.sliding_window` = 0 turns chunking off and RoPE on in every layer but the last
    nope_step = spec.n_layer if spec.n_swa == 0 else 4
    use_kq_norm = spec.n_expert != 128  # LLM_TYPE_17B_128E (Maverick) has no L2 norm (llama4.cpp 41)
    inp, last = b.embd, spec.n_layer - 1
    for il in range(spec.n_layer):
        pre = f"blk.{il}."
        inp_sa = inp
        cur = b.norm(inp, pre + "attn_norm.weight")
        q, k, v = qkv_proj(b, il, cur)
        use_rope = (il + 1) % nope_step != 0
        if use_rope:
            freqs = rope_factors(b, il)
            q = g.dup_op("ROPE", q, b.pos, freqs)
            k = g.dup_op("ROPE", k, b.pos, freqs)
        else:
            q = g.dup_op("MUL", q, attn_scale)
        if use_rope and use_kq_norm:  # Llama4TextL2Norm: ggml_rms_norm without a weight (not pinned)
            q = b.norm(q, None)
            k = b.norm(k, None)
        cur = attn_out(b, il, q, k, v)
        if il == last:
            cur, inp_sa = g.get_rows(cur, b.out_ids), g.get_rows(inp_sa, b.out_ids)
        ffn_inp = g.dup_op("ADD", cur, inp_sa)
        cur = b.norm(ffn_inp, pre + "ffn_norm.weight")
        if pre + "ffn_gate_inp.weight" not in b.names:
            cur = ffn_scaled(b, cur, pre, biases=True)
        else:
            normed = cur
            routed = moe_ffn(b, normed, il, SIGMOID, False, spec.expert_weights_scale, weight_before_ffn=True)
            cur = g.dup_op("ADD", routed, ffn_scaled(b, normed, pre, "_shexp"))
        inp = g.dup_op("ADD", cur, ffn_inp)
    lm_head(b, inp)
