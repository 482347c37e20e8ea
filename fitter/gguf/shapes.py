"""The shapes of fitter's synthetic GGUF models: architecture hyperparameters and the tensor table each one has
(what llama.cpp's loader expects for it), for the demo model, the tiny test models and real-shaped headers
(gpt-oss-120b, gpt-oss-20b, Qwen3-30B-A3B, Mixtral-8x7B, …). Validated on construction: every error names the shape,
the field, the rule and the value. Pure data; fitter.gguf.demo_models writes them."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import gguf

from fitter.errors import FitterError

ARCHS = ("gpt-oss", "qwen3moe", "qwen2moe", "llama", "qwen3", "deepseek2", "glm4moe", "gemma3", "llama4", "qwen3next",
         "minimax-m2")
# Types whose blocks write_model can synthesize. Sparse (header-only) files accept any type gguf knows.
GENERATED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "MXFP4")

# A handful of BPE merges: llama.cpp's gpt2 tokenizer refuses a file without tokenizer.ggml.merges.
MERGES = (
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġt", "he"), ("r", "e"),
    ("Ġ", "s"), ("a", "t"), ("o", "r"), ("e", "n"), ("Ġ", "w"), ("Ġ", "o"), ("i", "s"), ("Ġ", "c"),
)


@dataclass(frozen=True)
class ShapeTensor:
    """One tensor of a model: name, ggml shape (``ne``, fastest dimension first), ggml type, role."""

    name: str
    ne: tuple[int, ...]
    type: str
    # What the values mean, for the generator: weight, norm (1.0), bias, sinks (0.0), router (F32 weight).
    role: str = "weight"

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.type]]
        return self.n_elements // block * size


@dataclass(frozen=True)
class ModelShape:
    """The hyper-parameters of a model to generate.

    ``head_dim`` is the K and V head size (non-MLA archs). For ``deepseek2`` the MLA fields are used
    instead and ``n_head_kv`` must be 1, as in converted DeepSeek GGUFs (one shared latent KV head).
    ``n_ff`` is the dense FFN width (dense llama/qwen3, deepseek2 leading dense blocks); for the other
    MoE archs it is only written as ``feed_forward_length`` metadata, as the public conversions do.
    For Mixtral-style ``llama`` with experts, ``n_ff_exp`` is the expert width and is written as
    ``feed_forward_length`` because that is where llama.cpp reads it for this arch.
    Shared experts: qwen2moe uses ``n_ff_shexp``; deepseek2's shared width is
    ``n_ff_exp * n_expert_shared`` (llama.cpp derives it so).
    """

    name: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int = 0
    n_ff: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_expert_shared: int = 0
    n_ff_shexp: int = 0
    n_leading_dense: int = 0
    # MLA (deepseek2 only); q_lora_rank 0 = plain attn_q instead of the q_a/q_b low-rank pair.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # NextN/MTP blocks after the trunk (deepseek2, glm4moe): block_count counts them, nextn_predict_layers how many
    n_nextn: int = 0
    tied_output: bool = False  # no output.weight: llama.cpp reuses token_embd (TENSOR_DUPLICATED)
    # gated DeltaNet layers (qwen3next): K heads of ssm_d_state, V heads (ssm_dt_rank) of ssm_d_state, conv kernel;
    # every full_attention_interval-th layer is attention (the file writes no recurrent_layers key)
    ssm_d_conv: int = 0
    ssm_d_state: int = 0
    ssm_n_group: int = 0
    ssm_dt_rank: int = 0
    full_attention_interval: int = 0
    n_vocab: int = 512
    n_ctx_train: int = 4096
    sliding_window: int = 0
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-5
    weight_type: str = "F16"
    expert_type: str = "F16"
    loads_in_llama_cpp: bool = True

    def __post_init__(self) -> None:
        self._validate()

    # --- derived sizes -------------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def is_mla(self) -> bool:
        return self.arch == "deepseek2"

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors())

    @property
    def n_bytes(self) -> int:
        """Tensor data bytes, without GGUF padding or header."""
        return sum(t.nbytes for t in self.tensors())

    def tensors(self) -> list[ShapeTensor]:
        """Every tensor llama.cpp requires for this arch, in file order."""
        wt = self.weight_type
        specs = [ShapeTensor("token_embd.weight", (self.n_embd, self.n_vocab), wt)]
        for il in range(self.n_layer):
            specs += self._block_tensors(il)
        for il in range(self.n_layer, self.n_layer + self.n_nextn):
            specs += self._block_tensors(il) + self._nextn_tensors(il)
        specs.append(ShapeTensor("output_norm.weight", (self.n_embd,), "F32", "norm"))
        if not self.tied_output:
            specs.append(ShapeTensor("output.weight", (self.n_embd, self.n_vocab), wt))
        return specs

    # --- tensor lists per arch -----------------------------------------------------------------------

    def _block_tensors(self, il: int) -> list[ShapeTensor]:
        p = f"blk.{il}."
        e, wt = self.n_embd, self.weight_type
        out = [ShapeTensor(p + "attn_norm.weight", (e,), "F32", "norm")]
        if self.arch == "qwen3next":
            return out + self._qwen3next_block(il)
        if self.is_mla:
            out += self._mla_tensors(p)
        else:
            q, kv = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
            out += [
                ShapeTensor(p + "attn_q.weight", (e, q), wt),
                ShapeTensor(p + "attn_k.weight", (e, kv), wt),
                ShapeTensor(p + "attn_v.weight", (e, kv), wt),
                ShapeTensor(p + "attn_output.weight", (q, e), wt),
            ]
            if self.arch in ("gpt-oss", "qwen2moe", "glm4moe"):  # q/k/v biases; gpt-oss also an o bias
                out += [
                    ShapeTensor(p + "attn_q.bias", (q,), "F32", "bias"),
                    ShapeTensor(p + "attn_k.bias", (kv,), "F32", "bias"),
                    ShapeTensor(p + "attn_v.bias", (kv,), "F32", "bias"),
                ]
            if self.arch == "gpt-oss":
                out += [
                    ShapeTensor(p + "attn_output.bias", (e,), "F32", "bias"),
                    ShapeTensor(p + "attn_sinks.weight", (self.n_head,), "F32", "sinks"),
                ]
            if self.arch in ("qwen3", "qwen3moe", "gemma3"):
                out += [
                    ShapeTensor(p + "attn_q_norm.weight", (self.head_dim,), "F32", "norm"),
                    ShapeTensor(p + "attn_k_norm.weight", (self.head_dim,), "F32", "norm"),
                ]
            if self.arch == "minimax-m2":  # QK norms over every head at once (src/models/minimax-m2.cpp)
                out += [
                    ShapeTensor(p + "attn_q_norm.weight", (q,), "F32", "norm"),
                    ShapeTensor(p + "attn_k_norm.weight", (kv,), "F32", "norm"),
                ]
        # gpt-oss and glm4moe name their pre-FFN norm post_attention_norm; the others ffn_norm.
        norm = "post_attention_norm" if self.arch in ("gpt-oss", "glm4moe") else "ffn_norm"
        if self.arch == "gemma3":  # a norm after attention, before the FFN and after it (src/models/gemma3.cpp)
            out.append(ShapeTensor(p + "post_attention_norm.weight", (e,), "F32", "norm"))
            out.append(ShapeTensor(p + "post_ffw_norm.weight", (e,), "F32", "norm"))
        out.append(ShapeTensor(p + norm + ".weight", (e,), "F32", "norm"))
        if not self.is_moe or il < self.n_leading_dense:
            out += self._dense_ffn(p, self.n_ff)
        else:
            out += self._moe_tensors(p)
        return out

    def is_recurrent(self, il: int) -> bool:
        return self.arch == "qwen3next" and (il + 1) % self.full_attention_interval != 0

    def _qwen3next_block(self, il: int) -> list[ShapeTensor]:
        """src/models/qwen3next.cpp load_arch_tensors: gated attention (Q twice as wide: query and gate) or a gated
        DeltaNet layer, then routed experts and a sigmoid-gated shared expert."""
        p, e, wt = f"blk.{il}.", self.n_embd, self.weight_type
        out = [ShapeTensor(p + "post_attention_norm.weight", (e,), "F32", "norm")]
        if not self.is_recurrent(il):
            q, kv = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
            out += [
                ShapeTensor(p + "attn_q.weight", (e, 2 * q), wt),
                ShapeTensor(p + "attn_k.weight", (e, kv), wt),
                ShapeTensor(p + "attn_v.weight", (e, kv), wt),
                ShapeTensor(p + "attn_output.weight", (q, e), wt),
                ShapeTensor(p + "attn_q_norm.weight", (self.head_dim,), "F32", "norm"),
                ShapeTensor(p + "attn_k_norm.weight", (self.head_dim,), "F32", "norm"),
            ]
        else:
            key_dim, value_dim = self.ssm_d_state * self.ssm_n_group, self.ssm_d_state * self.ssm_dt_rank
            out += [
                ShapeTensor(p + "attn_qkv.weight", (e, 2 * key_dim + value_dim), wt),
                ShapeTensor(p + "attn_gate.weight", (e, value_dim), wt),
                ShapeTensor(p + "ssm_conv1d.weight", (self.ssm_d_conv, 2 * key_dim + value_dim), "F32", "norm"),
                ShapeTensor(p + "ssm_dt.bias", (self.ssm_dt_rank,), "F32", "bias"),
                ShapeTensor(p + "ssm_a", (self.ssm_dt_rank,), "F32", "norm"),
                ShapeTensor(p + "ssm_ba.weight", (e, 2 * self.ssm_dt_rank), wt),
                ShapeTensor(p + "ssm_norm.weight", (self.ssm_d_state,), "F32", "norm"),
                ShapeTensor(p + "ssm_out.weight", (value_dim, e), wt),
            ]
        return out + self._moe_tensors(p)

    def _nextn_tensors(self, il: int) -> list[ShapeTensor]:
        """A NextN block's own tensors beside a full layer's (src/models/deepseek2.cpp, glm4-moe.cpp
        load_arch_tensors)."""
        p, e, wt = f"blk.{il}.", self.n_embd, self.weight_type
        return [
            ShapeTensor(p + "nextn.eh_proj.weight", (2 * e, e), wt),
            ShapeTensor(p + "nextn.enorm.weight", (e,), "F32", "norm"),
            ShapeTensor(p + "nextn.hnorm.weight", (e,), "F32", "norm"),
            ShapeTensor(p + "nextn.shared_head_head.weight", (e, self.n_vocab), wt),
            ShapeTensor(p + "nextn.shared_head_norm.weight", (e,), "F32", "norm"),
        ]

    def _mla_tensors(self, p: str) -> list[ShapeTensor]:
        e, wt, h = self.n_embd, self.weight_type, self.n_head
        k_mla = self.qk_nope_head_dim + self.qk_rope_head_dim
        out: list[ShapeTensor] = []
        if self.q_lora_rank > 0:
            out += [
                ShapeTensor(p + "attn_q_a_norm.weight", (self.q_lora_rank,), "F32", "norm"),
                ShapeTensor(p + "attn_q_a.weight", (e, self.q_lora_rank), wt),
                ShapeTensor(p + "attn_q_b.weight", (self.q_lora_rank, h * k_mla), wt),
            ]
        else:
            out.append(ShapeTensor(p + "attn_q.weight", (e, h * k_mla), wt))
        out += [
            ShapeTensor(p + "attn_kv_a_norm.weight", (self.kv_lora_rank,), "F32", "norm"),
            ShapeTensor(p + "attn_kv_a_mqa.weight", (e, self.kv_lora_rank + self.qk_rope_head_dim), wt),
            # Split k_b / v_b (what current convert_hf_to_gguf writes) select llama.cpp's MLA path.
            ShapeTensor(p + "attn_k_b.weight", (self.qk_nope_head_dim, self.kv_lora_rank, h), wt),
            ShapeTensor(p + "attn_v_b.weight", (self.kv_lora_rank, self.v_head_dim, h), wt),
            ShapeTensor(p + "attn_output.weight", (h * self.v_head_dim, e), wt),
        ]
        return out

    def _dense_ffn(self, p: str, n_ff: int) -> list[ShapeTensor]:
        e, wt = self.n_embd, self.weight_type
        return [
            ShapeTensor(p + "ffn_gate.weight", (e, n_ff), wt),
            ShapeTensor(p + "ffn_down.weight", (n_ff, e), wt),
            ShapeTensor(p + "ffn_up.weight", (e, n_ff), wt),
        ]

    def _moe_tensors(self, p: str) -> list[ShapeTensor]:
        e, x, f, xt = self.n_embd, self.n_expert, self.n_ff_exp, self.expert_type
        # The router stays F32: llama-quantize and convert_hf_to_gguf never quantize ffn_gate_inp.
        out = [ShapeTensor(p + "ffn_gate_inp.weight", (e, x), "F32", "router")]
        if self.arch == "gpt-oss":
            out.append(ShapeTensor(p + "ffn_gate_inp.bias", (x,), "F32", "bias"))
        if self.arch in ("glm4moe", "minimax-m2"):  # the sigmoid router's selection bias (src/models/glm4-moe.cpp)
            out.append(ShapeTensor(p + "exp_probs_b.bias", (x,), "F32", "bias"))
        out += [
            ShapeTensor(p + "ffn_gate_exps.weight", (e, f, x), xt),
            ShapeTensor(p + "ffn_down_exps.weight", (f, e, x), xt),
            ShapeTensor(p + "ffn_up_exps.weight", (e, f, x), xt),
        ]
        if self.arch == "gpt-oss":
            out += [
                ShapeTensor(p + "ffn_gate_exps.bias", (f, x), "F32", "bias"),
                ShapeTensor(p + "ffn_down_exps.bias", (e, x), "F32", "bias"),
                ShapeTensor(p + "ffn_up_exps.bias", (f, x), "F32", "bias"),
            ]
        shexp = self.n_ff_shexp if self.arch in ("qwen2moe", "qwen3next") else self.n_ff_exp * self.n_expert_shared
        if self.arch in ("qwen2moe", "qwen3next"):
            # qwen2moe and qwen3next gate their shared expert with a sigmoid of this vector.
            out.append(ShapeTensor(p + "ffn_gate_inp_shexp.weight", (e,), "F32", "router"))
        if self.arch in ("qwen2moe", "deepseek2", "glm4moe", "llama4", "qwen3next"):  # llama4's is n_ff_exp wide
            out += [
                ShapeTensor(p + "ffn_gate_shexp.weight", (e, shexp), self.weight_type),
                ShapeTensor(p + "ffn_down_shexp.weight", (shexp, e), self.weight_type),
                ShapeTensor(p + "ffn_up_shexp.weight", (e, shexp), self.weight_type),
            ]
        return out

    # --- validation ----------------------------------------------------------------------------------

    def _fail(self, field: str, rule: str, value: object) -> FitterError:
        return FitterError(f"model shape {self.name!r}: {field} {rule}, got {value!r}")

    def _validate(self) -> None:
        if self.arch not in ARCHS:
            raise self._fail("arch", f"must be one of {', '.join(ARCHS)}", self.arch)
        for field in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_vocab", "n_ctx_train"):
            if getattr(self, field) <= 0:
                raise self._fail(field, "must be > 0", getattr(self, field))
        for field in ("weight_type", "expert_type"):
            if getattr(self, field) not in gguf.GGMLQuantizationType.__members__:
                raise self._fail(field, "must be a ggml type name gguf knows (e.g. Q8_0)",
                                 getattr(self, field))
        self._validate_arch()
        n_fixed = 256 + len(MERGES) + 1
        if self.n_vocab < n_fixed:
            raise self._fail("n_vocab", f"must be >= {n_fixed} (256 bytes + merges + EOS)", self.n_vocab)
        for t in self.tensors():
            block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.type]][0]
            if t.ne[0] % block:
                raise self._fail(f"row length of {t.name}", f"must be a multiple of {t.type}'s block {block}",
                                 t.ne[0])

    def _validate_arch(self) -> None:
        moe_archs = ("gpt-oss", "qwen3moe", "qwen2moe", "deepseek2", "glm4moe", "llama4", "qwen3next", "minimax-m2")
        if self.arch in moe_archs and not self.is_moe:
            raise self._fail("n_expert", f"must be > 0 for arch {self.arch}", self.n_expert)
        if self.arch == "qwen3" and self.is_moe:
            raise self._fail("n_expert", "must be 0 for dense qwen3 (use qwen3moe)", self.n_expert)
        if self.is_moe:
            if not 0 < self.n_expert_used <= self.n_expert:
                raise self._fail("n_expert_used", f"must be in 1..n_expert={self.n_expert}",
                                 self.n_expert_used)
            if self.n_ff_exp <= 0:
                raise self._fail("n_ff_exp", "must be > 0 for a MoE model", self.n_ff_exp)
        if (not self.is_moe or self.n_leading_dense > 0) and self.n_ff <= 0:
            raise self._fail("n_ff", "must be > 0 when the model has dense FFN blocks", self.n_ff)
        if self.arch == "llama" and self.is_moe and self.n_ff not in (0, self.n_ff_exp):
            raise self._fail("n_ff", "must be 0 or n_ff_exp for Mixtral-style llama (one FFN width key)",
                             self.n_ff)
        if self.n_leading_dense and (self.arch not in ("deepseek2", "glm4moe") or self.n_leading_dense >= self.n_layer):
            raise self._fail("n_leading_dense", "is deepseek2- and glm4moe-only and must be < n_layer",
                             self.n_leading_dense)
        if self.arch == "gpt-oss" and self.sliding_window <= 0:
            raise self._fail("sliding_window", "must be > 0 for gpt-oss (llama.cpp requires the key)",
                             self.sliding_window)
        if self.arch not in ("gpt-oss", "gemma3") and self.sliding_window:
            raise self._fail("sliding_window", "is only generated for gpt-oss and gemma3", self.sliding_window)
        if self.arch == "gemma3" and self.is_moe:
            raise self._fail("n_expert", "must be 0 for gemma3 (dense)", self.n_expert)
        if self.arch in ("qwen2moe", "qwen3next") and self.n_ff_shexp <= 0:
            raise self._fail("n_ff_shexp", f"must be > 0 for {self.arch}", self.n_ff_shexp)
        if self.arch not in ("qwen2moe", "qwen3next") and self.n_ff_shexp:
            raise self._fail("n_ff_shexp", "is qwen2moe- and qwen3next-only (deepseek2 uses n_ff_exp * "
                             "n_expert_shared)", self.n_ff_shexp)
        if self.arch == "qwen3next" and min(self.ssm_d_conv, self.ssm_d_state, self.ssm_n_group, self.ssm_dt_rank,
                                            self.full_attention_interval) <= 0:
            raise self._fail("ssm_*", "and full_attention_interval must be > 0 for qwen3next",
                             (self.ssm_d_conv, self.ssm_d_state, self.ssm_n_group, self.ssm_dt_rank,
                              self.full_attention_interval))
        if self.n_nextn and self.arch not in ("deepseek2", "glm4moe"):
            raise self._fail("n_nextn", "is deepseek2- and glm4moe-only", self.n_nextn)
        if self.arch == "deepseek2":
            self._validate_mla()
            return
        if self.n_expert_shared and self.arch not in ("qwen2moe", "glm4moe", "llama4"):
            raise self._fail("n_expert_shared", "is only generated for qwen2moe, glm4moe, llama4 and deepseek2",
                             self.n_expert_shared)
        if self.head_dim <= 0:
            raise self._fail("head_dim", "must be > 0", self.head_dim)
        if self.n_head % self.n_head_kv:
            raise self._fail("n_head", f"must be a multiple of n_head_kv={self.n_head_kv}", self.n_head)
        if self.arch in ("llama", "qwen2moe", "llama4") and self.head_dim * self.n_head != self.n_embd:
            # llama checks n_rot == n_embd/n_head; qwen2moe sizes attn_q/attn_output as n_embd x n_embd.
            rule = f"must equal n_embd/n_head = {self.n_embd // self.n_head} for {self.arch}"
            raise self._fail("head_dim", rule, self.head_dim)

    def _validate_mla(self) -> None:
        mla = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_expert_shared")
        for field in mla:
            if getattr(self, field) <= 0:
                raise self._fail(field, "must be > 0 for deepseek2", getattr(self, field))
        if self.qk_rope_head_dim % 2:
            raise self._fail("qk_rope_head_dim", "must be even (RoPE rotates pairs)", self.qk_rope_head_dim)
        if self.q_lora_rank < 0:
            raise self._fail("q_lora_rank", "must be >= 0", self.q_lora_rank)
        if self.n_head_kv != 1:
            raise self._fail("n_head_kv", "must be 1 for MLA (one latent KV head)", self.n_head_kv)
        if self.head_dim:
            raise self._fail("head_dim", "must be 0 for deepseek2 (use the MLA fields)", self.head_dim)


_TINY: dict[str, Any] = {"n_vocab": 512, "n_ctx_train": 2048}
# DeepSeek-V3 / R1 (671 B; 61 layers, the first 3 dense, 256 routed experts and one shared): the largest public shape
# of the architectures fitter rebuilds: Q4_K experts, Q8_0 elsewhere (attn_k_b rows are 128).
_DEEPSEEK_V3 = ModelShape(
    name="deepseek-v3", arch="deepseek2", n_layer=61, n_embd=7168, n_head=128, n_head_kv=1, n_ff=18432,
    n_expert=256, n_expert_used=8, n_ff_exp=2048, n_expert_shared=1, n_leading_dense=3,
    q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
    n_vocab=129280, n_ctx_train=163840, rms_eps=1e-6, weight_type="Q8_0", expert_type="Q4_K",
)
SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        # ~164 M parameters, 92 % of them MXFP4 experts: big enough for stable llama.cpp timings on
        # 2 cores, small enough (~95 MB) to write in a fraction of a second. Same layout as gpt-oss:
        # q width (16 x 64) != n_embd, GQA 4:1, alternating SWA (128) / full layers, sinks, biases.
        ModelShape(
            name="demo", arch="gpt-oss", n_layer=8, n_embd=512, n_head=16, n_head_kv=4, head_dim=64,
            n_ff=384, n_expert=32, n_expert_used=4, n_ff_exp=384, n_vocab=2048, n_ctx_train=8192,
            sliding_window=128, rope_freq_base=150000.0, weight_type="Q8_0", expert_type="MXFP4",
        ),
        # Tiny test models: a few MiB, sub-second loads. Types vary to cover every generated type.
        ModelShape(
            name="gpt-oss-tiny", arch="gpt-oss", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
            n_ff=128, n_expert=4, n_expert_used=2, n_ff_exp=128, sliding_window=128, rope_freq_base=150000.0,
            weight_type="Q8_0", expert_type="MXFP4", **_TINY,
        ),
        ModelShape(
            name="qwen3moe-tiny", arch="qwen3moe", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
            n_expert=8, n_expert_used=2, n_ff_exp=64, rms_eps=1e-6, rope_freq_base=1e6,
            weight_type="F16", expert_type="Q8_0", **_TINY,
        ),
        ModelShape(
            name="qwen2moe-tiny", arch="qwen2moe", n_layer=2, n_embd=128, n_head=4, n_head_kv=4, head_dim=32,
            n_expert=8, n_expert_used=2, n_ff_exp=64, n_expert_shared=1, n_ff_shexp=128, rms_eps=1e-6,
            weight_type="F32", expert_type="Q4_0", **_TINY,
        ),
        ModelShape(
            name="mixtral-tiny", arch="llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
            n_expert=8, n_expert_used=2, n_ff_exp=128, rope_freq_base=1e6,
            weight_type="Q8_0", expert_type="Q4_0", **_TINY,
        ),
        ModelShape(
            name="llama-tiny", arch="llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, head_dim=32,
            n_ff=256, weight_type="BF16", expert_type="BF16", **_TINY,
        ),
        ModelShape(
            name="qwen3-tiny", arch="qwen3", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
            n_ff=512, rms_eps=1e-6, rope_freq_base=1e6, weight_type="Q4_K", expert_type="Q4_K", **_TINY,
        ),
        ModelShape(
            name="deepseek2-tiny", arch="deepseek2", n_layer=3, n_embd=128, n_head=4, n_head_kv=1,
            n_ff=256, n_expert=8, n_expert_used=2, n_ff_exp=64, n_expert_shared=1, n_leading_dense=1,
            q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
            rms_eps=1e-6, weight_type="F16", expert_type="Q8_0", **_TINY,
        ),
        # Real shapes, for header-only (sparse=True) files. gpt-oss types follow ggml-org's public
        # gpt-oss GGUFs: MXFP4 experts, Q8_0 embeddings/attention/output, F32 norms/biases/sinks/router
        # (120b: 116.83 B params, 59.02 GiB per llama-bench, which these shapes reproduce).
        ModelShape(
            name="gpt-oss-120b", arch="gpt-oss", n_layer=36, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64,
            n_ff=2880, n_expert=128, n_expert_used=4, n_ff_exp=2880, n_vocab=201088, n_ctx_train=131072,
            sliding_window=128, rope_freq_base=150000.0, weight_type="Q8_0", expert_type="MXFP4",
        ),
        ModelShape(
            name="gpt-oss-20b", arch="gpt-oss", n_layer=24, n_embd=2880, n_head=64, n_head_kv=8, head_dim=64,
            n_ff=2880, n_expert=32, n_expert_used=4, n_ff_exp=2880, n_vocab=201088, n_ctx_train=131072,
            sliding_window=128, rope_freq_base=150000.0, weight_type="Q8_0", expert_type="MXFP4",
        ),
        # Q4_K throughout stands in for a Q4_K_M file (whose few Q6_K tensors are left out).
        ModelShape(
            name="qwen3-30b-a3b", arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4,
            head_dim=128, n_ff=6144, n_expert=128, n_expert_used=8, n_ff_exp=768, n_vocab=151936,
            n_ctx_train=40960, rope_freq_base=1e6, rms_eps=1e-6, weight_type="Q4_K", expert_type="Q4_K",
        ),
        # Qwen3-14B (dense; untied output) in Q8_0, 15.7 GB: partially fits a 16 GB GPU.
        ModelShape(
            name="qwen3-14b", arch="qwen3", n_layer=40, n_embd=5120, n_head=40, n_head_kv=8, head_dim=128,
            n_ff=17408, n_vocab=151936, n_ctx_train=40960, rope_freq_base=1e6, rms_eps=1e-6,
            weight_type="Q8_0", expert_type="Q8_0",
        ),
        _DEEPSEEK_V3,
        # the same with its NextN block (block 61), as convert_hf_to_gguf keeps it: llama.cpp skips it unless MTP
        replace(_DEEPSEEK_V3, name="deepseek-v3-nextn", n_nextn=1),
        # GLM-4.5-Air (106 B, 12 B active): 46 layers, the first dense, 128 experts + 1 shared, sigmoid routing,
        # and its NextN block (block 46) as convert_hf_to_gguf keeps it; Q4_0 experts (rows of 1408), Q8_0 elsewhere
        ModelShape(
            name="glm-4.5-air", arch="glm4moe", n_layer=46, n_embd=4096, n_head=96, n_head_kv=8, head_dim=128,
            n_ff=10944, n_expert=128, n_expert_used=8, n_ff_exp=1408, n_expert_shared=1, n_leading_dense=1,
            n_nextn=1, n_vocab=151552, n_ctx_train=131072, rope_freq_base=1e6, weight_type="Q8_0",
            expert_type="Q4_0",
        ),
        # Gemma-3-27B: 62 layers, 5 of each 6 sliding-window (1024) by the architecture's default period (the file
        # writes no pattern), tied output; Q4_K stands in for its Q4_K_M
        ModelShape(
            name="gemma-3-27b", arch="gemma3", n_layer=62, n_embd=5376, n_head=32, n_head_kv=16, head_dim=128,
            n_ff=21504, n_vocab=262208, n_ctx_train=131072, sliding_window=1024, rope_freq_base=1e6, rms_eps=1e-6,
            tied_output=True, weight_type="Q4_K", expert_type="Q4_K",
        ),
        # Llama-4-Scout-17B-16E: 48 MoE layers (16 experts, 1 used, a shared expert), chunked attention in 3 of
        # each 4 layers (llama.cpp's default: chunks of 8192; the file writes no window), 10 M context
        ModelShape(
            name="llama-4-scout", arch="llama4", n_layer=48, n_embd=5120, n_head=40, n_head_kv=8, head_dim=128,
            n_ff=16384, n_expert=16, n_expert_used=1, n_ff_exp=8192, n_expert_shared=1, n_vocab=202048,
            n_ctx_train=10485760, rope_freq_base=500000.0, weight_type="Q4_K", expert_type="Q4_K",
        ),
        # Qwen3-Next-80B-A3B: 48 layers, 36 gated DeltaNet (32 V heads, 16 K heads of 128) and every 4th attention
        # (16 heads of 256, 2 KV heads); 512 experts, 10 used, a gated shared expert
        ModelShape(
            name="qwen3-next-80b-a3b", arch="qwen3next", n_layer=48, n_embd=2048, n_head=16, n_head_kv=2,
            head_dim=256, n_expert=512, n_expert_used=10, n_ff_exp=512, n_ff_shexp=512,
            ssm_d_conv=4, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32, full_attention_interval=4,
            n_vocab=151936, n_ctx_train=262144, rope_freq_base=1e7, rms_eps=1e-6, weight_type="Q8_0",
            expert_type="Q4_K",
        ),
        # MiniMax-M2 (230 B, 10 B active; MiniMaxAI/MiniMax-M2 config.json): 62 layers of 256 experts, 8 used, sigmoid
        # routing with a selection bias, QK norms over all heads; every expert width is feed_forward_length too (its
        # tensors are built with n_ff). Its partial rotary (64 of 128) changes no buffer and is not written.
        ModelShape(
            name="minimax-m2", arch="minimax-m2", n_layer=62, n_embd=3072, n_head=48, n_head_kv=8, head_dim=128,
            n_ff=1536, n_expert=256, n_expert_used=8, n_ff_exp=1536, n_vocab=200064, n_ctx_train=196608,
            rope_freq_base=5e6, rms_eps=1e-6, weight_type="Q8_0", expert_type="Q4_K",
        ),
        ModelShape(
            name="mixtral-8x7b", arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128,
            n_expert=8, n_expert_used=2, n_ff_exp=14336, n_vocab=32000, n_ctx_train=32768, rope_freq_base=1e6,
            weight_type="Q4_K", expert_type="Q4_K",
        ),
    )
}
