"""The transformer trunk shared by src/models/openai-moe.cpp (gpt-oss), qwen3moe.cpp, qwen2moe.cpp, qwen3.cpp,
llama.cpp (dense and Mixtral-style), deepseek2.cpp (MLA with absorption, K-only cache) and glm4-moe.cpp (sigmoid
routing, a shared expert, leading dense layers; its NextN block is not in the trunk's graph)."""

from __future__ import annotations

from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.builder import SIGMOID, SOFTMAX, SOFTMAX_WEIGHT, Builder
from fitter.memory.graph.families.mla import mla_attention

ARCHS = ("gpt-oss", "qwen3moe", "qwen2moe", "qwen3", "llama", "deepseek2", "glm4moe")


def build_transformer(b: Builder) -> None:
    """gpt-oss, qwen3moe, qwen2moe, qwen3, llama (dense and Mixtral-style), deepseek2 (MLA) and glm4moe."""
    spec = b.spec
    arch = spec.arch
    # glm4-moe.cpp 304-311: M-RoPE (ggml_rope_multi) where the file sets rope sections, with 4 positions per token
    b.inputs(n_pos=4 if arch == "glm4moe" and spec.use_mrope else 1)
    inp = b.embd
    last = spec.n_layer_trunk - 1  # a NextN block is not in the trunk's graph
    for il in range(spec.n_layer_trunk):
        pre = f"blk.{il}."
        inp_sa = inp
        cur = b.norm(inp, pre + "attn_norm.weight")
        if spec.is_mla:
            cur = mla_attention(b, il, cur)
        else:
            q, k, v = b.qkv(il, cur)
            cur = b.attention(il, q, k, v, b.w(pre + "attn_sinks.weight"))
            cur = b.add_bias(b.mm(pre + "attn_output.weight", cur), pre + "attn_output.bias")
        if il == last and arch != "gpt-oss":
            # the last layer only computes the rows that are output (build_inp_out_ids)
            cur = g.get_rows(cur, b.out_ids)
            inp_sa = g.get_rows(inp_sa, b.out_ids)
        ffn_inp = g.dup_op("ADD", cur, inp_sa)
        is_moe = pre + "ffn_gate_inp.weight" in b.names
        norm_name = pre + ("post_attention_norm.weight" if arch in ("gpt-oss", "glm4moe") else "ffn_norm.weight")
        cur = b.norm(ffn_inp, norm_name)
        if not is_moe:
            cur = b.ffn(cur, pre)
        elif arch == "gpt-oss":
            cur = b.moe(cur, il, SOFTMAX_WEIGHT, norm_w=False)
        elif arch in ("deepseek2", "glm4moe"):  # routed experts, then the shared expert on the same input
            normed = cur
            default = SIGMOID if arch == "glm4moe" else SOFTMAX  # glm4-moe.cpp: gating NONE means sigmoid
            cur = b.moe(cur, il, spec.expert_gating or default, spec.expert_weights_norm, spec.expert_weights_scale)
            cur = g.dup_op("ADD", cur, b.ffn(normed, pre, "_shexp"))
        else:
            normed = cur
            # qwen3moe and Mixtral-style llama normalise the top-k weights; qwen2moe does not
            cur = b.moe(cur, il, SOFTMAX, norm_w=arch != "qwen2moe")
            if pre + "ffn_up_shexp.weight" in b.names:  # qwen2moe's gated shared expert
                gate_inp = b.mm(pre + "ffn_gate_inp_shexp.weight", normed)
                gate = g.dup_op("DIV", g.dup_op("UNARY", gate_inp), gate_inp)
                shexp = g.dup_op("MUL", b.ffn(normed, pre, "_shexp"), gate)
                cur = g.dup_op("ADD", cur, shexp)
        cur = g.dup_op("ADD", cur, ffn_inp)
        inp = cur
    if arch == "gpt-oss":
        inp.is_output = True  # res->t_h_nextn: the last layer's output is kept (src/models/openai-moe.cpp)
    b.output(inp, rows_before=arch == "gpt-oss")
