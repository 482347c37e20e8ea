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
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from fitter.errors import FitterError
from fitter.gguf.shapes import GENERATED_TYPES, MERGES, SHAPES, ModelShape, ShapeTensor
from fitter.paths import fitter_home

__all__ = ["DEMO_FILENAME", "SHAPES", "ModelShape", "ShapeTensor", "demo_model_path", "shard_paths", "write_model"]

DEMO_FILENAME = "fitter-demo-gpt-oss.gguf"
_WEIGHT_STD = 0.02  # GPT-2-style init scale: keeps activations and logits finite through RMS norms
_BIAS_STD = 0.01
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
    tokens = _byte_chars() + [a + b for a, b in MERGES]
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    eos = len(tokens)
    tokens.append(_EOS)
    types.append(int(gguf.TokenType.CONTROL))
    pad = n_vocab - len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.UNUSED)] * pad
    return tokens, types, [f"{a} {b}" for a, b in MERGES], eos


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
    w.add_block_count(s.n_layer + s.n_nextn)
    if s.n_nextn:
        w.add_nextn_predict_layers(s.n_nextn)
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
    if s.arch == "qwen3next":
        w.add_expert_shared_feed_forward_length(s.n_ff_shexp)
        w.add_ssm_conv_kernel(s.ssm_d_conv)
        w.add_ssm_inner_size(s.ssm_d_state * s.ssm_dt_rank)
        w.add_ssm_state_size(s.ssm_d_state)
        w.add_ssm_group_count(s.ssm_n_group)
        w.add_ssm_time_step_rank(s.ssm_dt_rank)
        w.add_full_attention_interval(s.full_attention_interval)
    if s.arch == "llama4":
        w.add_interleave_moe_layer_step(1)  # every layer has experts (Scout)
    if s.arch == "glm4moe":
        w.add_leading_dense_block_count(s.n_leading_dense)
        w.add_expert_shared_count(s.n_expert_shared)
        w.add_expert_weights_scale(1.0)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if s.arch == "minimax-m2":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if s.sliding_window:
        # No sliding_window_pattern key: the architecture's default period (gpt-oss 2, gemma3 6; fitter.gguf.archs).
        w.add_sliding_window(s.sliding_window)
    tokens, types, merges, eos = _vocab(s.n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)


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


def _tensor_data(t: ShapeTensor, seed: int) -> npt.NDArray[Any]:
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


def shard_paths(path: Path, n_shards: int) -> list[Path]:
    """llama.cpp's split names (``llama_split_path``): ``<stem>-00001-of-0000N.gguf``; one shard: ``path``."""
    if n_shards <= 1:
        return [path]
    stem = path.name[: -len(".gguf")] if path.name.endswith(".gguf") else path.name
    return [path.with_name(f"{stem}-{i + 1:05d}-of-{n_shards:05d}.gguf") for i in range(n_shards)]


def _split_tensors(specs: list[ShapeTensor], n_shards: int) -> list[list[ShapeTensor]]:
    """Consecutive runs of about equal bytes, each non-empty (gguf-split refuses empty shards)."""
    total = sum(t.nbytes for t in specs)
    shards: list[list[ShapeTensor]] = [[] for _ in range(n_shards)]
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
    specs: list[ShapeTensor],
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
