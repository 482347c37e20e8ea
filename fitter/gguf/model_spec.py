"""Model spec: the hyperparameters and tensor table llama.cpp's memory rules need, from a GGUF header.

Keys follow llama.cpp's `{arch}.…` templates (src/llama-arch.cpp) and defaults follow
`llama_model_base::load_hparams` (src/llama-model.cpp): n_head_kv defaults to n_head, head dims default to
n_embd / n_head, per-layer arrays may replace scalars. Tensor names and their kinds come from gguf's
`TENSOR_NAMES`, so roles are known for every architecture gguf knows, even ones fitter has no rules for.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from fitter.errors import FitterError, GGUFError
from fitter.gguf._constants import MODEL_TENSOR, TENSOR_NAMES
from fitter.gguf.archs import ARCHS, Arch, Indexer, Memory, RecurrentBy, SwaWhen
from fitter.gguf.header import GGUFHeader, SkippedArray, TensorInfo
from fitter.gguf.projector import ProjectorSpec, with_projector


class Role(StrEnum):
    EMBEDDING = "embedding"
    OUTPUT = "output"
    ATTENTION = "attention"
    NORM = "norm"
    ROUTER = "router"
    EXPERT = "expert"
    SHARED_EXPERT = "shared_expert"
    DENSE_FFN = "dense_ffn"
    OTHER = "other"


_T = MODEL_TENSOR
# Kinds of tensor by gguf's own tensor enum; the names are looked up in gguf.TENSOR_NAMES below.
_ROLE_BY_TENSOR: dict[MODEL_TENSOR, Role] = {
    _T.TOKEN_EMBD: Role.EMBEDDING,
    _T.OUTPUT: Role.OUTPUT,
    **{t: Role.NORM for t in (
        _T.OUTPUT_NORM, _T.ATTN_NORM, _T.ATTN_NORM_2, _T.ATTN_POST_NORM, _T.FFN_NORM, _T.FFN_POST_NORM,
        _T.ATTN_Q_NORM, _T.ATTN_K_NORM, _T.ATTN_Q_A_NORM, _T.ATTN_KV_A_NORM, _T.LAYER_OUT_NORM,
    )},
    **{t: Role.ATTENTION for t in (
        _T.ATTN_Q, _T.ATTN_K, _T.ATTN_V, _T.ATTN_QKV, _T.ATTN_OUT, _T.ATTN_SINKS, _T.ATTN_Q_A, _T.ATTN_Q_B,
        _T.ATTN_KV_A_MQA, _T.ATTN_KV_B, _T.ATTN_K_B, _T.ATTN_V_B, _T.ATTN_ROT_EMBD,
    )},
    **{t: Role.ROUTER for t in (_T.FFN_GATE_INP, _T.FFN_EXP_PROBS_B)},
    **{t: Role.EXPERT for t in (
        _T.FFN_GATE_EXP, _T.FFN_UP_EXP, _T.FFN_DOWN_EXP, _T.FFN_GATE_UP_EXP,
        _T.FFN_GATE_CHEXP, _T.FFN_UP_CHEXP, _T.FFN_DOWN_CHEXP,
    )},
    **{t: Role.SHARED_EXPERT for t in (
        _T.FFN_GATE_SHEXP, _T.FFN_UP_SHEXP, _T.FFN_DOWN_SHEXP, _T.FFN_GATE_INP_SHEXP,
    )},
    **{t: Role.DENSE_FFN for t in (_T.FFN_GATE, _T.FFN_UP, _T.FFN_DOWN)},
}
# Base name (without "blk.{bid}." and without ".weight"/".bias") → role.
_ROLE_BY_BASE: dict[str, Role] = {
    TENSOR_NAMES[t].removeprefix("blk.{bid}."): role for t, role in _ROLE_BY_TENSOR.items()
}
_NAME_RE = re.compile(r"^(?:blk\.(?P<layer>\d+)\.)?(?P<base>.+?)(?:\.(?P<suffix>weight|bias|scale|input_scale))?$")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    type: str  # ggml type name, e.g. "MXFP4"
    ne: tuple[int, ...]  # ggml order
    n_bytes: int
    layer: int | None  # block index, None for token_embd / output / output_norm
    role: Role
    shard: int
    offset: int  # absolute offset in its shard (the mapped CPU buffer is a byte range of each shard)

    @property
    def shape(self) -> list[int]:
        return list(self.ne)


@dataclass(frozen=True)
class ModelSpec:
    path: str
    arch: str
    identity: str
    n_shards: int
    shard_sizes: tuple[int, ...]
    n_layer: int
    n_embd: int
    n_head: tuple[int, ...]  # per layer
    n_head_kv: tuple[int, ...]  # per layer
    head_dim_k: int
    head_dim_v: int
    n_expert: int
    n_expert_used: int
    n_ff: tuple[int, ...]  # per layer (dense FFN width; Mixtral-style llama keeps its expert width here)
    n_ff_exp: int
    n_expert_shared: int
    n_ff_shexp: int
    n_layer_dense_lead: int
    n_swa: int  # sliding window, 0 = none
    swa_layers: tuple[bool, ...]  # per layer
    is_mla: bool
    head_dim_k_mla: int  # per-head Q/K width of MLA before absorption (attention.key_length_mla)
    head_dim_v_mla: int
    kv_lora_rank: int
    q_lora_rank: int
    n_rot: int
    n_vocab: int
    n_ctx_train: int
    expert_gating: int  # llama_expert_gating_func_type: 0 none (arch default), 1 softmax, 2 sigmoid, 3 softmax_weight
    expert_weights_norm: bool
    expert_weights_scale: float
    tensors: tuple[TensorSpec, ...]  # the tensors llama.cpp creates (a skipped NextN block's are in `skipped`)
    memory: Memory = Memory.KV
    n_layer_nextn: int = 0  # NextN/MTP blocks at the end (nextn_predict_layers): never in the trunk's memory
    recurrent_layers: tuple[bool, ...] = ()  # per layer of a hybrid model: recurrent state; empty = not hybrid
    attention_layers: tuple[bool, ...] = ()  # per layer of a hybrid model: a KV cache (falcon-h1: both, everywhere)
    indexer_layers: tuple[bool, ...] = ()  # per layer: a DSA indexer key cache too (fitter.gguf.archs.Indexer)
    indexer_width: int = 0  # a layer's indexer key row: attention.indexer.key_length (× 3 with a hybrid's k-pool)
    n_embd_r: int = 0  # llama_hparams::n_embd_r / n_embd_s: a recurrent layer's conv and SSM state per sequence
    n_embd_s: int = 0
    final_logit_softcapping: float = 0.0  # `final_logit_softcapping` as the file gives it, 0 without the key
    # llama_hparams' SSM keys (ssm.conv_kernel, inner_size, state_size, time_step_rank, group_count): the recurrent
    # layers' shapes a graph builder reads (fitter.memory.graph.families); 0 without them
    ssm_d_conv: int = 0
    ssm_d_inner: int = 0
    ssm_d_state: int = 0
    ssm_dt_rank: int = 0
    ssm_n_group: int = 0
    # graph-only hyperparameters (fitter.memory.graph.families): `interleave_moe_layer_step` (llama4, ernie4_5-moe),
    # `n_deepstack_layers` (qwen3vl, qwen3vlmoe: llama_hparams::n_embd_inp), `attention.temperature_scale` (mistral3),
    # `rope.dimension_sections` (M-RoPE where the first two are set: llama_hparams::use_mrope), the `embedding_scale`,
    # `residual_scale` and `logit_scale` (granite, cohere2, command-r: a SCALE node where not 0) and
    # `rope.scaling.finetuned` (granite's switch for RoPE, true without the key)
    moe_layer_step: int = 0
    n_deepstack: int = 0
    attn_temp_scale: float = 0.0
    rope_sections: tuple[int, ...] = ()
    embedding_scale: float = 0.0
    residual_scale: float = 0.0
    logit_scale: float = 0.0
    rope_finetuned: bool = True
    skipped: tuple[TensorSpec, ...] = field(default=(), compare=False)  # TENSOR_SKIP: in the file, never loaded
    # The draft model llama-server loads beside this one (`-md`, its header read at the edge: `with_draft`), whose
    # buffers every estimate of a config with `-md` adds (fitter.memory.plan.estimator)
    draft: ModelSpec | None = None
    # The multimodal projector llama-server loads beside it (`--mmproj`, read at the edge: `with_projector`)
    projector: ProjectorSpec | None = None
    # What every command prints about this model ("fitter: warning: …"), e.g. an architecture fitter has not matched
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def n_params(self) -> int:
        total = 0
        for t in self.tensors:
            n = 1
            for d in t.ne:
                n *= d
            total += n
        return total

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    def n_embd_k_gqa(self, il: int) -> int:
        """llama_hparams::n_embd_k_gqa (src/llama-hparams.cpp)."""
        return self.head_dim_k * self.n_head_kv[il]

    def n_embd_v_gqa(self, il: int) -> int:
        return self.head_dim_v * self.n_head_kv[il]

    @property
    def use_mrope(self) -> bool:
        """llama_hparams::use_mrope: the first two M-RoPE sections set (glm4, glm4moe rope with ggml_rope_multi)."""
        return len(self.rope_sections) >= 2 and self.rope_sections[0] > 0 and self.rope_sections[1] > 0

    @property
    def n_layer_trunk(self) -> int:
        """llama_hparams::n_layer(): the layers the model's graph runs, NextN blocks left out."""
        return self.n_layer - self.n_layer_nextn

    def kv_layer(self, il: int) -> bool:
        """Whether layer il has a KV cache: a trunk layer that is not recurrent (llama_model::create_memory's
        filters), in a model with a KV cache at all."""
        if self.memory in (Memory.NONE, Memory.RECURRENT):
            return False
        if self.memory is Memory.HYBRID and self.attention_layers:
            return self.attention_layers[il]
        return il < self.n_layer_trunk

    def rs_layer(self, il: int) -> bool:
        """Whether layer il keeps recurrent state (llama_memory_recurrent)."""
        if self.memory is Memory.RECURRENT:
            return il < self.n_layer_trunk
        return self.memory is Memory.HYBRID and bool(self.recurrent_layers[il])


