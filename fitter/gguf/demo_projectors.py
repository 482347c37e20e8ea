"""Small vision projectors (`--mmproj`) for fitter's demo and tiny models: random but valid GGUFs that libmtmd
loads and encodes with (tools/mtmd/clip.cpp), written with the gguf package as llama.cpp's converter writes them
(conversion/base.py MmprojModel, conversion/gemma.py Gemma3VisionModel: general.architecture "clip", general.type
"mmproj", the clip.vision.* keys, F16 matrices and F32 norms and biases).

Projector types: `gemma3` (a SigLIP encoder, its patches average-pooled n_merge × n_merge, an RMS norm and an
input projection: Gemma 3's), `mlp` (a CLIP encoder whose second-to-last layer feeds a two-layer MLP: LLaVA's) and
the Qwen2-VL and Qwen2.5-VL mergers (two patch kernels, M-RoPE, 2.5's RMS norms, gated SiLU FFN and window
attention, a 2×2 merger MLP: conversion/qwen.py's layout), the Qwen3-VL merger (a fused QKV, a learned position
table, a deepstack layer), Pixtral with Mistral Small 3.x's patch merger, Llama 4's encoder and GLM-4.5V's.
Each projects to the text model's n_embd, so it belongs to that model; heads of 64 keep CUDA's flash attention on
(one shape has heads of 48, which CUDA's flash attention lacks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_STD = 0.02


@dataclass(frozen=True)
class ProjectorShape:
    name: str
    projector_type: str  # clip.projector_type: gemma3 | mlp | qwen2vl_merger | … | glm4v
    n_embd: int = 128
    n_ff: int = 320  # != n_embd: clip.cpp swaps ffn up/down when ffn_down's rows equal n_embd
    n_layer: int = 2
    n_head: int = 2
    image_size: int = 224
    patch_size: int = 14
    n_merge: int = 4  # gemma3's pooling kernel
    n_wa_pattern: int = 0  # Qwen2.5-VL's full-attention period
    n_deepstack: int = 0  # Qwen3-VL: layers 0 … n_deepstack-1 feed deepstack mergers


PROJECTORS: dict[str, ProjectorShape] = {
    s.name: s for s in (
        ProjectorShape("gemma3-l2", "gemma3"),
        ProjectorShape("gemma3-l4-448", "gemma3", n_embd=256, n_ff=640, n_layer=4, n_head=4, image_size=448),
        ProjectorShape("mlp-l3", "mlp", n_layer=3),
        # heads of 48: CUDA has no flash-attention kernel for them, so -fa auto reserves twice (clip.cpp warmup)
        ProjectorShape("gemma3-d48", "gemma3", n_embd=96, n_ff=240, n_head=2),
        ProjectorShape("qwen2vl-l2", "qwen2vl_merger", n_embd=64, n_ff=160, n_head=1, patch_size=8, n_merge=2),
        ProjectorShape("qwen25vl-l2", "qwen2.5vl_merger", n_embd=64, n_ff=160, n_head=1, patch_size=8, n_merge=2,
                       n_wa_pattern=2),
        # one deepstack layer: the merger and it hand half the text model's width each
        ProjectorShape("qwen3vl-l2", "qwen3vl_merger", n_embd=64, n_ff=160, n_head=1, patch_size=8, n_merge=2,
                       n_deepstack=1),
        # Mistral Small 3.x's: the 2×2 patch merger
        ProjectorShape("pixtral-l2", "pixtral", n_head=2, patch_size=8, n_merge=2),
        ProjectorShape("pixtral12b-l2", "pixtral", n_head=2, patch_size=8, n_merge=1),  # Pixtral 12B: no merger
        ProjectorShape("llama4-l2", "llama4", n_head=2, n_merge=2),
        ProjectorShape("glm4v-l2", "glm4v", n_embd=64, n_ff=160, n_head=1, patch_size=8, n_merge=2),
    )
}


def write_projector(shape: ProjectorShape, text_n_embd: int, path: Path, seed: int = 0) -> Path:
    """A projector of `shape` for a text model of `text_n_embd` (its llama_model_n_embd_inp)."""
    rng = np.random.default_rng(seed)
    e, f, p = shape.n_embd, shape.n_ff, shape.patch_size
    n_patches = (shape.image_size // p) ** 2

    def mat(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims) * _STD).astype(np.float16)

    def vec(n: int, ones: bool = False) -> np.ndarray:
        return np.ones(n, np.float32) if ones else (rng.standard_normal(n) * _STD).astype(np.float32)

    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(shape.projector_type)
    w.add_vision_embedding_length(e)
    w.add_vision_feed_forward_length(f)
    w.add_vision_block_count(shape.n_layer)
    w.add_vision_head_count(shape.n_head)
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_projection_dim(text_n_embd)
    w.add_vision_image_size(shape.image_size)
    w.add_vision_patch_size(p)
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    if shape.projector_type not in ("qwen2.5vl_merger", "pixtral", "glm4v"):  # theirs are SiLU-gated (use_silu below)
        w.add_vision_use_gelu(True)
    if shape.projector_type in ("gemma3", "llama4"):
        w.add_vision_projector_scale_factor(shape.n_merge)
    if shape.projector_type == "qwen3vl_merger":
        _qwen3vl(w, shape, text_n_embd, mat, vec)
        return _close(w, path)
    if shape.projector_type == "pixtral":
        _pixtral(w, shape, text_n_embd, mat, vec)
        return _close(w, path)
    if shape.projector_type == "llama4":
        _llama4(w, shape, text_n_embd, mat, vec)
        return _close(w, path)
    if shape.projector_type == "glm4v":
        _glm4v(w, shape, text_n_embd, mat, vec)
        return _close(w, path)
    if shape.projector_type.startswith("qwen"):
        _qwen(w, shape, text_n_embd, mat, vec)
        return _close(w, path)
    w.add_tensor("v.patch_embd.weight", mat(e, 3, p, p))
    w.add_tensor("v.patch_embd.bias", vec(e))
    w.add_tensor("v.position_embd.weight", (rng.standard_normal((n_patches, e)) * _STD).astype(np.float32))
    _encoder_layers(w, shape, mat, vec)
    if shape.projector_type == "gemma3":
        w.add_tensor("v.post_ln.weight", vec(e, ones=True))
        w.add_tensor("v.post_ln.bias", vec(e))
        w.add_tensor("mm.input_projection.weight", mat(e, text_n_embd))
        w.add_tensor("mm.soft_emb_norm.weight", vec(e, ones=True))
    else:  # LLaVA's MLP: mm.0 (n_embd → hidden), GELU, mm.2 (hidden → the text model's n_embd)
        w.add_tensor("mm.0.weight", mat(text_n_embd, e))
        w.add_tensor("mm.0.bias", vec(text_n_embd))
        w.add_tensor("mm.2.weight", mat(text_n_embd, text_n_embd))
        w.add_tensor("mm.2.bias", vec(text_n_embd))
    return _close(w, path)


def _encoder_layers(w: gguf.GGUFWriter, shape: ProjectorShape, mat: Any, vec: Any, *, fused: bool = False,
                    biases: bool = True, norm_bias: bool = True, ffn: tuple[str, ...] = ("ffn_up",)) -> None:
    """Every encoder layer's tensors as clip.cpp load_tensors names them, in the order each writer drew them:
    q/k/v/out (or a fused qkv and out), ln1/ln2, the FFN's up (and gate) in `ffn`'s order, then down."""
    e, f = shape.n_embd, shape.n_ff
    for i in range(shape.n_layer):
        attn = (("attn_qkv", 3 * e), ("attn_out", e)) if fused else tuple((n, e) for n in ("attn_q", "attn_k",
                                                                                             "attn_v", "attn_out"))
        for name, rows in attn:
            w.add_tensor(f"v.blk.{i}.{name}.weight", mat(rows, e))
            if biases:
                w.add_tensor(f"v.blk.{i}.{name}.bias", vec(rows))
        for name in ("ln1", "ln2"):
            w.add_tensor(f"v.blk.{i}.{name}.weight", vec(e, ones=True))
            if norm_bias:
                w.add_tensor(f"v.blk.{i}.{name}.bias", vec(e))
        for name in ffn:
            w.add_tensor(f"v.blk.{i}.{name}.weight", mat(f, e))
            if biases:
                w.add_tensor(f"v.blk.{i}.{name}.bias", vec(f))
        w.add_tensor(f"v.blk.{i}.ffn_down.weight", mat(e, f))
        if biases:
            w.add_tensor(f"v.blk.{i}.ffn_down.bias", vec(e))


def _close(w: gguf.GGUFWriter, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _qwen(w: gguf.GGUFWriter, shape: ProjectorShape, text_n_embd: int, mat: Any, vec: Any) -> None:
    """A Qwen-VL merger's keys and tensors (clip.cpp load_tensors: the second patch kernel, q/k/v biases, no patch
    bias or position embedding; 2.5: RMS norms without bias, a gated FFN, n_wa_pattern)."""
    e, p = shape.n_embd, shape.patch_size
    v25 = shape.projector_type == "qwen2.5vl_merger"
    w.add_vision_spatial_merge_size(shape.n_merge)
    if v25:
        w.add_vision_n_wa_pattern(shape.n_wa_pattern)
        w.add_vision_use_silu(True)
    w.add_tensor("v.patch_embd.weight", mat(e, 3, p, p))
    w.add_tensor("v.patch_embd.weight.1", mat(e, 3, p, p))
    _encoder_layers(w, shape, mat, vec, norm_bias=not v25, ffn=("ffn_up", "ffn_gate") if v25 else ("ffn_up",))
    w.add_tensor("v.post_ln.weight", vec(e, ones=True))
    if not v25:
        w.add_tensor("v.post_ln.bias", vec(e))
    hidden = 4 * e
    w.add_tensor("mm.0.weight", mat(hidden, 4 * e))
    w.add_tensor("mm.0.bias", vec(hidden))
    w.add_tensor("mm.2.weight", mat(text_n_embd, hidden))
    w.add_tensor("mm.2.bias", vec(text_n_embd))


def _qwen3vl(w: gguf.GGUFWriter, shape: ProjectorShape, text_n_embd: int, mat: Any, vec: Any) -> None:
    """Qwen3-VL's merger (conversion/qwen.py Qwen3VLVisionModel, clip.cpp load_tensors and models/qwen3vl.cpp's
    asserts): two patch kernels and the patch bias, a learned position table, a fused QKV, LayerNorms with bias,
    a GELU FFN, the merger MLP and deepstack mergers whose outputs are concatenated: each hands
    text_n_embd / (1 + n_deepstack) (clip.cpp clip_n_mmproj_embd)."""
    e, p = shape.n_embd, shape.patch_size
    out = text_n_embd // (1 + shape.n_deepstack)
    w.add_vision_spatial_merge_size(shape.n_merge)
    w.add_tensor("v.patch_embd.weight", mat(e, 3, p, p))
    w.add_tensor("v.patch_embd.weight.1", mat(e, 3, p, p))
    w.add_tensor("v.patch_embd.bias", vec(e))
    w.add_tensor("v.position_embd.weight", vec((shape.image_size // p) ** 2 * e).reshape(-1, e))
    _encoder_layers(w, shape, mat, vec, fused=True)
    w.add_tensor("v.post_ln.weight", vec(e, ones=True))
    w.add_tensor("v.post_ln.bias", vec(e))
    merged = shape.n_merge ** 2 * e
    for prefix in ("mm", *(f"v.deepstack.{i}" for i in range(shape.n_deepstack))):
        if prefix != "mm":
            w.add_tensor(f"{prefix}.norm.weight", vec(merged, ones=True))
            w.add_tensor(f"{prefix}.norm.bias", vec(merged))
        first, second = ("mm.0", "mm.2") if prefix == "mm" else (f"{prefix}.fc1", f"{prefix}.fc2")
        w.add_tensor(f"{first}.weight", mat(merged, merged))
        w.add_tensor(f"{first}.bias", vec(merged))
        w.add_tensor(f"{second}.weight", mat(out, merged))
        w.add_tensor(f"{second}.bias", vec(out))


def _pixtral(w: gguf.GGUFWriter, shape: ProjectorShape, text_n_embd: int, mat: Any, vec: Any) -> None:
    """Pixtral with Mistral Small 3.x's patch merger (conversion/mistral.py, clip.cpp load_tensors): no biases in
    the encoder, RMS norms, a SiLU-gated FFN, the merger's input norm and matrix, the LLaVA MLP mm.1 / mm.2 and the
    [IMG_BREAK] token's embedding."""
    e, p, m = shape.n_embd, shape.patch_size, shape.n_merge
    if m > 1:  # Pixtral 12B's file has no merge size (clip.cpp's default: 1) and no merger
        w.add_vision_spatial_merge_size(m)
    w.add_vision_use_silu(True)
    w.add_tensor("v.patch_embd.weight", mat(e, 3, p, p))
    w.add_tensor("v.pre_ln.weight", vec(e, ones=True))
    _encoder_layers(w, shape, mat, vec, biases=False, norm_bias=False, ffn=("ffn_gate", "ffn_up"))
    if m > 1:
        w.add_tensor("mm.input_norm.weight", vec(e, ones=True))
        w.add_tensor("mm.patch_merger.weight", mat(e, e * m * m))
    w.add_tensor("mm.1.weight", mat(text_n_embd, e))
    w.add_tensor("mm.1.bias", vec(text_n_embd))
    w.add_tensor("mm.2.weight", mat(text_n_embd, text_n_embd))
    w.add_tensor("mm.2.bias", vec(text_n_embd))
    w.add_tensor("v.token_embd.img_break", vec(text_n_embd))


