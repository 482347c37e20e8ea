"""Nemotron-H: src/models/nemotron-h.cpp of llama.cpp 0c1e570 over the hybrid memory (`build_inp_mem_hybrid`), its
Mamba-2 layers as src/models/mamba-base.cpp `build_mamba2_layer` builds them. A layer is a Mamba-2 mixer (no KV
heads and no FFN), attention without RoPE (KV heads, no FFN) or an FFN (ReLU², or experts); each adds its input back.
With `cparams.embeddings_nextn_masked` false the last layer runs on every token and the output rows are taken after
the output norm (kept as t_h_nextn).
"""

from __future__ import annotations

from fitter.errors import GGUFError
from fitter.gguf.model_spec import ModelSpec
from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.builder import Builder
from fitter.memory.graph.families.classic import build_norm
from fitter.memory.graph.families.delta_net import StateInput
from fitter.memory.graph.families.llama_like import attn_out, lora_mm, qkv_proj
from fitter.memory.graph.ggml_graph import Tensor
from fitter.memory.graph.recurrent_ops import cpy, ssm_conv, ssm_scan

ARCHS = ("nemotron_h",)


def rebuilt(spec: ModelSpec) -> bool:
    """Whether this graph covers the file: not where a layer routes experts (nemotron-h.cpp 136-175's latent
    projections and ReLU² experts are not rebuilt here; such a file's compute comes from llama.cpp's projection)."""
    return not any(t.name.endswith("ffn_gate_inp.weight") for t in spec.tensors)
F32 = 4


