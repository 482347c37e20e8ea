"""The building blocks of llama.cpp's worst-case prompt graph, shared by every family's builder
(fitter.memory.graph.families): the inputs, norms, Q/K/V, attention over the KV cache, the FFN, the MoE FFN and the
output head, node for node as src/llama-graph.cpp (`build_inp_embd`, `build_norm`, `build_qkv`, `build_attn`,
`build_attn_mha`, `build_ffn`, `build_moe_ffn`) and src/llama-kv-cache.cpp (`cpy_k`, `cpy_v`, `get_k`, `get_v`, the
K/V Hadamard rotation of quantized caches) build them in llama.cpp 0c1e570. Weight tensors only lend their shapes;
the KV cache is memory of its own. `sched_reserve` (src/llama-context.cpp) builds the graph with n_tokens =
min(n_ctx, n_ubatch), n_outputs = min(n_tokens, n_outputs_max) and every KV cell visible.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fitter.errors import GGUFError
from fitter.flags import KV_CACHE_TYPES
from fitter.gguf.model_spec import ModelSpec
from fitter.memory.graph import ggml_graph as g
from fitter.memory.graph.ggml_graph import Graph, Tensor
from fitter.memory.graph.op_rules import OpRules
from fitter.memory.graph.recurrent_ops import repeat

# The output layer's copy of token_embd that llama.cpp makes for a model without output.weight (TENSOR_DUPLICATED,
# src/llama-model-loader.cpp): its own weight, in the output layer's buffer, unless that is token_embd's own
TIED_OUTPUT = "output.weight (tied token_embd)"


@dataclass(frozen=True)
class BackendMap:
    """Where tensors live, as ggml_backend_sched backend indices: devices first, the CPU last."""

    n_backends: int = 1
    weight_backend: Mapping[str, int] = field(default_factory=dict)  # tensor name → backend; missing = CPU
    layer_backend: tuple[int, ...] = ()  # per layer; empty = all on the CPU
    kv_on_cpu: bool = False  # -nkvo
    full_offload: bool = False  # every layer and the output on devices (llama_context::graph_get_cb)
    # per device backend: the batch from which it takes ops with host weights over (None: never; op offload off
    # or a backend without it), and which ops it runs and the bytes it gives a tensor (fitter.memory.graph.op_rules)
    offload_min_batch: tuple[int | None, ...] = ()
    ops: tuple[OpRules, ...] = ()
    n_copies: int = 1  # the scheduler's input copies: GGML_SCHED_MAX_COPIES (4) with pipeline parallelism

    @property
    def cpu(self) -> int:
        return self.n_backends - 1

    def layer(self, il: int) -> int:
        return self.layer_backend[il] if self.layer_backend else self.cpu


@dataclass(frozen=True)
class GraphParams:
    n_tokens: int
    n_outputs: int
    n_kv: tuple[int, int]  # cells per stream: full-attention cache, sliding-window cache
    n_stream: int
    flash_attn: bool
    type_k: str
    type_v: str
    backends: BackendMap = field(default_factory=BackendMap)
    v_trans: bool | None = None  # V cache transposed; None: as flash attention implies
    # the ubatch's sequences (llama_context::graph_reserve: n_seq_max for every graph it reserves): a recurrent
    # layer's states and its tokens per sequence, n_tokens / n_seqs
    n_seqs: int = 1


class Builder:
    def __init__(self, spec: ModelSpec, p: GraphParams) -> None:
        self.spec, self.p = spec, p
        self.gf = Graph()
        self.names = {t.name for t in spec.tensors}
        self.shapes = {t.name: t for t in spec.tensors}
        self.T = p.n_tokens
        self.v_trans = (not p.flash_attn) if p.v_trans is None else p.v_trans
        self.v_width = max(spec.n_embd_v_gqa(il) for il in range(spec.n_layer))
        # Every tensor whose backend comes from p.backends, so a built graph can be bound to another placement
        self.weights: list[tuple[Tensor, str]] = []
        self.kv: list[tuple[Tensor, int]] = []  # with its layer
        self.norm_pins: list[tuple[Tensor, int]] = []  # a layer's norm, pinned for small batches or full offload
        self.kv_pins: list[Tensor] = []  # attention outputs, pinned to the CPU with -nkvo
        # a weight llama.cpp creates once per buffer type of the layers that read it (TENSOR_DUPLICATED), with the
        # layer that reads it; its readers as built (node, source index, that layer's tensor), found on first bind
        self.layer_weights: list[tuple[Tensor, int]] = []
        self._layer_reads: list[tuple[Tensor, int, Tensor]] | None = None

    def bind(self, bm: BackendMap) -> None:
        """Give every weight, cache and pinned node its backend under this placement."""
        cpu, weight_backend = bm.cpu, bm.weight_backend
        # a tied output placed in token_embd's buffer type is token_embd itself (the placement leaves it out)
        tied = weight_backend.get(TIED_OUTPUT, weight_backend.get("token_embd.weight", cpu))
        for t, name in self.weights:
            t.backend = tied if name == TIED_OUTPUT else weight_backend.get(name, cpu)
        for t, il in self.kv:
            t.backend = cpu if bm.kv_on_cpu else bm.layer(il)
        if self.layer_weights:
            self._bind_layer_weights(bm)
        # graph_get_cb pins each layer's "norm" to the layer's device for small batches or full offload
        pin_norms = self.T < 32 or bm.full_offload
        for t, il in self.norm_pins:
            t.pinned = bm.layer(il) if pin_norms else -1
        # with -nkvo, "all nodes between the KV store and the attention output" run on the CPU
        for t in self.kv_pins:
            t.pinned = cpu if bm.kv_on_cpu else -1

    def _bind_layer_weights(self, bm: BackendMap) -> None:
        """Layers on one backend read one tensor: llama_model_loader::create_tensor returns the copy already in the
        layer's buffer type context (one buffer type per backend here), so its copy into another backend's split is
        made once and stays alive to the last reader, as in llama.cpp."""
        if self._layer_reads is None:
            own = {id(t) for t, _ in self.layer_weights}
            self._layer_reads = [(node, j, s) for node in self.gf.nodes for j, s in enumerate(node.src)
                                 if s is not None and id(s) in own]
        first: dict[tuple[str, int], Tensor] = {}
        shared: dict[int, Tensor] = {}
        for t, il in self.layer_weights:
            t.backend = bm.layer(il)
            shared[id(t)] = first.setdefault((t.name, t.backend), t)
        for node, j, orig in self._layer_reads:
            node.src = (*node.src[:j], shared[id(orig)], *node.src[j + 1:])

    # --- tensors that exist outside the compute buffer ---

    def w(self, name: str) -> Tensor | None:
        t = self.shapes.get(name)
        if t is None:
            return None
        out = g.data_tensor(t.type, *t.ne, name=name)
        self.weights.append((out, name))
        return out

    def weight(self, name: str) -> Tensor:
        t = self.w(name)
        if t is None:  # a tensor table renamed or cut short: llama.cpp's create_tensor fails the same way
            raise GGUFError(f"{self.spec.path}: missing tensor {name!r}, which llama.cpp's {self.spec.arch} graph "
                            "needs (llama_model_loader: missing tensor)")
        return t

    def output_weight(self) -> Tensor:
        """The lm_head's weight: output.weight, else the output layer's copy of token_embd (TIED_OUTPUT)."""
        if "output.weight" in self.names:
            return self.weight("output.weight")
        t = self.weight("token_embd.weight")
        self.weights[-1] = (t, TIED_OUTPUT)
        return t
    def layer_weight(self, name: str, il: int) -> Tensor | None:
        """A weight llama.cpp creates in every layer's buffer type (TENSOR_DUPLICATED: `rope_freqs`): layer il reads
        the copy on its own device, the one every layer there reads (bind)."""
        t = self.shapes.get(name)
        if t is None:
            return None
        out = g.data_tensor(t.type, *t.ne, name=name)
        self.layer_weights.append((out, il))
        return out

    def kv_tensor(self, il: int, kind: str) -> Tensor:
        """The layer's K or V cache as llama_kv_cache allocates it: {width, cells, streams}."""
        spec, p = self.spec, self.p
        cells = p.n_kv[1] if spec.swa_layers[il] else p.n_kv[0]
        if kind == "k":
            out = g.data_tensor(_kv(p.type_k), spec.n_embd_k_gqa(il), cells, p.n_stream, weight=False)
        else:
            width = self.v_width if self.v_trans else spec.n_embd_v_gqa(il)
            out = g.data_tensor(_kv(p.type_v), width, cells, p.n_stream, weight=False)
        self.kv.append((out, il))
        return out

    # --- inputs (src/llama-graph.cpp, src/llama-kv-cache.cpp) ---

    def inputs(self, n_pos: int = 1, n_embd_inp: int = 0) -> None:
        """build_inp_embd, build_inp_pos, build_inp_out_ids and the KV cache's inputs. `n_pos`: positions per token
        (llama_hparams::n_pos_per_embd, 4 for M-RoPE); `n_embd_inp`: an input wider than n_embd (deepstack, where
        the token path is PADded to it and the embeddings are a view of its first n_embd; `self.inp_embd` keeps
        the wide tensor, res->t_inp_embd)."""
        spec, p, T = self.spec, self.p, self.T
        n_embd_inp = max(n_embd_inp, spec.n_embd)
        tokens = g.input_tensor("I32", T, name="inp_tokens")
        inp_embd = g.input_tensor("F32", n_embd_inp, T, name="inp_embd")
        embd = g.get_rows(self.weight("token_embd.weight"), tokens)
        if n_embd_inp != spec.n_embd:
            embd = g.new(embd.type, n_embd_inp, T, op="PAD", src=(embd,))
        # ggml_build_forward_select adds both the token path and the (unused) embeddings input
        self.gf.expand(embd)
        self.gf.expand(inp_embd)
        if n_embd_inp != spec.n_embd:
            embd = self.gf.expand(g.view(embd, (spec.n_embd, T), (embd.nb[1],)))
        self.embd = self.inp_embd = embd
        self.pos = g.input_tensor("I32", T * n_pos, name="inp_pos")
        self.out_ids = g.input_tensor("I32", p.n_outputs, name="out_ids")
        self.kv_inputs: dict[bool, tuple[Tensor, Tensor, Tensor]] = {}
        for is_swa in sorted(set(spec.swa_layers)):
            n_kv = p.n_kv[1] if is_swa else p.n_kv[0]
            k_idxs = g.input_tensor("I64", T, name="attn_inp_k_idxs")
            v_idxs = g.input_tensor("I64", T * (self.v_width if self.v_trans else 1), name="attn_inp_v_idxs")
            mask = g.input_tensor("F16" if p.flash_attn else "F32", n_kv, T // p.n_stream, 1, p.n_stream,
                                  name="attn_inp_kq_mask")
            self.kv_inputs[is_swa] = (k_idxs, v_idxs, mask)
        # one rotation input per KV cache (the full-attention and the sliding-window cache each build their own)
        self.k_rot: dict[bool, Tensor] = {}
        self.v_rot: dict[bool, Tensor] = {}
        # llama_kv_cache: quantized caches rotate K/V with a Hadamard matrix when heads are multiples of 64
        # a head size of 0 (a broken header) is no multiple: every power of two divides it, so the loop would not end
        if _quantized(p.type_k) and spec.head_dim_k > 0 and spec.head_dim_k % 64 == 0:
            nrot = 64
            while spec.head_dim_k % (nrot * 2) == 0:
                nrot *= 2
            for is_swa in self.kv_inputs:
                self.k_rot[is_swa] = g.input_tensor("F32", nrot, nrot, name="attn_inp_k_rot")
        if _quantized(p.type_v) and spec.head_dim_v % 64 == 0:
            for is_swa in self.kv_inputs:
                self.v_rot[is_swa] = g.input_tensor("F32", 64, 64, name="attn_inp_v_rot")

    # --- building blocks ---

    def norm(self, x: Tensor, weight: str | None) -> Tensor:
        cur = g.dup_op("RMS_NORM", x)
        if weight and weight.startswith("blk."):
            self.norm_pins.append((cur, int(weight.split(".")[1])))
        w = self.w(weight) if weight else None
        if w is not None:
            cur = g.dup_op("MUL", cur, w)
        return cur

    def mm(self, weight: str, x: Tensor) -> Tensor:
        return g.mul_mat(self.weight(weight), x)

    def add_bias(self, x: Tensor, name: str) -> Tensor:
        b = self.w(name)
        return g.dup_op("ADD", x, b) if b is not None else x

    def hadamard(self, cur: Tensor, rot: Tensor) -> Tensor:
        n = rot.ne[0]
        n_el = cur.ne[0] * cur.ne[1] * cur.ne[2] * cur.ne[3]
        contiguous = cur.nb == g.contiguous_strides(cur.type, cur.ne)
        res = g.reshape(cur, n, n_el // n) if contiguous else g.cont(cur, n, n_el // n)
        res = g.mul_mat(rot, res)
        return g.reshape(res, *cur.ne)

    def attention(self, il: int, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, softcap: bool = False,
                  iswa: bool | None = None) -> Tensor:
        """build_attn + build_attn_mha for a KV cache (the iSWA variant when the model has SWA layers, or when
        `iswa` says the architecture builds over llama_kv_cache_iswa anyway). `softcap`: hparams.attn_soft_cap
        (gemma2), which without flash attention scales, tanh-squashes and rescales KQ before the softmax
        (src/llama-graph.cpp build_attn_mha, 2708-2715); with flash attention it is an op parameter."""
        spec, p = self.spec, self.p
        if iswa is None:
            iswa = any(spec.swa_layers)
        k_rot, v_rot = self.k_rot.get(spec.swa_layers[il]), self.v_rot.get(spec.swa_layers[il])
        if k_rot is not None:
            q = self.hadamard(q, k_rot)
            k = self.hadamard(k, k_rot)
        if v_rot is not None:
            v = self.hadamard(v, v_rot)
        for t in (q, k, v) if iswa else (q, v, k):
            self.gf.expand(t)
        k_idxs, v_idxs, mask = self.kv_inputs[spec.swa_layers[il]]
        k_cache, v_cache = self.kv_tensor(il, "k"), self.kv_tensor(il, "v")
        n_stream = p.n_stream
        # cpy_k / cpy_v: set_rows into views of the cache
        k2 = g.view(k, (k.ne[0] * k.ne[1], k.ne[2]), (k.nb[2],))
        k_dst = g.reshape(k_cache, k_cache.ne[0], k_cache.ne[1] * n_stream) if n_stream > 1 else k_cache
        self.gf.expand(g.set_rows(k_dst, k2, k_idxs))
        if not self.v_trans:
            v2 = g.view(v, (v.ne[0] * v.ne[1], v.ne[2]), (v.nb[2],))
            v_dst = g.reshape(v_cache, v_cache.ne[0], v_cache.ne[1] * n_stream) if n_stream > 1 else v_cache
            self.gf.expand(g.set_rows(v_dst, v2, v_idxs))
        else:
            width = v.ne[0] * v.ne[1]
            contiguous = v.nb[2] == g.contiguous_strides(v.type, v.ne)[2] and v.nb[1] == v.ne[0] * v.nb[0]
            v2 = g.reshape(v, width, v.ne[2]) if contiguous else g.cont(v, width, v.ne[2])
            if width < v_cache.ne[0]:
                v2 = g.new(v2.type, v_cache.ne[0], v2.ne[1], op="PAD", src=(v2,))
            v_view = g.reshape(v_cache, 1, v_cache.ne[0] * v_cache.ne[1] * v_cache.ne[2])
            v2 = g.reshape(v2, 1, v2.ne[0] * v2.ne[1])
            self.gf.expand(g.set_rows(v_view, v2, v_idxs))
        n_kv = k_cache.ne[1]
        head_k, n_head_kv, head_v = spec.head_dim_k, spec.n_head_kv[il], spec.head_dim_v
        kb = g.type_size(k_cache.type)
        k_view = g.view(k_cache, (head_k, n_head_kv, n_kv, n_stream),
                        (block_bytes(kb, head_k), block_bytes(kb, k_cache.ne[0]),
                         block_bytes(kb, k_cache.ne[0] * n_kv)))
        vb = g.type_size(v_cache.type)
        if not self.v_trans:
            v_view = g.view(v_cache, (head_v, n_head_kv, n_kv, n_stream),
                            (block_bytes(vb, head_v), block_bytes(vb, v_cache.ne[0]),
                             block_bytes(vb, v_cache.ne[0] * n_kv)))
        else:
            v_view = g.view(v_cache, (n_kv, n_head_kv, head_v, n_stream),
                            (block_bytes(vb, n_kv * head_v), block_bytes(vb, n_kv),
                             block_bytes(vb, n_kv * v_cache.ne[0])))
        # build_attn_mha
        q4 = g.view(q, (q.ne[0], q.ne[1], q.ne[2] // n_stream, n_stream),
                    (q.nb[1], q.nb[2], q.nb[2] * (q.ne[2] // n_stream)))
        qp = g.permute(q4, 0, 2, 1, 3)
        kp = g.permute(k_view, 0, 2, 1, 3)
        vp = g.permute(v_view, 0, 2, 1, 3)
        if p.flash_attn:
            if self.v_trans:
                vp = g.transpose(vp)
            cur = g.flash_attn_ext(qp, kp, vp, mask, sinks)
            cur.name = f"fa-{il}"
            cur = g.reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        else:
            kq = g.mul_mat(kp, qp)
            if softcap:  # ggml_scale(1/c), ggml_tanh, ggml_scale(c)
                kq = g.dup_op("SCALE", g.dup_op("UNARY", g.dup_op("SCALE", kq)))
            kq = g.dup_op("SOFT_MAX", kq, mask, sinks)
            if not self.v_trans:  # a cache made for flash attention, used without it ("avoid this branch")
                vp = g.cont(g.transpose(vp))
            kqv = g.mul_mat(vp, kq)
            cur = g.permute(kqv, 0, 2, 1, 3)
            cur = g.cont(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
            self.kv_pins.append(cur)
        self.gf.expand(cur)
        if v_rot is not None:
            cur = self.hadamard(cur, v_rot)
        return cur

    def qkv(self, il: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """build_qkv, separate Q/K/V weights with optional biases, reshaped to heads."""
        spec = self.spec
        pre = f"blk.{il}."
        q = self.add_bias(self.mm(pre + "attn_q.weight", x), pre + "attn_q.bias")
        k = self.add_bias(self.mm(pre + "attn_k.weight", x), pre + "attn_k.bias")
        v = self.add_bias(self.mm(pre + "attn_v.weight", x), pre + "attn_v.bias")
        T = x.ne[1]
        q = g.reshape(q, spec.head_dim_k, spec.n_head[il], T)
        k = g.reshape(k, spec.head_dim_k, spec.n_head_kv[il], T)
        v = g.reshape(v, spec.head_dim_v, spec.n_head_kv[il], T)
        if pre + "attn_q_norm.weight" in self.names:  # qwen3, qwen3moe
            q = self.norm(q, pre + "attn_q_norm.weight")
        q = g.dup_op("ROPE", q, self.pos)
        if pre + "attn_k_norm.weight" in self.names:
            k = self.norm(k, pre + "attn_k_norm.weight")
        k = g.dup_op("ROPE", k, self.pos)
        return q, k, v

    def ffn(self, x: Tensor, pre: str, suffix: str = "") -> Tensor:
        """build_ffn with SiLU and a parallel gate (LLM_FFN_SILU, LLM_FFN_PAR)."""
        up = self.mm(f"{pre}ffn_up{suffix}.weight", x)
        gate = self.mm(f"{pre}ffn_gate{suffix}.weight", x)
        cur = g.glu("GLU", gate, up)
        return self.mm(f"{pre}ffn_down{suffix}.weight", cur)

    def moe(self, x: Tensor, il: int, gating: int, norm_w: bool, w_scale: float = 0.0, scales: bool = False
            ) -> Tensor:
        """build_moe_ffn; gating is llama_expert_gating_func_type (1 softmax, 2 sigmoid, 3 softmax_weight);
        `scales`: the architecture passes the experts' per-expert `.scale` tensors (see `exps_scale`)."""
        spec = self.spec
        pre = f"blk.{il}."
        T = x.ne[1]
        k = spec.n_expert_used
        logits = self.add_bias(self.mm(pre + "ffn_gate_inp.weight", x), pre + "ffn_gate_inp.bias")
        probs = logits  # SOFTMAX_WEIGHT: the softmax comes after the top-k
        if gating != SOFTMAX_WEIGHT:
            probs = g.dup_op("SOFT_MAX" if gating == SOFTMAX else "UNARY", logits)
        selection = probs
        probs_b = self.w(pre + "exp_probs_b.bias")
        if probs_b is not None:  # DeepSeek V3 selection bias
            selection = g.dup_op("ADD", probs, probs_b)
        selected = g.argsort_top_k(selection, k)
        probs3 = g.reshape(probs, 1, spec.n_expert, T)
        weights = g.get_rows(probs3, selected)
        if gating == SOFTMAX_WEIGHT:
            weights = g.reshape(g.dup_op("SOFT_MAX", g.reshape(weights, k, T)), 1, k, T)
        if norm_w:
            w2 = g.reshape(weights, k, T)
            wsum = g.clamp(g.sum_rows(w2))
            weights = g.reshape(g.dup_op("DIV", w2, wsum), 1, k, T)
        if w_scale not in (0.0, 1.0):
            weights = g.dup_op("SCALE", weights)
        self.gf.expand(weights)
        cur = g.reshape(x, spec.n_embd, 1, T)
        ids = selected
        merged = self.w(pre + "ffn_gate_up_exps.weight")
        if merged is not None:  # the merged path: one mul_mat_id, then gate and up as views of it
            gate_up = g.mul_mat_id(merged, cur, ids)
            n_ff = gate_up.ne[0] // 2
            gate = g.view(gate_up, (n_ff, gate_up.ne[1], gate_up.ne[2]), (gate_up.nb[1], gate_up.nb[2]))
            up = g.view(gate_up, (n_ff, gate_up.ne[1], gate_up.ne[2]), (gate_up.nb[1], gate_up.nb[2]),
                        n_ff * gate_up.nb[0])
        else:
            up = g.mul_mat_id(self.weight(pre + "ffn_up_exps.weight"), cur, ids)
            up = self.exps_scale(up, pre + "ffn_up_exps.scale", ids, T) if scales else up
            up_b = self.w(pre + "ffn_up_exps.bias")
            if up_b is not None:
                up = g.dup_op("ADD_ID", up, up_b, ids)
            gate = g.mul_mat_id(self.weight(pre + "ffn_gate_exps.weight"), cur, ids)
            gate = self.exps_scale(gate, pre + "ffn_gate_exps.scale", ids, T) if scales else gate
            gate_b = self.w(pre + "ffn_gate_exps.bias")
            if gate_b is not None:
                gate = g.dup_op("ADD_ID", gate, gate_b, ids)
        act = g.glu("GLU", gate, up)
        experts = g.mul_mat_id(self.weight(pre + "ffn_down_exps.weight"), act, ids)
        experts = self.exps_scale(experts, pre + "ffn_down_exps.scale", ids, T) if scales else experts
        down_b = self.w(pre + "ffn_down_exps.bias")
        if down_b is not None:
            experts = g.dup_op("ADD_ID", experts, down_b, ids)
        experts = g.dup_op("MUL", experts, weights)
        self.gf.expand(experts)
        views = [g.view(experts, (spec.n_embd, T), (experts.nb[2],), i * experts.nb[1]) for i in range(k)]
        for v in views:
            self.gf.expand(v)
        out = views[0]
        for v in views[1:]:
            out = g.dup_op("ADD", out, v)
            self.gf.expand(out)
        if k == 1:
            out = g.cont(out)
        return out

    def exps_scale(self, res: Tensor, name: str, ids: Tensor, n_tokens: int) -> Tensor:
        """build_lora_mm_id's per-expert scale `w_s` {n_expert} (src/llama-graph.cpp 1555-1595; the generic loader
        pass, src/llama-model.cpp 1634-1712, loads `<w>.scale` beside separate gate/up/down expert weights, none beside
        a merged gate_up): reshape_3d(w_s, 1, NE, 1) → REPEAT [1, NE, T] → GET_ROWS by the selected experts
        [1, k, T] → MUL into the mat-mul's result."""
        w_s = self.w(name)
        if w_s is None:
            return res
        rep = repeat(g.reshape(w_s, 1, w_s.ne[0], 1), 1, w_s.ne[0], n_tokens, 1)
        return g.dup_op("MUL", res, g.get_rows(rep, ids))

    def output(self, cur: Tensor, rows_before: bool) -> None:
        if rows_before:
            cur = g.get_rows(cur, self.out_ids)
        cur = self.norm(cur, "output_norm.weight")
        cur.is_output = True  # res->t_embd
        logits = g.mul_mat(self.output_weight(), cur)
        logits.is_output = True  # res->t_logits
        self.gf.expand(logits)



SOFTMAX, SIGMOID, SOFTMAX_WEIGHT = 1, 2, 3  # llama_expert_gating_func_type


def _kv(type_name: str) -> str:
    return type_name.upper()


def _quantized(type_name: str) -> bool:
    return KV_CACHE_TYPES[type_name][0] > 1


def block_bytes(block: tuple[int, int], n: int) -> int:
    """The bytes of n elements of a type whose blocks are (elements, bytes)."""
    return n // block[0] * block[1]


