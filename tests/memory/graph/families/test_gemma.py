"""fitter.memory.graph.families.gemma against llama.cpp's own graphs of its tiny Gemma models (tests/golden/archs.json):
the node order decides ggml-alloc's peaks, so every non-view node is checked, by index, op and size."""

from __future__ import annotations

from pathlib import Path

import pytest

from fitter.memory.graph.builder import TIED_OUTPUT, BackendMap, Builder, GraphParams
from fitter.memory.graph.graphs import build
from tests.memory.plan.test_arch_goldens import models, spec_of  # noqa: F401 (the fixture)

# `index:op:KiB` of every non-view node of the 256-token prompt graph (one output, n_kv 256, F16 caches) as
# llama.cpp 0c1e570 printed it: llama-server -c 256 -np 1 -ngl 0 -v with GGML_SCHED_DEBUG=2 (ggml_op_desc's GEGLU
# and TANH are fitter's GLU and UNARY)
LLAMA_CPP = {
    ("gemma-dense", False): (
    "0:GET_ROWS:256 1:SCALE:256 2:RMS_NORM:256 3:MUL:256 4:MUL_MAT:256 5:MUL:256 6:ADD:256 8:ROPE:256 "
    "9:SCALE:256 10:MUL_MAT:256 11:MUL:256 12:ADD:256 14:MUL_MAT:256 15:MUL:256 16:ADD:256 18:ROPE:256 "
    "20:SET_ROWS:128 24:SET_ROWS:128 31:MUL_MAT:512 32:SOFT_MAX:512 33:MUL_MAT:256 35:CONT:256 36:MUL_MAT:256 "
    "37:MUL:256 38:ADD:256 39:RMS_NORM:256 40:MUL:256 41:MUL_MAT:384 42:MUL_MAT:384 43:GLU:384 44:MUL_MAT:256 "
    "45:ADD:256 46:RMS_NORM:256 47:MUL:256 48:MUL_MAT:256 49:MUL:256 50:ADD:256 52:ROPE:256 53:SCALE:256 "
    "54:MUL_MAT:256 55:MUL:256 56:ADD:256 58:MUL_MAT:256 59:MUL:256 60:ADD:256 62:ROPE:256 64:SET_ROWS:128 "
    "68:SET_ROWS:128 75:MUL_MAT:512 76:SOFT_MAX:512 77:MUL_MAT:256 79:CONT:256 80:MUL_MAT:256 81:MUL:256 "
    "82:GET_ROWS:1 83:GET_ROWS:1 84:ADD:1 85:RMS_NORM:1 86:MUL:1 87:MUL_MAT:1 88:MUL_MAT:1 89:GLU:1 "
    "90:MUL_MAT:1 91:ADD:1 92:RMS_NORM:1 93:MUL:1 94:MUL_MAT:0 "
    ),
    ("gemma2-dense", False): (
    "0:GET_ROWS:256 1:SCALE:256 2:RMS_NORM:256 3:MUL:256 4:MUL_MAT:256 5:MUL:256 6:ADD:256 8:ROPE:256 "
    "9:SCALE:256 10:MUL_MAT:256 11:MUL:256 12:ADD:256 14:ROPE:256 15:MUL_MAT:256 16:MUL:256 17:ADD:256 "
    "20:SET_ROWS:128 24:SET_ROWS:128 31:MUL_MAT:512 32:SCALE:512 33:UNARY:512 34:SCALE:512 35:SOFT_MAX:512 "
    "36:MUL_MAT:256 38:CONT:256 39:MUL_MAT:256 40:MUL:256 41:RMS_NORM:256 42:MUL:256 43:ADD:256 "
    "44:RMS_NORM:256 45:MUL:256 46:MUL_MAT:384 47:MUL_MAT:384 48:GLU:384 49:MUL_MAT:256 50:RMS_NORM:256 "
    "51:MUL:256 52:ADD:256 53:RMS_NORM:256 54:MUL:256 55:MUL_MAT:256 56:MUL:256 57:ADD:256 59:ROPE:256 "
    "60:SCALE:256 61:MUL_MAT:256 62:MUL:256 63:ADD:256 65:ROPE:256 66:MUL_MAT:256 67:MUL:256 68:ADD:256 "
    "71:SET_ROWS:128 75:SET_ROWS:128 82:MUL_MAT:512 83:SCALE:512 84:UNARY:512 85:SCALE:512 86:SOFT_MAX:512 "
    "87:MUL_MAT:256 89:CONT:256 90:MUL_MAT:256 91:MUL:256 92:GET_ROWS:1 93:RMS_NORM:1 94:MUL:1 95:GET_ROWS:1 "
    "96:ADD:1 97:RMS_NORM:1 98:MUL:1 99:MUL_MAT:1 100:MUL_MAT:1 101:GLU:1 102:MUL_MAT:1 103:RMS_NORM:1 "
    "104:MUL:1 105:ADD:1 106:RMS_NORM:1 107:MUL:1 108:MUL_MAT:0 109:SCALE:0 110:UNARY:0 111:SCALE:0 "
    ),
    ("gemma3-dense+swa-default", True): (
    "0:GET_ROWS:256 1:SCALE:256 2:RMS_NORM:256 3:MUL:256 4:MUL_MAT:256 5:MUL:256 6:ADD:256 8:RMS_NORM:256 "
    "9:MUL:256 10:ROPE:256 11:SCALE:256 12:MUL_MAT:256 13:MUL:256 14:ADD:256 16:RMS_NORM:256 17:MUL:256 "
    "18:ROPE:256 19:MUL_MAT:256 20:MUL:256 21:ADD:256 24:SET_ROWS:128 26:SET_ROWS:128 33:FLASH_ATTN_EXT:256 "
    "35:MUL_MAT:256 36:MUL:256 37:RMS_NORM:256 38:MUL:256 39:ADD:256 40:RMS_NORM:256 41:MUL:256 "
    "42:MUL_MAT:384 43:MUL_MAT:384 44:GLU:384 45:MUL_MAT:256 46:RMS_NORM:256 47:MUL:256 48:ADD:256 "
    "49:RMS_NORM:256 50:MUL:256 51:MUL_MAT:256 52:MUL:256 53:ADD:256 55:RMS_NORM:256 56:MUL:256 57:ROPE:256 "
    "58:SCALE:256 59:MUL_MAT:256 60:MUL:256 61:ADD:256 63:RMS_NORM:256 64:MUL:256 65:ROPE:256 66:MUL_MAT:256 "
    "67:MUL:256 68:ADD:256 71:SET_ROWS:128 73:SET_ROWS:128 80:FLASH_ATTN_EXT:256 82:MUL_MAT:256 83:MUL:256 "
    "84:GET_ROWS:1 85:RMS_NORM:1 86:MUL:1 87:GET_ROWS:1 88:ADD:1 89:RMS_NORM:1 90:MUL:1 91:MUL_MAT:1 "
    "92:MUL_MAT:1 93:GLU:1 94:MUL_MAT:1 95:RMS_NORM:1 96:MUL:1 97:ADD:1 98:RMS_NORM:1 99:MUL:1 100:MUL_MAT:0 "
    ),
}