def mamba2(b: Builder, rs: StateInput, il: int, cur: Tensor) -> Tensor:
    """build_mamba2_layer (mamba-base.cpp 153-300) without rollback snapshots (cparams.n_rs_seq 0): the conv state
    before the projected xBC, its last columns copied back, SSM_CONV + bias + SiLU, SSM_SCAN over the gathered states
    (build_rs with get_ssm_rows), the new states copied back, y + x·D, SwiGLU with z, the grouped RMS norm, ssm_out."""
    spec, pre = b.spec, f"blk.{il}."
    d_conv, d_inner, d_state = spec.ssm_d_conv, spec.ssm_d_inner, spec.ssm_d_state
    n_head, n_group, ns = spec.ssm_dt_rank, spec.ssm_n_group, rs.n_seqs
    head_dim, nst = d_inner // n_head, cur.ne[1] // ns
    ch = d_inner + 2 * n_group * d_state
    conv_states_all = rs.cache(b, il, spec.n_embd_r)
    ssm_states_all = rs.cache(b, il, spec.n_embd_s)
    slots = ssm_states_all.ne[1]
    conv = g.reshape(rs.read(b, conv_states_all, spec.n_embd_r), d_conv - 1, ch, ns)
    zx = lora_mm(b, pre + "ssm_in.weight", cur, pre + "ssm_in.scale")
    zx = g.reshape(zx, zx.ne[0], nst, ns)
    z = g.view(zx, (head_dim, n_head, nst, ns), (head_dim * F32, zx.nb[1], zx.nb[2]))
    xbc = g.view(zx, (ch, nst, ns), (zx.nb[1], zx.nb[2]), d_inner * F32)
    dt = g.view(zx, (n_head, nst, ns), (zx.nb[1], zx.nb[2]), (2 * d_inner + 2 * n_group * d_state) * F32)
    conv_x = g.concat(conv, g.transpose(xbc))
    last = g.view(conv_x, (d_conv - 1, ch, ns), (conv_x.nb[1], conv_x.nb[2]), nst * conv_x.nb[0])
    b.gf.expand(cpy(last, g.view(conv_states_all, ((d_conv - 1) * ch, ns), (conv_states_all.nb[1],))))
    xbc = ssm_conv(conv_x, b.weight(pre + "ssm_conv1d.weight"))
    xbc = g.dup_op("UNARY", b.add_bias(xbc, pre + "ssm_conv1d.bias"))  # silu
    x = g.view(xbc, (head_dim, n_head, nst, ns), (head_dim * F32, xbc.nb[1], xbc.nb[2]))
    bb = g.view(xbc, (d_state, n_group, nst, ns), (d_state * F32, xbc.nb[1], xbc.nb[2]), d_inner * F32)
    cc = g.view(xbc, (d_state, n_group, nst, ns), (d_state * F32, xbc.nb[1], xbc.nb[2]),
                (d_inner + n_group * d_state) * F32)
    dt = b.add_bias(g.cont(dt), pre + "ssm_dt.bias")
    a = b.weight(pre + "ssm_a")

    def rows(states: Tensor, ids: Tensor) -> Tensor:
        return ssm_scan(g.reshape(states, d_state, head_dim, n_head, slots), x, dt, a, bb, cc, ids)

    y_ssm = rs.read(b, ssm_states_all, spec.n_embd_s, rows)
    dd = d_state * d_inner
    x_bytes = head_dim * n_head * nst * ns * F32
    new_states = g.view(y_ssm, (dd, ns, 1), (dd * F32, dd * F32 * ns), x_bytes)
    b.gf.expand(cpy(new_states, g.view(ssm_states_all, (dd, ns, 1), (ssm_states_all.nb[1], slots * dd * F32))))
    y = g.view(y_ssm, (head_dim, n_head, nst, ns), (x.nb[1], n_head * x.nb[1], nst * n_head * x.nb[1]))
    y = g.dup_op("ADD", y, g.dup_op("MUL", x, b.weight(pre + "ssm_d")))
    y = g.glu("GLU", g.cont(z), y)  # ggml_swiglu_split
    if pre + "ssm_norm.weight" in b.names:
        y = build_norm(b, g.reshape(y, d_inner // n_group, n_group, nst, ns), pre + "ssm_norm.weight", il)
    y = g.reshape(y, d_inner, nst * ns)
    return lora_mm(b, pre + "ssm_out.weight", y, pre + "ssm_out.scale")


def ffn(b: Builder, il: int, cur: Tensor) -> Tensor:
    """build_ffn_layer's dense path (nemotron-h.cpp 126-135): up (+ bias, × scale), ReLU, SQR, down (+ bias,
    × scale)."""
    pre = f"blk.{il}."

    def proj(kind: str, src: Tensor) -> Tensor:
        out = b.add_bias(b.mm(f"{pre}ffn_{kind}.weight", src), f"{pre}ffn_{kind}.bias")
        s = b.w(f"{pre}ffn_{kind}.scale")
        return g.dup_op("MUL", out, s) if s is not None else out

    return proj("down", g.dup_op("SQR", g.dup_op("UNARY", proj("up", cur))))


def build_nemotron_h(b: Builder) -> None:
    """llama_model_nemotron_h::graph (nemotron-h.cpp 9-90): per layer the RMS norm, then a Mamba-2 mixer, attention
    (no RoPE, wo with bias and scale) or the FFN, the residual; the output norm over every token, then its rows."""
    spec = b.spec
    b.inputs()
    rs = StateInput(b)
    inp = b.embd
    for il in range(spec.n_layer):
        pre = f"blk.{il}."
        cur = build_norm(b, inp, pre + "attn_norm.weight", il)
        if spec.recurrent_layers[il]:
            cur = mamba2(b, rs, il, cur)
        elif spec.n_ff[il] == 0:
            q, k, v = qkv_proj(b, il, cur)
            cur = attn_out(b, il, q, k, v)
        elif pre + "ffn_gate_inp.weight" in b.names:  # the expert path (nemotron-h.cpp 136-175) is not rebuilt
            raise GGUFError(f"{spec.path}: layer {il} routes experts, which fitter's nemotron_h graph does not "
                            "rebuild (llama.cpp's build_ffn_layer MoE path: latent projections, ReLU² experts)")
        else:
            cur = ffn(b, il, cur)
        inp = g.dup_op("ADD", cur, inp)
    h = build_norm(b, inp, "output_norm.weight", -1)
    h.is_output = True  # res->t_h_nextn
    embd = g.get_rows(h, b.out_ids)
    embd.is_output = True  # res->t_embd
    out_w = "output.weight" if "output.weight" in b.names else "token_embd.weight"
    logits = lora_mm(b, out_w, embd, "output.scale")
    logits.is_output = True
    b.gf.expand(logits)
