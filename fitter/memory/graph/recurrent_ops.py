"""The ggml ops of recurrent layers, on fitter's shape-only tensors (fitter.memory.graph.ggml_graph): the short
convolution, the gated delta rule and the Mamba-2 selective scan that make new tensors, REPEAT, and the two ops whose
result is a view of their destination, so ggml-alloc gives them no memory: a copy into a state cache and the in-place
SCALE that clears a state.
Shapes and source orders as ggml/src/ggml.c (0c1e570) makes them.
"""

from __future__ import annotations

from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.ggml_graph import Tensor


def _view_node(dst: Tensor, op: str, src: tuple[Tensor, ...]) -> Tensor:
    """ggml_view_tensor(dst) made by `op`: dst's memory, nothing allocated."""
    root = dst.view_src if dst.view_src is not None else dst
    offs = dst.view_offs if dst.view_src is not None else 0
    return Tensor(dst.type, dst.ne, dst.nb, op, src, root, offs, name=dst.name)


def cpy(a: Tensor, b: Tensor) -> Tensor:
    """ggml_cpy(a, b): writes a into b; the result is a view of b (ggml_cpy_impl), sources (a, b)."""
    return _view_node(b, "CPY", (a, b))


def scale_inplace(a: Tensor) -> Tensor:
    """ggml_scale_inplace(a, s): a view of a (ggml_scale_impl with inplace)."""
    return _view_node(a, "SCALE", (a,))


def repeat(a: Tensor, *ne: int) -> Tensor:
    """ggml_repeat_4d(a, ne0, ne1, ne2, ne3): a new tensor of a's type."""
    return g.new(a.type, *ne, op="REPEAT", src=(a,))


def ssm_conv(sx: Tensor, c: Tensor) -> Tensor:
    """ggml_ssm_conv(sx [d_conv - 1 + n_t, d_inner, n_s], c [d_conv, d_inner]) → F32 [d_inner, n_t, n_s]."""
    n_t = sx.ne[0] - c.ne[0] + 1
    return g.new("F32", c.ne[1], n_t, sx.ne[2], op="SSM_CONV", src=(sx, c))


def gated_delta_net(q: Tensor, k: Tensor, v: Tensor, gate: Tensor, beta: Tensor, state: Tensor,
                    snapshots: int = 1) -> Tensor:
    """ggml_gated_delta_net(q, k, v, g, beta, state, K) → F32 [S_v * H, n_tokens * n_seqs + K * S_v * n_seqs]: the
    attention output, then K snapshots of the new state (v: [S_v, H, n_tokens, n_seqs])."""
    s_v, n_head, n_tokens, n_seqs = v.ne
    return g.new("F32", s_v * n_head, n_tokens * n_seqs + snapshots * s_v * n_seqs, op="GATED_DELTA_NET",
                 src=(q, k, v, gate, beta, state))


def ssm_scan(s: Tensor, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, ids: Tensor,
             snapshots: int = 1) -> Tensor:
    """ggml_ssm_scan(s, x, dt, A, B, C, ids, K) → F32 1-D [nelements(x) + K * s.ne0 * s.ne1 * s.ne2 * n_seqs]: y,
    then the new states (s: [d_state, head_dim, n_head, slots], ids: [n_seqs])."""
    n = x.ne[0] * x.ne[1] * x.ne[2] * x.ne[3] + snapshots * s.ne[0] * s.ne[1] * s.ne[2] * ids.ne[0]
    return g.new("F32", n, op="SSM_SCAN", src=(s, x, dt, a, b, c, ids))
