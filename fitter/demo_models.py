"""Synthetic GGUF models that llama.cpp loads: a small demo model, tiny test models and real-shaped headers.

Every model here is random but *valid*: quantized blocks are generated directly as bytes from a seeded
numpy Generator (no float→quant round trip), so a 100 M-parameter model writes in well under a second
and the same arguments always give the same bytes. Real-sized shapes (gpt-oss-120b, …) are meant to be
written with ``sparse=True``: the header is real, the data region is a file hole, and llama.cpp maps it
with mmap to report its true buffer sizes without any disk use. (llama.cpp's mmap uses MAP_POPULATE, so
the hole is still faulted in as zero pages: no disk reads, but page cache up to the model's size and
~1 s per 10 GiB. ``no_alloc`` with ``load_mode=NONE`` reads the header only.)
"""

from __future__ import annotations

import os
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from fitter.errors import FitterError

__all__ = [
    "DEMO_FILENAME",
    "SHAPES",
    "ModelShape",
    "TensorSpec",
    "demo_model_path",
    "fitter_home",
    "shard_paths",
    "write_model",
]

ARCHS = ("gpt-oss", "qwen3moe", "qwen2moe", "llama", "qwen3", "deepseek2")

DEMO_FILENAME = "fitter-demo-gpt-oss.gguf"

# Types whose blocks write_model can synthesize. Sparse (header-only) files accept any type gguf knows.
GENERATED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "MXFP4")