def tensor_role(name: str) -> tuple[int | None, Role]:
    """Block index and role of a tensor from its GGUF name, e.g. 'blk.3.ffn_up_exps.weight' → (3, EXPERT)."""
    m = _NAME_RE.match(name)
    if not m:
        return None, Role.OTHER
    layer = int(m.group("layer")) if m.group("layer") is not None else None
    return layer, _ROLE_BY_BASE.get(m.group("base"), Role.OTHER)


class _Keys:
    """Typed access to `{arch}.…` metadata with errors that name the file and key."""

    def __init__(self, header: GGUFHeader, arch: str) -> None:
        self.meta = header.metadata
        self.arch = arch
        self.path = header.path

    def _raw(self, key: str) -> Any:
        return self.meta.get(f"{self.arch}.{key}")

    def integer(self, key: str, default: int | None = None) -> int:
        value = self._raw(key)
        if value is None:
            if default is None:
                raise GGUFError(f"{self.path}: required key '{self.arch}.{key}' is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFError(f"{self.path}: key '{self.arch}.{key}' must be an integer, got {value!r}")
        return value

    def per_layer(self, key: str, n_layer: int, default: Sequence[int]) -> tuple[int, ...]:
        """llama_model_loader::get_key_or_arr: a scalar broadcasts, an array gives one value per layer."""
        value = self._raw(key)
        if value is None:
            return tuple(default)
        if isinstance(value, list):
            if len(value) != n_layer:
                raise GGUFError(
                    f"{self.path}: key '{self.arch}.{key}' has {len(value)} entries, expected one per layer ({n_layer})"
                )
            return tuple(int(v) for v in value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFError(f"{self.path}: key '{self.arch}.{key}' must be an integer or array, got {value!r}")
        return (value,) * n_layer


def _n_vocab(header: GGUFHeader, keys: _Keys) -> int:
    # llama.cpp's vocabulary size is the length of tokenizer.ggml.tokens (src/llama-vocab.cpp).
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, SkippedArray):
        return tokens.count
    if isinstance(tokens, list):
        return len(tokens)
    embd = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    return keys.integer("vocab_size", embd.ne[1] if embd is not None and len(embd.ne) > 1 else 0)


def _swa(keys: _Keys, rules: Arch | None, n_layer: int,
         attention_layers: tuple[bool, ...]) -> tuple[int, tuple[bool, ...]]:
    """The window and which layers use it, as the architecture's load_arch_hparams sets them: its row's
    load_swa_pattern (llama_model_base::load_swa_pattern, llama_hparams::set_swa_pattern), none without a row."""
    swa = rules.swa if rules else None
    found = keys._raw("attention.sliding_window")
    n_swa = keys.integer("attention.sliding_window", 0)
    none = (0, (False,) * n_layer)
    if swa is None or (swa.when in (SwaWhen.KEY, SwaWhen.ATTENTION) and n_swa <= 0):
        return none
    if swa.when is SwaWhen.ATTENTION:
        return n_swa, attention_layers
    if swa.when is SwaWhen.UNLESS_ZERO and found is not None and n_swa == 0:
        return none
    if swa.forced or (found is None and swa.n_swa):
        n_swa = swa.n_swa
    raw = keys._raw("attention.sliding_window_pattern")
    if isinstance(raw, list):
        if len(raw) != n_layer:
            raise GGUFError(f"{keys.path}: sliding_window_pattern has {len(raw)} entries, expected {n_layer}")
        layers = tuple(bool(v) for v in raw)
    elif swa.when is SwaWhen.ARRAY:
        raise GGUFError(f"{keys.path}: required key '{keys.arch}.attention.sliding_window_pattern' (an array, one "
                        f"value per layer) is missing")
    else:
        n_pattern = raw if isinstance(raw, int) and not isinstance(raw, bool) else swa.pattern
        if swa.dense_first:
            layers = tuple(n_pattern == 0 or il % n_pattern != 0 for il in range(n_layer))
        else:
            layers = tuple(n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(n_layer))
    return (n_swa, layers) if n_swa > 0 else none


def _hybrid_layers(keys: _Keys, rules: Arch | None, n_layer: int, n_trunk: int, n_head_kv: tuple[int, ...],
                   n_ff: tuple[int, ...]) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """A hybrid model's (recurrent, attention) layers, as its load_arch_hparams sets is_recr and create_memory's
    filters choose (fitter.gguf.archs.RecurrentBy); trunk layers only (a NextN block has neither). Empty for others."""
    if rules is None or rules.memory is not Memory.HYBRID or rules.recurrent is None:
        return (), ()
    by, trunk = rules.recurrent.by, range(n_layer)
    if by is RecurrentBy.INTERVAL:
        if keys._raw("attention.recurrent_layers") is not None:  # get_key_or_arr: a scalar for every layer
            recr = tuple(bool(v) for v in keys.per_layer("attention.recurrent_layers", n_layer, ()))
        else:
            interval = keys.integer("full_attention_interval", rules.recurrent.interval)
            recr = tuple((il + 1) % interval != 0 for il in trunk)
        attn = tuple(not r for r in recr)
    elif by is RecurrentBy.NO_KV_HEADS:
        recr = tuple(n_head_kv[il] == 0 for il in trunk)
        attn = tuple(not r for r in recr)
    elif by is RecurrentBy.NO_KV_HEADS_NOR_FFN:
        recr = tuple(n_head_kv[il] == 0 and n_ff[il] == 0 for il in trunk)
        attn = tuple(not recr[il] and n_ff[il] == 0 for il in trunk)
    else:
        recr = attn = (True,) * n_layer
    return (tuple(r and il < n_trunk for il, r in enumerate(recr)),
            tuple(a and il < n_trunk for il, a in enumerate(attn)))


_GLM_5_2_CONTEXT = 1048576  # glm-dsa: a training context this long is GLM-5.2's, with its default indexer layers


def _indexer_layers(keys: _Keys, rules: Arch | None, n_layer: int, n_trunk: int, n_ctx_train: int,
                    attention_layers: tuple[bool, ...]) -> tuple[bool, ...]:
    """Which layers keep a sparse-attention indexer key cache (fitter.gguf.archs.Indexer); empty for other models."""
    if rules is None or rules.indexer is None:
        return ()
    has_types = keys._raw("attention.indexer.types") is not None
    if has_types and rules.indexer in (Indexer.TYPES, Indexer.TYPES_OR_ALL):
        full = tuple(bool(v) for v in keys.per_layer("attention.indexer.types", n_trunk, ()))
    elif rules.indexer is Indexer.TYPES and n_ctx_train >= _GLM_5_2_CONTEXT:
        full = tuple(il < 2 or ((il - 2) % 4 == 0 and il < 102) for il in range(n_trunk))
    else:
        full = (True,) * n_trunk
    layers = full + (False,) * (n_layer - n_trunk)
    if attention_layers:  # a hybrid's indexer runs on its attention layers only
        layers = tuple(a and b for a, b in zip(layers, attention_layers, strict=True))
    return layers


def _indexer_width(keys: _Keys, rules: Arch | None) -> int:
    if rules is None or rules.indexer is None:
        return 0
    width = keys.integer("attention.indexer.key_length", 0)
    pooled = rules.memory is Memory.HYBRID and keys.integer("attention.indexer.kpool", 0) > 0
    return width * 3 if pooled else width


def _state_widths(keys: _Keys, rules: Arch | None, n_embd: int, n_head0: int, head_dim_k: int) -> tuple[int, int]:
    """llama_hparams::n_embd_r and n_embd_s (src/llama-hparams.cpp), in its order: short convolutions (LFM2,
    `shortconv.l_cache`), Kimi delta attention (`kda.head_dim`), lightning attention (the row's), else Mamba-style
    and gated-DeltaNet layers (the SSM keys)."""
    d_conv, d_inner = keys.integer("ssm.conv_kernel", 0), keys.integer("ssm.inner_size", 0)
    d_state, n_group = keys.integer("ssm.state_size", 0), keys.integer("ssm.group_count", 0)
    l_cache, kda = keys.integer("shortconv.l_cache", 0), keys.integer("kda.head_dim", 0)
    linear = rules is not None and rules.recurrent is not None and rules.recurrent.linear_attention
    if l_cache:
        conv = n_embd * (l_cache - 1)
    elif kda:
        conv = 3 * (d_conv - 1 if d_conv > 0 else 3) * n_head0 * kda  # conv state for Q, K and V
    else:
        conv = max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
    if kda:
        state = kda * kda * n_head0
    elif linear:
        state = head_dim_k * head_dim_k * n_head0
    else:
        state = d_state * d_inner
    return conv, state


def model_spec(header: GGUFHeader) -> ModelSpec:
    """Build the spec from a parsed header; an unknown architecture is a warning in the spec, never an error."""
    arch = header.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{header.path}: required key 'general.architecture' is missing or not a string")
    notes: list[str] = []
    rules = ARCHS.get(arch)
    if rules is None:
        notes.append(f"{header.path}: architecture {arch!r} has no memory rules in fitter (fitter.gguf.archs)")
    keys = _Keys(header, arch)
    n_layer = keys.integer("block_count")
    if not 0 < n_layer <= 512:  # LLAMA_MAX_LAYERS (src/llama-hparams.h)
        raise GGUFError(f"{header.path}: '{arch}.block_count' must be in 1..512, got {n_layer}")
    n_embd = keys.integer("embedding_length")
    n_head = keys.per_layer("attention.head_count", n_layer, (0,) * n_layer)
    n_head_kv = keys.per_layer("attention.head_count_kv", n_layer, n_head)
    n_head0 = n_head[0] if n_head else 0
    head_dim_k = keys.integer("attention.key_length", n_embd // n_head0 if n_head0 else 0)
    head_dim_v = keys.integer("attention.value_length", n_embd // n_head0 if n_head0 else 0)
    n_expert = keys.integer("expert_count", 0)
    n_expert_used = keys.integer("expert_used_count", 0)
    _check_experts(header, arch, n_expert, n_expert_used)
    n_ff = keys.per_layer("feed_forward_length", n_layer, (0,) * n_layer)
    n_nextn = keys.integer("nextn_predict_layers", 0)
    if not 0 <= n_nextn <= n_layer:  # llama_model_base::load_hparams's assert
        raise GGUFError(f"{header.path}: '{arch}.nextn_predict_layers' must be in 0..{n_layer} (block_count), "
                        f"got {n_nextn}")
    recurrent_layers, attention_layers = _hybrid_layers(keys, rules, n_layer, n_layer - n_nextn, n_head_kv, n_ff)
    n_swa, swa_layers = _swa(keys, rules, n_layer, attention_layers)
    # llama_hparams::is_mla: both MLA head sizes non-zero (llama.cpp's own saver writes every key, zeros included)
    head_k_mla, head_v_mla = keys.integer("attention.key_length_mla", 0), keys.integer("attention.value_length_mla", 0)
    is_mla = head_k_mla > 0 and head_v_mla > 0
    tensors = tuple(_tensor_spec(t) for t in header.tensors)
    skipped: tuple[TensorSpec, ...] = ()
    if rules is not None and rules.skips_nextn and n_nextn:
        # the NextN blocks' tensors are created with TENSOR_SKIP unless MTP drafting loads them (ml.load_mtp):
        # "model has unused tensor … -- ignoring" (llama_model_loader::create_tensor)
        skipped = tuple(t for t in tensors if t.layer is not None and t.layer >= n_layer - n_nextn)
        tensors = tuple(t for t in tensors if t.layer is None or t.layer < n_layer - n_nextn)
    r_width, s_width = _state_widths(keys, rules, n_embd, n_head0, head_dim_k)
    past = next((t for t in tensors if t.layer is not None and t.layer >= n_layer), None)
    if past is not None:  # llama.cpp loads blocks 0..n_layer-1 only, and refuses a file with tensors it did not load
        raise GGUFError(f"{header.path}: tensor {past.name!r} is in block {past.layer}, but '{arch}.block_count' is "
                        f"{n_layer} (llama_model_loader: wrong number of tensors)")
    return ModelSpec(
        path=str(header.path),
        arch=arch,
        identity=header.identity,
        n_shards=len(header.shards),
        shard_sizes=tuple(s.size for s in header.shards),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        n_ff=n_ff,
        n_ff_exp=keys.integer("expert_feed_forward_length", n_ff[0] if n_expert else 0),
        n_expert_shared=keys.integer("expert_shared_count", 0),
        n_ff_shexp=keys.integer("expert_shared_feed_forward_length", 0),
        n_layer_dense_lead=keys.integer("leading_dense_block_count", 0),
        n_swa=n_swa,
        swa_layers=swa_layers,
        is_mla=is_mla,
        head_dim_k_mla=head_k_mla,
        head_dim_v_mla=head_v_mla,
        kv_lora_rank=keys.integer("attention.kv_lora_rank", 0),
        q_lora_rank=keys.integer("attention.q_lora_rank", 0),
        n_rot=keys.integer("rope.dimension_count", head_dim_k),
        n_vocab=_n_vocab(header, keys),
        n_ctx_train=keys.integer("context_length"),
        expert_gating=keys.integer("expert_gating_func", 0),
        expert_weights_norm=bool(keys._raw("expert_weights_norm") or False),
        expert_weights_scale=float(keys._raw("expert_weights_scale") or 0.0),
        tensors=tensors,
        memory=rules.memory if rules else Memory.KV,
        n_layer_nextn=n_nextn,
        recurrent_layers=recurrent_layers,
        attention_layers=attention_layers,
        indexer_layers=_indexer_layers(keys, rules, n_layer, n_layer - n_nextn, keys.integer("context_length"),
                                       attention_layers),
        indexer_width=_indexer_width(keys, rules),
        n_embd_r=r_width,
        n_embd_s=s_width,
        final_logit_softcapping=float(keys._raw("final_logit_softcapping") or 0.0),
        ssm_d_conv=keys.integer("ssm.conv_kernel", 0),
        ssm_d_inner=keys.integer("ssm.inner_size", 0),
        ssm_d_state=keys.integer("ssm.state_size", 0),
        ssm_dt_rank=keys.integer("ssm.time_step_rank", 0),
        ssm_n_group=keys.integer("ssm.group_count", 0),
        moe_layer_step=keys.integer("interleave_moe_layer_step", 0),
        n_deepstack=keys.integer("n_deepstack_layers", 0),
        attn_temp_scale=float(keys._raw("attention.temperature_scale") or 0.0),
        rope_sections=tuple(keys.per_layer("rope.dimension_sections", 4, ())),  # get_key_or_arr, 4 entries
        embedding_scale=float(keys._raw("embedding_scale") or 0.0),
        residual_scale=float(keys._raw("residual_scale") or 0.0),
        logit_scale=float(keys._raw("logit_scale") or 0.0),
        rope_finetuned=bool(keys._raw("rope.scaling.finetuned") in (None, True)),
        skipped=skipped,
        warnings=tuple(notes),
    )


def _check_experts(header: GGUFHeader, arch: str, n_expert: int, n_expert_used: int) -> None:
    """llama_model_base::load_hparams's asserts (src/llama-model.cpp): at most LLAMA_MAX_EXPERTS (512) experts, and
    1..n_expert of them used per token, none without experts. A count past them would also size fitter's graph."""
    if not 0 <= n_expert <= 512:
        raise GGUFError(f"{header.path}: '{arch}.expert_count' must be in 0..512 (LLAMA_MAX_EXPERTS), got {n_expert}")
    lowest = 1 if n_expert else 0
    if not lowest <= n_expert_used <= n_expert:
        raise GGUFError(f"{header.path}: '{arch}.expert_used_count' must be in {lowest}..{n_expert} with "
                        f"{n_expert} experts, got {n_expert_used}")


def _tensor_spec(t: TensorInfo) -> TensorSpec:
    layer, role = tensor_role(t.name)
    return TensorSpec(t.name, t.type_name, t.ne, t.n_bytes, layer, role, t.shard, t.offset)


def load_model_spec(path: str, draft: str = "", mmproj: str = "") -> ModelSpec:
    """The model's spec from its header; with `draft` (-md's path) the draft model's spec rides along
    (ModelSpec.draft), with `mmproj` (--mmproj's) the projector's (ModelSpec.projector), so every estimate of a
    config with them counts their buffers."""
    from fitter.gguf.header import read_header

    spec = model_spec(read_header(path))
    spec = with_draft(spec, draft) if draft else spec
    return with_projector(spec, mmproj) if mmproj else spec


def with_draft(spec: ModelSpec, draft: str) -> ModelSpec:
    """`spec` with the draft model's spec riding along (`-md`'s path, its header read)."""
    from fitter.gguf.header import read_header

    try:
        draft_spec = model_spec(read_header(draft))
    except FitterError as e:  # name the flag: the path alone reads as the model's
        raise type(e)(f"-md {e}") from None
    return replace(spec, draft=draft_spec)