def _graph(models: Path, model: str, flash_attn: bool) -> Builder:  # noqa: F811
    b = Builder(spec_of(models, model), GraphParams(256, 1, (256, 256), 1, flash_attn, "f16", "f16"))
    build(b)
    return b


@pytest.mark.parametrize(("model", "flash_attn"), list(LLAMA_CPP))
def test_the_graph_is_llama_cpps_node_for_node(models: Path, model: str, flash_attn: bool) -> None:  # noqa: F811
    nodes = _graph(models, model, flash_attn).gf.nodes
    ours = " ".join(f"{i}:{n.op}:{n.nbytes // 1024}" for i, n in enumerate(nodes)
                    if n.op not in ("VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"))
    assert ours == LLAMA_CPP[(model, flash_attn)].strip()


def test_only_the_norms_built_with_a_layer_are_pinned(models: Path) -> None:  # noqa: F811
    # gemma3.cpp: attn_norm, the Q and K norms, post_attention_norm and ffn_norm with il; post_ffw_norm and
    # output_norm with -1, which graph_get_cb leaves to the scheduler
    b = _graph(models, "gemma3-dense+swa-default", True)
    weight_of = {id(n.src[0]): n.src[1].name for n in b.gf.nodes if n.op == "MUL" and n.src[0].op == "RMS_NORM"}
    assert [(il, weight_of[id(n)]) for n, il in b.norm_pins] == [
        (il, f"blk.{il}.{w}.weight") for il in (0, 1)
        for w in ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm")]
    assert sorted(weight_of.values()).count("blk.1.post_ffw_norm.weight") == 1


def test_a_tied_lm_head_runs_where_the_output_layers_copy_of_token_embd_lives(models: Path) -> None:  # noqa: F811
    # gemma2 creates `output` as token_embd duplicated (TENSOR_DUPLICATED): a weight of its own in the output layer's
    # buffer; where that is token_embd's buffer type, token_embd itself
    b = _graph(models, "gemma2-dense", False)
    lm_head = next(n for n in reversed(b.gf.nodes) if n.op == "MUL_MAT")
    embd = b.gf.nodes[0].src[0]
    for weight_backend, head, rows in (({TIED_OUTPUT: 0}, 0, 1), ({"token_embd.weight": 0}, 0, 0), ({}, 1, 1)):
        b.bind(BackendMap(n_backends=2, weight_backend=weight_backend))
        assert (lm_head.src[0].backend, embd.backend) == (head, rows)