_WEIGHT_STD = 0.02  # GPT-2-style init scale: keeps activations and logits finite through RMS norms
_BIAS_STD = 0.01


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a model: name, ggml shape (``ne``, fastest dimension first), ggml type, role."""

    name: str
    ne: tuple[int, ...]
    type: str
    # What the values mean, for the generator: weight, norm (1.0), bias, sinks (0.0), router (F32 weight).
    role: str = "weight"

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n

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

    def tensors(self) -> list[TensorSpec]:
        """Every tensor llama.cpp requires for this arch, in file order."""
        wt = self.weight_type
        specs = [TensorSpec("token_embd.weight", (self.n_embd, self.n_vocab), wt)]
        for il in range(self.n_layer):
            specs += self._block_tensors(il)
        specs.append(TensorSpec("output_norm.weight", (self.n_embd,), "F32", "norm"))
        specs.append(TensorSpec("output.weight", (self.n_embd, self.n_vocab), wt))
        return specs

    # --- tensor lists per arch -----------------------------------------------------------------------

    def _block_tensors(self, il: int) -> list[TensorSpec]:
        p = f"blk.{il}."
        e, wt = self.n_embd, self.weight_type
        out = [TensorSpec(p + "attn_norm.weight", (e,), "F32", "norm")]
        if self.is_mla:
            out += self._mla_tensors(p)
        else:
            q, kv = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
            out += [
                TensorSpec(p + "attn_q.weight", (e, q), wt),
                TensorSpec(p + "attn_k.weight", (e, kv), wt),
                TensorSpec(p + "attn_v.weight", (e, kv), wt),
                TensorSpec(p + "attn_output.weight", (q, e), wt),
            ]
            if self.arch in ("gpt-oss", "qwen2moe"):  # both carry q/k/v biases; gpt-oss also an o bias
                out += [
                    TensorSpec(p + "attn_q.bias", (q,), "F32", "bias"),
                    TensorSpec(p + "attn_k.bias", (kv,), "F32", "bias"),
                    TensorSpec(p + "attn_v.bias", (kv,), "F32", "bias"),
                ]
            if self.arch == "gpt-oss":
                out += [
                    TensorSpec(p + "attn_output.bias", (e,), "F32", "bias"),
                    TensorSpec(p + "attn_sinks.weight", (self.n_head,), "F32", "sinks"),
                ]
            if self.arch in ("qwen3", "qwen3moe"):
                out += [
                    TensorSpec(p + "attn_q_norm.weight", (self.head_dim,), "F32", "norm"),
                    TensorSpec(p + "attn_k_norm.weight", (self.head_dim,), "F32", "norm"),
                ]
        # gpt-oss names its pre-FFN norm post_attention_norm; the others ffn_norm.
        norm = "post_attention_norm" if self.arch == "gpt-oss" else "ffn_norm"
        out.append(TensorSpec(p + norm + ".weight", (e,), "F32", "norm"))
        if not self.is_moe or il < self.n_leading_dense:
            out += self._dense_ffn(p, self.n_ff)
        else:
            out += self._moe_tensors(p)
        return out

    def _mla_tensors(self, p: str) -> list[TensorSpec]:
        e, wt, h = self.n_embd, self.weight_type, self.n_head
        k_mla = self.qk_nope_head_dim + self.qk_rope_head_dim
        out: list[TensorSpec] = []
        if self.q_lora_rank > 0:
            out += [
                TensorSpec(p + "attn_q_a_norm.weight", (self.q_lora_rank,), "F32", "norm"),
                TensorSpec(p + "attn_q_a.weight", (e, self.q_lora_rank), wt),
                TensorSpec(p + "attn_q_b.weight", (self.q_lora_rank, h * k_mla), wt),
            ]
        else:
            out.append(TensorSpec(p + "attn_q.weight", (e, h * k_mla), wt))
        out += [
            TensorSpec(p + "attn_kv_a_norm.weight", (self.kv_lora_rank,), "F32", "norm"),
            TensorSpec(p + "attn_kv_a_mqa.weight", (e, self.kv_lora_rank + self.qk_rope_head_dim), wt),
            # Split k_b / v_b (what current convert_hf_to_gguf writes) select llama.cpp's MLA path.
            TensorSpec(p + "attn_k_b.weight", (self.qk_nope_head_dim, self.kv_lora_rank, h), wt),
            TensorSpec(p + "attn_v_b.weight", (self.kv_lora_rank, self.v_head_dim, h), wt),
            TensorSpec(p + "attn_output.weight", (h * self.v_head_dim, e), wt),
        ]
        return out

    def _dense_ffn(self, p: str, n_ff: int) -> list[TensorSpec]:
        e, wt = self.n_embd, self.weight_type
        return [
            TensorSpec(p + "ffn_gate.weight", (e, n_ff), wt),
            TensorSpec(p + "ffn_down.weight", (n_ff, e), wt),
            TensorSpec(p + "ffn_up.weight", (e, n_ff), wt),
        ]

    def _moe_tensors(self, p: str) -> list[TensorSpec]:
        e, x, f, xt = self.n_embd, self.n_expert, self.n_ff_exp, self.expert_type
        # The router stays F32: llama-quantize and convert_hf_to_gguf never quantize ffn_gate_inp.
        out = [TensorSpec(p + "ffn_gate_inp.weight", (e, x), "F32", "router")]
        if self.arch == "gpt-oss":
            out.append(TensorSpec(p + "ffn_gate_inp.bias", (x,), "F32", "bias"))
        out += [
            TensorSpec(p + "ffn_gate_exps.weight", (e, f, x), xt),
            TensorSpec(p + "ffn_down_exps.weight", (f, e, x), xt),
            TensorSpec(p + "ffn_up_exps.weight", (e, f, x), xt),
        ]
        if self.arch == "gpt-oss":
            out += [
                TensorSpec(p + "ffn_gate_exps.bias", (f, x), "F32", "bias"),
                TensorSpec(p + "ffn_down_exps.bias", (e, x), "F32", "bias"),
                TensorSpec(p + "ffn_up_exps.bias", (f, x), "F32", "bias"),
            ]
        shexp = self.n_ff_shexp if self.arch == "qwen2moe" else self.n_ff_exp * self.n_expert_shared
        if self.arch == "qwen2moe":
            # qwen2moe gates its shared expert with a sigmoid of this vector.
            out.append(TensorSpec(p + "ffn_gate_inp_shexp.weight", (e,), "F32", "router"))
        if self.arch in ("qwen2moe", "deepseek2"):
            out += [
                TensorSpec(p + "ffn_gate_shexp.weight", (e, shexp), self.weight_type),
                TensorSpec(p + "ffn_down_shexp.weight", (shexp, e), self.weight_type),
                TensorSpec(p + "ffn_up_shexp.weight", (e, shexp), self.weight_type),
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
        n_fixed = 256 + len(_MERGES) + 1
        if self.n_vocab < n_fixed:
            raise self._fail("n_vocab", f"must be >= {n_fixed} (256 bytes + merges + EOS)", self.n_vocab)
        for t in self.tensors():
            block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.type]][0]
            if t.ne[0] % block:
                raise self._fail(f"row length of {t.name}", f"must be a multiple of {t.type}'s block {block}",
                                 t.ne[0])

    def _validate_arch(self) -> None:
        moe_archs = ("gpt-oss", "qwen3moe", "qwen2moe", "deepseek2")
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
        if self.n_leading_dense and (self.arch != "deepseek2" or self.n_leading_dense >= self.n_layer):
            raise self._fail("n_leading_dense", "is deepseek2-only and must be < n_layer",
                             self.n_leading_dense)
        if self.arch == "gpt-oss" and self.sliding_window <= 0:
            raise self._fail("sliding_window", "must be > 0 for gpt-oss (llama.cpp requires the key)",
                             self.sliding_window)
        if self.arch != "gpt-oss" and self.sliding_window:
            raise self._fail("sliding_window", "is only generated for gpt-oss", self.sliding_window)
        if self.arch == "qwen2moe" and self.n_ff_shexp <= 0:
            raise self._fail("n_ff_shexp", "must be > 0 for qwen2moe", self.n_ff_shexp)
        if self.arch != "qwen2moe" and self.n_ff_shexp:
            raise self._fail("n_ff_shexp", "is qwen2moe-only (deepseek2 uses n_ff_exp * n_expert_shared)",
                             self.n_ff_shexp)
        if self.arch == "deepseek2":
            self._validate_mla()
            return
        if self.n_expert_shared and self.arch != "qwen2moe":
            raise self._fail("n_expert_shared", "is only generated for qwen2moe and deepseek2",
                             self.n_expert_shared)
        if self.head_dim <= 0:
            raise self._fail("head_dim", "must be > 0", self.head_dim)
        if self.n_head % self.n_head_kv:
            raise self._fail("n_head", f"must be a multiple of n_head_kv={self.n_head_kv}", self.n_head)
        if self.arch in ("llama", "qwen2moe") and self.head_dim * self.n_head != self.n_embd:
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


# --- tokenizer ---------------------------------------------------------------------------------------

# A handful of BPE merges: llama.cpp's gpt2 tokenizer refuses a file without tokenizer.ggml.merges.
_MERGES = (
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġt", "he"), ("r", "e"),
    ("Ġ", "s"), ("a", "t"), ("o", "r"), ("e", "n"), ("Ġ", "w"), ("Ġ", "o"), ("i", "s"), ("Ġ", "c"),
)
_EOS = "<|endoftext|>"


def _byte_chars() -> list[str]:
    """GPT-2's byte→printable-character map: how byte-level BPE vocabularies spell the 256 bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars: dict[int, int] = {b: b for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + n
            n += 1
    return [chr(chars[b]) for b in range(256)]


