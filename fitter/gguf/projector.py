"""A multimodal projector's spec (`--mmproj FILE`): the hyperparameters and tensors libmtmd's clip context reads
from a projector GGUF (tools/mtmd/clip.cpp `clip_model_loader`, `load_hparams`, `load_tensors`), from its header.

Keys are clip's (`clip.vision.*`, tools/mtmd/clip-impl.h); defaults follow `load_hparams`: head_count_kv defaults
to head_count, head_dim to n_embd / n_head, the merge factor to 4 for gemma3 (1 for idefics3, llama4 and pixtral,
2 for the Qwen-VL mergers and glm4v; pixtral, glm4v and the Qwen-VL mergers read clip.vision.spatial_merge_size,
the others clip.vision.projector.scale_factor), the feed-forward op to gelu_quick unless `clip.use_gelu` /
`clip.use_silu` say otherwise. The vision encoder's tensors are the `v.*` and `mm.*` ones (an audio encoder's `a.*`
and `mm.a.*` live in a clip context of their own, which fitter does not estimate: said in the spec's warnings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fitter.errors import GGUFError
from fitter.gguf.header import GGUFHeader, read_header

if TYPE_CHECKING:
    from fitter.gguf.model_spec import ModelSpec


@dataclass(frozen=True)
class ProjectorTensor:
    name: str
    type: str  # ggml type name
    ne: tuple[int, ...]  # ggml order
    n_bytes: int


@dataclass(frozen=True)
class ProjectorSpec:
    path: str
    projector_type: str  # clip.projector_type: gemma3, mlp, qwen2vl_merger, ...
    n_embd: int
    n_head: int
    n_head_kv: int
    d_head: int
    n_ff: int
    n_layer: int
    image_size: int
    patch_size: int
    n_merge: int  # gemma3's pooling kernel, idefics3's/llama4's shuffle, the Qwen-VL mergers' spatial merge
    eps: float
    ffn_op: str  # gelu | silu | gelu_quick
    n_mmproj_embd: int  # clip_n_mmproj_embd: the width of what it hands the text model
    tensors: tuple[ProjectorTensor, ...]  # the vision encoder's, in file order
    has_audio: bool = False
    n_wa_pattern: int = 0  # Qwen2.5-VL: every n-th layer attends fully, the others within windows (0: all fully)
    warnings: tuple[str, ...] = ()

    def tensor(self, name: str) -> ProjectorTensor | None:
        return next((t for t in self.tensors if t.name == name), None)

    @property
    def warmup_image_size(self) -> int:
        """The side of the one image clip's warm-up reserves its compute buffers with (clip.cpp `load_hparams`,
        `warmup_image_size`): `set_warmup_n_tokens(n*n)` makes it n merged patches (46 for the Qwen-VL mergers and
        GLM-4V, 16 for Pixtral), the others' is image_size."""
        side = _WARMUP_TOKENS_SIDE.get(self.projector_type)
        if side is not None:
            return side * self.patch_size * self.n_merge
        return self.image_size

    @property
    def tokens_per_image(self) -> int:
        """The KV cells one image takes in the context (clip.cpp `clip_n_output_tokens` for the warm-up's image):
        fixed for gemma3 ((image/patch/merge)²) and mlp ((image/patch)²); the Qwen-VL mergers' grow with the image,
        the warm-up's 46² is a large one."""
        side = self.warmup_image_size // self.patch_size
        if self.projector_type in ("gemma3", "idefics3", "llama4"):
            return (side // self.n_merge) ** 2
        if self.projector_type in (*QWEN_MERGERS, "glm4v"):  # two convolutions: a token per 2×2 patches
            return (side // 2) ** 2
        if self.projector_type == "pixtral":  # one [IMG_BREAK] per row but the last (it requires the token)
            rows = side // self.n_merge
            return rows * rows + rows - 1
        return side * side


QWEN_MERGERS = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")
# clip.cpp `load_hparams`: the merge factor's default per projector type (clip.vision.projector.scale_factor or
# clip.vision.spatial_merge_size when the file has it)
_MERGE_DEFAULT = {"gemma3": 4, "idefics3": 1, "llama4": 1, "pixtral": 1, "glm4v": 2, **dict.fromkeys(QWEN_MERGERS, 2)}
# the types whose merge factor is clip.vision.spatial_merge_size (the others': clip.vision.projector.scale_factor)
_SPATIAL_MERGE = (*QWEN_MERGERS, "pixtral", "glm4v")
# clip.cpp load_hparams' set_warmup_n_tokens(n*n) per projector type: n
_WARMUP_TOKENS_SIDE = {**dict.fromkeys(QWEN_MERGERS, 46), "glm4v": 46, "pixtral": 16}


def _key(meta: Any, path: str, name: str, default: Any = None) -> Any:
    value = meta.get(name, default)
    if value is None:
        raise GGUFError(f"{path}: the projector has no '{name}' (clip.cpp load_hparams requires it)")
    return value


def _n_mmproj_embd(ptype: str, tensors: dict[str, ProjectorTensor], projection_dim: int, n_layer: int) -> int:
    """clip.cpp `clip_n_mmproj_embd`, for the projector types whose output width a tensor gives; Qwen3-VL's is the
    merger's times 1 + its deepstack layers (load_tensors counts the layers below n_layer with a deepstack fc1)."""
    by = {"gemma3": ("mm.input_projection.weight", 0), "mlp": ("mm.2.weight", 1),
          "pixtral": ("mm.2.weight", 1), "glm4v": ("mm.down.weight", 1),
          "idefics3": ("mm.model.fc.weight", 1), "llama4": ("mm.model.fc.weight", 1),
          **{t: ("mm.2.bias", 0) for t in QWEN_MERGERS}}
    if ptype in by:
        name, axis = by[ptype]
        t = tensors.get(name)
        if t is None:
            raise GGUFError(f"{name}: a {ptype} projector needs it (clip.cpp load_tensors)")
        if ptype == "qwen3vl_merger":
            return t.ne[axis] * (1 + sum(f"v.deepstack.{il}.fc1.weight" in tensors for il in range(n_layer)))
        return t.ne[axis]
    return projection_dim


def projector_spec(header: GGUFHeader) -> ProjectorSpec:
    meta, path = header.metadata, str(header.path)
    if not meta.get("clip.has_vision_encoder", False):
        if meta.get("clip.has_audio_encoder", False):
            raise GGUFError(f"{path}: an audio-only projector; fitter estimates vision projectors only")
        raise GGUFError(f"{path}: not a vision projector (clip.has_vision_encoder is not set: clip.cpp "
                        "'Failed to load CLIP model')")
    ptype = str(meta.get("clip.vision.projector_type", meta.get("clip.projector_type", "")))
    if not ptype:
        raise GGUFError(f"{path}: the projector has no clip.projector_type (clip.cpp: unknown projector type)")
    n_embd = int(_key(meta, path, "clip.vision.embedding_length"))
    n_head = int(_key(meta, path, "clip.vision.attention.head_count"))
    tensors = tuple(ProjectorTensor(t.name, t.type_name, t.ne, t.n_bytes) for t in header.tensors
                    if t.name.startswith(("v.", "mm.")) and not t.name.startswith("mm.a."))
    by_name = {t.name: t for t in tensors}
    merge_key = "clip.vision.spatial_merge_size" if ptype in _SPATIAL_MERGE else "clip.vision.projector.scale_factor"
    use_gelu, use_silu = bool(meta.get("clip.use_gelu", False)), bool(meta.get("clip.use_silu", False))
    if use_gelu and use_silu:  # clip.cpp load_hparams refuses the file
        raise GGUFError(f"{path}: both clip.use_gelu and clip.use_silu are set (clip.cpp load_hparams refuses it)")
    n_layer = int(_key(meta, path, "clip.vision.block_count"))
    image_size = int(_key(meta, path, "clip.vision.image_size"))
    patch_size = int(_key(meta, path, "clip.vision.patch_size"))
    if not 0 < patch_size < 65536 or not 0 <= image_size <= 8192:  # clip.cpp load_hparams' sanity checks
        raise GGUFError(f"{path}: image_size {image_size} / patch_size {patch_size} out of clip.cpp's ranges")
    spec = ProjectorSpec(
        path=path,
        projector_type=ptype,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(meta.get("clip.vision.attention.head_count_kv", n_head)),
        d_head=int(meta.get("clip.vision.attention.head_dim", n_embd // n_head if n_head else 0)),
        n_ff=int(_key(meta, path, "clip.vision.feed_forward_length")),
        n_layer=n_layer,
        image_size=image_size,
        patch_size=patch_size,
        n_merge=int(meta.get(merge_key, _MERGE_DEFAULT.get(ptype, 1))),
        eps=float(_key(meta, path, "clip.vision.attention.layer_norm_epsilon")),
        ffn_op="gelu" if use_gelu else "silu" if use_silu else "gelu_quick",
        n_mmproj_embd=_n_mmproj_embd(ptype, by_name, int(meta.get("clip.vision.projection_dim", 0)),
                                     n_layer),
        tensors=tensors,
        has_audio=bool(meta.get("clip.has_audio_encoder", False)),
        n_wa_pattern=int(meta.get("clip.vision.n_wa_pattern", 0)),
    )
    notes = []
    if spec.has_audio:
        notes.append(f"{path}: its audio encoder (a clip context of its own) is not estimated")
    if ptype == "gemma3" and math.isqrt(spec.tokens_per_image) ** 2 != spec.tokens_per_image:
        notes.append(f"{path}: image_size / patch_size is not a multiple of the merge factor {spec.n_merge}")
    return spec if not notes else ProjectorSpec(**{**spec.__dict__, "warnings": tuple(notes)})


def load_projector_spec(path: str) -> ProjectorSpec:
    """The projector's spec from its header (`--mmproj FILE`), the flag named in any error."""
    try:
        return projector_spec(read_header(path))
    except GGUFError as e:
        raise GGUFError(f"--mmproj {e}") from None


def with_projector(spec: ModelSpec, mmproj: str) -> ModelSpec:
    """`spec` with the projector's spec riding along; one that does not belong to the model is refused as libmtmd
    refuses it (tools/mtmd/mtmd.cpp mtmd_context: its output width against llama_model_n_embd_inp)."""
    projector = load_projector_spec(mmproj)
    n_embd_inp = spec.n_embd * (1 + spec.n_deepstack)  # src/llama-hparams.cpp n_embd_inp
    if projector.n_mmproj_embd != n_embd_inp:
        raise GGUFError(f"--mmproj {mmproj}: the projector hands the text model {projector.n_mmproj_embd}-wide "
                        f"embeddings and {spec.arch} takes {n_embd_inp} (libmtmd: mismatch between text model and "
                        "mmproj; a projector made for another model)")
    return replace(spec, projector=projector)