def _llama4(w: gguf.GGUFWriter, shape: ProjectorShape, text_n_embd: int, mat: Any, vec: Any) -> None:
    """Llama 4's vision encoder (conversion/llama.py Llama4VisionModel, clip.cpp load_tensors): the patch
    convolution as a [3·p², n_embd] matrix, the [CLS] row and a learned position per patch and for it, LayerNorms
    and projections with biases, a GELU FFN, the adapter MLP mm.model.mlp.1 / .2 and the projection mm.model.fc
    (no biases)."""
    e, p, m = shape.n_embd, shape.patch_size, shape.n_merge
    n_pos = (shape.image_size // p) ** 2 + 1
    w.add_tensor("v.patch_embd.weight", mat(e, 3 * p * p))
    w.add_tensor("v.class_embd", vec(e))
    w.add_tensor("v.position_embd.weight", vec(n_pos * e).reshape(n_pos, e))
    _encoder_layers(w, shape, mat, vec)
    for name in ("pre_ln", "post_ln"):
        w.add_tensor(f"v.{name}.weight", vec(e, ones=True))
        w.add_tensor(f"v.{name}.bias", vec(e))
    hidden = 2 * e
    w.add_tensor("mm.model.mlp.1.weight", mat(hidden, e * m * m))
    w.add_tensor("mm.model.mlp.2.weight", mat(hidden, hidden))
    w.add_tensor("mm.model.fc.weight", mat(text_n_embd, hidden))


def _glm4v(w: gguf.GGUFWriter, shape: ProjectorShape, text_n_embd: int, mat: Any, vec: Any) -> None:
    """GLM-4.5V / 4.6V's encoder (conversion/qwen3vl.py Glm4VVisionModel, clip.cpp load_tensors and
    models/glm4v.cpp's asserts): two patch kernels and the patch bias, the post-conv RMS norm, a learned position
    table, a fused QKV and RMS norms without biases, a SiLU-gated FFN, the merger's convolution (n_merge² patches to
    the text width) with its bias, the FC projector mm.model.fc with its LayerNorm mm.post_norm and the gated FFN
    projector mm.gate / mm.up / mm.down."""
    e, p, m, t = shape.n_embd, shape.patch_size, shape.n_merge, text_n_embd
    w.add_vision_use_silu(True)
    w.add_tensor("v.patch_embd.weight", mat(e, 3, p, p))
    w.add_tensor("v.patch_embd.weight.1", mat(e, 3, p, p))
    w.add_tensor("v.patch_embd.bias", vec(e))
    w.add_tensor("v.norm_embd.weight", vec(e, ones=True))
    w.add_tensor("v.position_embd.weight", vec((shape.image_size // p) ** 2 * e).reshape(-1, e))
    _encoder_layers(w, shape, mat, vec, fused=True, biases=False, norm_bias=False, ffn=("ffn_gate", "ffn_up"))
    w.add_tensor("v.post_ln.weight", vec(e, ones=True))
    w.add_tensor("mm.patch_merger.weight", mat(t, e, m, m))
    w.add_tensor("mm.patch_merger.bias", vec(t))
    w.add_tensor("mm.model.fc.weight", mat(t, t))
    w.add_tensor("mm.post_norm.weight", vec(t, ones=True))
    w.add_tensor("mm.post_norm.bias", vec(t))
    for name in ("mm.gate", "mm.up"):
        w.add_tensor(f"{name}.weight", mat(2 * t, t))
    w.add_tensor("mm.down.weight", mat(t, 2 * t))
