"""The projector's spec from its header (fitter.gguf.projector): the warm-up image, the tokens an image takes and
the width it hands the text model, per projector type, as clip.cpp's load_hparams, clip_n_output_tokens and
clip_n_mmproj_embd give them for fitter's demo projectors."""

from __future__ import annotations

import pytest

from fitter.gguf.projector import load_projector_spec
from tests.models import projector_file

# shape -> (warm-up side, tokens per image, output width) for llama-tiny (n_embd 128)
EXPECTED = {
    "gemma3-l2": (224, 16, 128),  # image_size; (224/14/4)²
    "mlp-l3": (224, 256, 128),  # image_size; (224/14)²
    "qwen2vl-l2": (736, 2116, 128),  # set_warmup_n_tokens(46*46): 46·8·2; 46²
    "qwen3vl-l2": (736, 2116, 128),  # mm.2's 64 × (1 + one deepstack layer)
    "pixtral-l2": (256, 271, 128),  # set_warmup_n_tokens(256): 16·8·2; 16² + 15 [IMG_BREAK] rows
    "pixtral12b-l2": (128, 271, 128),  # no merge size: 16·8·1; 16² + 15
    "llama4-l2": (224, 64, 128),  # image_size; (224/14/2)²
    "glm4v-l2": (736, 2116, 128),  # set_warmup_n_tokens(46*46); mm.down's rows
}


@pytest.mark.parametrize("shape", sorted(EXPECTED))
def test_warm_up_tokens_and_width_per_projector_type(shape: str) -> None:
    spec = load_projector_spec(str(projector_file(shape, "llama-tiny")))
    assert (spec.warmup_image_size, spec.tokens_per_image, spec.n_mmproj_embd) == EXPECTED[shape]


def test_qwen3vls_width_counts_its_deepstack_layers() -> None:
    """clip_n_mmproj_embd: the merger's mm.2 hands 64, the deepstack layer another 64."""
    spec = load_projector_spec(str(projector_file("qwen3vl-l2", "llama-tiny")))
    bias = spec.tensor("mm.2.bias")
    assert bias is not None and bias.ne == (64,)
    assert spec.tensor("v.deepstack.0.fc2.bias") is not None and spec.n_mmproj_embd == 2 * 64
