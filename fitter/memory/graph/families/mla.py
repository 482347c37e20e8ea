"""DeepSeek's multi-head latent attention (src/models/deepseek2.cpp with absorption, `build_attn` for
llm_graph_input_attn_k): absorbed queries over a K-only cache whose first kv_lora_rank values are V."""

from __future__ import annotations

from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.builder import Builder, block_bytes
from fitter.memory.graph.ggml_graph import Tensor


def mla_attention(b: Builder, il: int, x: Tensor) -> Tensor:
    """deepseek2 with MLA: absorbed queries over a K-only cache whose first kv_lora_rank values are V
    (src/models/deepseek2.cpp, build_attn for llm_graph_input_attn_k)."""
    spec, p = b.spec, b.p
    pre = f"blk.{il}."
    T, n_head = x.ne[1], spec.n_head[il]
    rope, kv_lora = spec.n_rot, spec.kv_lora_rank
    nope = spec.head_dim_k_mla - rope
    if pre + "attn_q.weight" in b.names:
        q = b.mm(pre + "attn_q.weight", x)
    else:
        q = b.norm(b.mm(pre + "attn_q_a.weight", x), pre + "attn_q_a_norm.weight")
        q = b.mm(pre + "attn_q_b.weight", q)
    q = g.reshape(q, spec.head_dim_k_mla, n_head, T)
    kv_pe = b.mm(pre + "attn_kv_a_mqa.weight", x)
    row = kv_pe.nb[1]
    kv_cmpr = g.view(kv_pe, (kv_lora, T), (row,))
    k_pe = g.view(kv_pe, (rope, 1, T), (row, row), kv_lora * kv_pe.nb[0])
    k_pe = g.dup_op("ROPE", k_pe, b.pos)
    kv_cmpr = b.norm(kv_cmpr, pre + "attn_kv_a_norm.weight")
    q_nope = g.view(q, (nope, n_head, T), (q.nb[1], q.nb[2]))
    q_pe = g.view(q, (rope, n_head, T), (q.nb[1], q.nb[2]), nope * q.nb[0])
    q_pe = g.dup_op("ROPE", q_pe, b.pos)
    q_abs = g.mul_mat(b.weight(pre + "attn_k_b.weight"), g.permute(q_nope, 0, 2, 1, 3))
    q_cur = g.concat(g.permute(q_abs, 0, 2, 1, 3), q_pe)
    kv_cmpr = g.reshape(kv_cmpr, kv_lora, 1, T)
    k_cur = g.concat(kv_cmpr, k_pe)
    v_cur = kv_cmpr
    for t in (q_cur, v_cur, k_cur):
        b.gf.expand(t)
    k_idxs, _, mask = b.kv_inputs[False]
    k_cache = b.kv_tensor(il, "k")
    n_stream = p.n_stream
    k2 = g.view(k_cur, (k_cur.ne[0] * k_cur.ne[1], k_cur.ne[2]), (k_cur.nb[2],))
    k_dst = g.reshape(k_cache, k_cache.ne[0], k_cache.ne[1] * n_stream) if n_stream > 1 else k_cache
    b.gf.expand(g.set_rows(k_dst, k2, k_idxs))
    n_kv = k_cache.ne[1]
    kb = g.type_size(k_cache.type)
    width = k_cache.ne[0]
    k_view = g.view(k_cache, (width, 1, n_kv, n_stream),
                    (block_bytes(kb, width), block_bytes(kb, width), block_bytes(kb, width * n_kv)))
    v_view = g.view(k_view, (kv_lora, 1, n_kv, n_stream), (k_view.nb[1], k_view.nb[2], k_view.nb[3]))
    q4 = g.view(q_cur, (q_cur.ne[0], q_cur.ne[1], T // n_stream, n_stream),
                (q_cur.nb[1], q_cur.nb[2], q_cur.nb[2] * (T // n_stream)))
    qp, kp, vp = g.permute(q4, 0, 2, 1, 3), g.permute(k_view, 0, 2, 1, 3), g.permute(v_view, 0, 2, 1, 3)
    v_mla = b.weight(pre + "attn_v_b.weight")
    if p.flash_attn:
        cur = g.flash_attn_ext(qp, kp, vp, mask, None)
        cur.name = f"fa-{il}"
        cur = g.mul_mat(v_mla, g.permute(cur, 0, 2, 1, 3))
        cur = g.cont(g.permute(cur, 0, 2, 1, 3))
        cur = g.reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
    else:
        kq = g.dup_op("SOFT_MAX", g.mul_mat(kp, qp), mask)
        v_t = g.cont(g.transpose(vp))  # "avoid this branch": V is not stored transposed under MLA
        kqv = g.mul_mat(v_mla, g.mul_mat(v_t, kq))
        cur = g.permute(kqv, 0, 2, 1, 3)
        cur = g.cont(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        b.kv_pins.append(cur)
    b.gf.expand(cur)
    return b.mm(pre + "attn_output.weight", cur)