def _vocab(n_vocab: int) -> tuple[list[str], list[int], list[str], int]:
    """Tokens, token types, merges and the EOS id: 256 bytes, merged pairs, EOS, UNUSED padding."""
    tokens = _byte_chars() + [a + b for a, b in _MERGES]
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    eos = len(tokens)
    tokens.append(_EOS)
    types.append(int(gguf.TokenType.CONTROL))
    pad = n_vocab - len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.UNUSED)] * pad
    return tokens, types, [f"{a} {b}" for a, b in _MERGES], eos


# --- metadata ----------------------------------------------------------------------------------------


# general.file_type as llama-quantize would set it; without it llama.cpp guesses "all F32" (norms and
# biases outnumber the big tensors) in the model description. Q4_K stands for Q4_K_M here.
_FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "MXFP4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
}


def _add_metadata(w: gguf.GGUFWriter, s: ModelShape) -> None:
    w.add_name(s.name)
    main_type = s.expert_type if s.is_moe else s.weight_type
    if main_type in _FILE_TYPES:
        w.add_file_type(int(_FILE_TYPES[main_type]))
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    if s.arch == "llama" and s.is_moe:
        w.add_feed_forward_length(s.n_ff_exp)
    elif s.n_ff:
        w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_rope_freq_base(s.rope_freq_base)
    if s.is_mla:
        # Converted DeepSeek files describe the cached latent as the "head": K = latent + rope, V = latent.
        w.add_key_length(s.kv_lora_rank + s.qk_rope_head_dim)
        w.add_value_length(s.kv_lora_rank)
        w.add_key_length_mla(s.qk_nope_head_dim + s.qk_rope_head_dim)
        w.add_value_length_mla(s.v_head_dim)
        w.add_rope_dimension_count(s.qk_rope_head_dim)
        w.add_q_lora_rank(s.q_lora_rank)
        w.add_kv_lora_rank(s.kv_lora_rank)
        w.add_leading_dense_block_count(s.n_leading_dense)
        w.add_expert_shared_count(s.n_expert_shared)
        w.add_expert_weights_scale(1.0)
        w.add_expert_weights_norm(False)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
    else:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_rope_dimension_count(s.head_dim)
    if s.is_moe:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        if s.arch != "llama":
            w.add_expert_feed_forward_length(s.n_ff_exp)
    if s.arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(s.n_ff_shexp)
    if s.sliding_window:
        # No sliding_window_pattern key: llama.cpp's gpt-oss default (period 2) makes even layers SWA.
        w.add_sliding_window(s.sliding_window)
    tokens, types, merges, eos = _vocab(s.n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)


# --- tensor data -------------------------------------------------------------------------------------

_F16_D = np.float16(_WEIGHT_STD / 64).tobytes()  # Q8_0: int8 in ±127 → weights within ±0.04
_F16_D4 = np.float16(0.005).tobytes()  # Q4_0 / Q4_K: 4-bit steps of 0.005 → weights within ±0.04
_F16_DMIN4K = np.float16(0.0375).tobytes()  # Q4_K: subtracting 7.5 steps centres the 0..15 range on 0
_E8M0_SCALE = 120  # MXFP4: 2^(120-128) = 1/256 per step of the ±12 e2m1 grid → weights within ±0.047


def _blocks(rng: np.random.Generator, nb: int, head: bytes, payload: int) -> npt.NDArray[np.uint8]:
    """``nb`` blocks of a fixed header followed by ``payload`` random bytes each."""
    out = np.empty((nb, len(head) + payload), dtype=np.uint8)
    out[:, : len(head)] = np.frombuffer(head, dtype=np.uint8)
    out[:, len(head):] = np.frombuffer(rng.bytes(nb * payload), dtype=np.uint8).reshape(nb, payload)
    return out.reshape(-1)


def _tensor_data(t: TensorSpec, seed: int) -> npt.NDArray[Any]:
    # Seeded per tensor name, so bytes do not depend on tensor order, sharding or earlier tensors.
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    n = t.n_elements
    shape = tuple(reversed(t.ne))
    if t.role in ("norm", "sinks"):
        if t.type != "F32":
            raise FitterError(f"tensor {t.name}: norms and sinks must be F32, got {t.type}")
        return np.full(shape, 1.0 if t.role == "norm" else 0.0, dtype=np.float32)
    if t.type in ("F32", "F16", "BF16"):
        std = _BIAS_STD if t.role == "bias" else _WEIGHT_STD
        x = (rng.standard_normal(n, dtype=np.float32) * np.float32(std)).reshape(shape)
        if t.type == "F32":
            return x
        if t.type == "F16":
            return x.astype(np.float16)
        return (x.view(np.uint32) >> 16).astype(np.uint16)  # BF16 = top half of F32 (truncation)
    nb = n // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.type]][0]
    if t.type == "Q8_0":  # fp16 d, 32 × int8 (any byte is a valid int8)
        return _blocks(rng, nb, _F16_D, 32)
    if t.type == "Q4_0":  # fp16 d, 16 bytes of nibbles q: w = (q - 8) d
        return _blocks(rng, nb, _F16_D4, 16)
    if t.type == "MXFP4":  # E8M0 exponent byte, 16 bytes of e2m1 nibbles
        return _blocks(rng, nb, bytes([_E8M0_SCALE]), 16)
    if t.type == "Q4_K":
        # fp16 d, fp16 dmin, 12 packed 6-bit scales/mins, 128 bytes of nibbles. Bytes 0-7 = 1 and 8-11 = 0x11
        # unpack to scale = min = 1 for all 8 sub-blocks, so w = d q - dmin.
        head = _F16_D4 + _F16_DMIN4K + bytes([1] * 8 + [0x11] * 4)
        return _blocks(rng, nb, head, 128)
    raise FitterError(
        f"tensor {t.name}: write_model can generate data only for {', '.join(GENERATED_TYPES)}, got {t.type} "
        "(use sparse=True for a header-only file)"
    )


# --- writing -----------------------------------------------------------------------------------------


def shard_paths(path: Path, n_shards: int) -> list[Path]:
    """llama.cpp's split names (``llama_split_path``): ``<stem>-00001-of-0000N.gguf``; one shard: ``path``."""
    if n_shards <= 1:
        return [path]
    stem = path.name[: -len(".gguf")] if path.name.endswith(".gguf") else path.name
    return [path.with_name(f"{stem}-{i + 1:05d}-of-{n_shards:05d}.gguf") for i in range(n_shards)]


def _split_tensors(specs: list[TensorSpec], n_shards: int) -> list[list[TensorSpec]]:
    """Consecutive runs of about equal bytes, each non-empty (gguf-split refuses empty shards)."""
    total = sum(t.nbytes for t in specs)
    shards: list[list[TensorSpec]] = [[] for _ in range(n_shards)]
    done, k = 0, 0
    for i, t in enumerate(specs):
        left = len(specs) - i  # tensors still to place, this one included
        must_move = n_shards - 1 - k >= left  # every later shard still needs one tensor
        full = done >= total * (k + 1) / n_shards
        if shards[k] and k < n_shards - 1 and (must_move or full):
            k += 1
        shards[k].append(t)
        done += t.nbytes
    return shards


def write_model(
    shape: ModelShape, path: Path, *, seed: int = 0, sparse: bool = False, n_shards: int = 1
) -> list[Path]:
    """Write ``shape`` as GGUF at ``path`` (split into ``n_shards`` files like gguf-split); return the files.

    The same arguments give the same bytes. ``sparse=True`` writes only the headers and extends each
    file to its full size with ``truncate``, leaving the data region a hole: no disk use, no data made.
    """
    specs = shape.tensors()
    most = min(len(specs), 99999)  # one tensor per shard at least; 5-digit split names
    if not 1 <= n_shards <= most:
        raise FitterError(f"n_shards for {shape.name!r}: must be in 1..{most}, got {n_shards}")
    if not sparse:
        bad = sorted({t.type for t in specs if t.role == "weight" and t.type not in GENERATED_TYPES})
        if bad:
            raise FitterError(
                f"model shape {shape.name!r}: write_model can generate only {', '.join(GENERATED_TYPES)}, "
                f"got {', '.join(bad)} (use sparse=True for a header-only file)"
            )
    paths = shard_paths(path, n_shards)
    for i, (p, shard) in enumerate(zip(paths, _split_tensors(specs, n_shards), strict=True)):
        _write_shard(shape, p, shard, i, n_shards, len(specs), seed, sparse)
    return paths


def _write_shard(
    shape: ModelShape,
    path: Path,
    specs: list[TensorSpec],
    index: int,
    n_shards: int,
    n_tensors: int,
    seed: int,
    sparse: bool,
) -> None:
    w = gguf.GGUFWriter(path, shape.arch)
    try:
        if index == 0:
            _add_metadata(w, shape)
        else:
            # gguf-split puts the model's metadata in the first shard only; the others carry split keys.
            del w.kv_data[0][gguf.Keys.General.ARCHITECTURE]
        if n_shards > 1:  # key names and types as llama.cpp's gguf-split writes them
            w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, index)
            w.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, n_shards)
            w.add_int32(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, n_tensors)
        for t in specs:
            # A float dtype with raw_dtype makes gguf take the shape as elements (numpy order) unchanged.
            w.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32), t.nbytes,
                              raw_dtype=gguf.GGMLQuantizationType[t.type])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        if sparse:
            assert w.fout is not None
            align = w.data_alignment
            size = w.ggml_pad(w.fout[0].tell(), align) + sum(w.ggml_pad(t.nbytes, align) for t in specs)
        else:
            for t in specs:
                w.write_tensor_data(_tensor_data(t, seed))
    finally:
        w.close()
    if sparse:
        os.truncate(path, size)


# --- cache -------------------------------------------------------------------------------------------


def fitter_home() -> Path:
    """Where fitter caches generated files: ``$FITTER_HOME`` or ``~/.cache/fitter``."""
    env = os.environ.get("FITTER_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fitter"


def demo_model_path(out: Path | None = None) -> Path:
    """The demo model's file, written on first use (``fitter_home()/models/`` unless ``out`` names the file).

    Written to a temporary name and renamed, so a crash never leaves a half-written model behind.
    Delete the file to regenerate it.
    """
    path = out if out is not None else fitter_home() / "models" / DEMO_FILENAME
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write_model(SHAPES["demo"], tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# --- the shapes --------------------------------------------------------------------------------------

_TINY: dict[str, Any] = {"n_vocab": 512, "n_ctx_train": 2048}

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
        ModelShape(
            name="mixtral-8x7b", arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128,
            n_expert=8, n_expert_used=2, n_ff_exp=14336, n_vocab=32000, n_ctx_train=32768, rope_freq_base=1e6,
            weight_type="Q4_K", expert_type="Q4_K",
        ),
    )
}
