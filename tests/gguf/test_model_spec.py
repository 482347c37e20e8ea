from __future__ import annotations

from dataclasses import replace

import pytest

from fitter.errors import GGUFError
from fitter.gguf.header import read_header
from fitter.gguf.model_spec import Role, load_model_spec, model_spec, tensor_role
from tests.models import model_file, model_files


@pytest.mark.parametrize(
    ("name", "layer", "role"),
    [
        ("token_embd.weight", None, Role.EMBEDDING),
        ("output.weight", None, Role.OUTPUT),
        ("output_norm.weight", None, Role.NORM),
        ("blk.7.attn_q.weight", 7, Role.ATTENTION),
        ("blk.7.attn_sinks.weight", 7, Role.ATTENTION),
        ("blk.0.post_attention_norm.weight", 0, Role.NORM),
        ("blk.3.ffn_gate_inp.weight", 3, Role.ROUTER),
        ("blk.3.ffn_gate_inp_shexp.weight", 3, Role.SHARED_EXPERT),
        ("blk.12.ffn_down_exps.bias", 12, Role.EXPERT),
        ("blk.12.ffn_gate_up_exps.weight", 12, Role.EXPERT),
        ("blk.1.ffn_up_shexp.weight", 1, Role.SHARED_EXPERT),
        ("blk.0.ffn_up.weight", 0, Role.DENSE_FFN),
        ("blk.0.attn_kv_a_mqa.weight", 0, Role.ATTENTION),
        ("blk.0.something_new.weight", 0, Role.OTHER),
    ],
)
def test_roles_come_from_gguf_tensor_names(name: str, layer: int | None, role: Role) -> None:
    assert tensor_role(name) == (layer, role)


def test_gpt_oss_hyperparameters() -> None:
    spec = load_model_spec(str(model_file("gpt-oss-tiny")))
    assert (spec.arch, spec.n_layer, spec.n_embd) == ("gpt-oss", 2, 128)
    assert spec.n_head == (4, 4) and spec.n_head_kv == (2, 2)
    assert (spec.head_dim_k, spec.head_dim_v) == (32, 32)
    assert (spec.n_expert, spec.n_expert_used, spec.n_ff_exp) == (4, 2, 128)
    assert spec.n_swa == 128 and spec.swa_layers == (True, False)  # even layers slide
    assert spec.n_vocab == 512 and spec.n_ctx_train == 2048
    assert {t.role for t in spec.tensors} >= {Role.EMBEDDING, Role.OUTPUT, Role.ATTENTION, Role.NORM,
                                               Role.ROUTER, Role.EXPERT}


def test_real_shapes_from_sparse_headers() -> None:
    spec = load_model_spec(str(model_files("gpt-oss-120b", sparse=True, n_shards=3)[1]))
    assert (spec.n_layer, spec.n_expert, spec.n_expert_used, spec.n_vocab) == (36, 128, 4, 201088)
    assert spec.n_shards == 3
    assert round(spec.n_params / 1e9, 2) == 116.83  # llama-bench's figure for gpt-oss-120b
    q3 = load_model_spec(str(model_file("qwen3-30b-a3b", sparse=True)))
    assert (q3.arch, q3.n_layer, q3.n_expert, q3.n_expert_used) == ("qwen3moe", 48, 128, 8)
    assert q3.head_dim_k == 128
    assert not any(q3.swa_layers)


def test_deepseek2_mla_and_shared_experts() -> None:
    spec = load_model_spec(str(model_file("deepseek2-tiny")))
    assert spec.is_mla and spec.n_layer_dense_lead == 1 and spec.n_expert_shared == 1
    roles = {t.name: t.role for t in spec.tensors}
    assert roles["blk.0.ffn_up.weight"] is Role.DENSE_FFN
    assert roles["blk.1.ffn_up_shexp.weight"] is Role.SHARED_EXPERT


def test_unknown_architecture_warns_and_still_builds_a_spec() -> None:
    header = read_header(model_file("llama-tiny"))
    meta = {k.replace("llama.", "mystery."): v for k, v in header.metadata.items()}
    meta["general.architecture"] = "mystery"
    header = type(header)(header.path, header.shards, meta, header.tensors, header.identity)
    spec = model_spec(header)
    assert spec.warnings == (f"{header.path}: architecture 'mystery' has no memory rules in fitter "
                             "(fitter.gguf.archs)",)
    assert spec.arch == "mystery" and spec.n_layer == 2
    assert model_spec(read_header(model_file("llama-tiny"))).warnings == ()
    assert tensor_role("blk.0.attn_q.weight")[1] is Role.ATTENTION


# Found by tests/gguf/test_header_properties.py: a block past block_count was an IndexError in the estimator, an
# expert count of 2^32 a loop of 2^32 graph views, 0 used experts an IndexError.
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("gpt-oss.block_count", 1,
         "tensor 'blk.1.attn_norm.weight' is in block 1, but 'gpt-oss.block_count' is 1 (llama_model_loader: wrong "
         "number of tensors)"),
        ("gpt-oss.expert_used_count", 2**32,
         "'gpt-oss.expert_used_count' must be in 1..4 with 4 experts, got 4294967296"),
        ("gpt-oss.expert_used_count", 0, "'gpt-oss.expert_used_count' must be in 1..4 with 4 experts, got 0"),
        ("gpt-oss.expert_count", 513, "'gpt-oss.expert_count' must be in 0..512 (LLAMA_MAX_EXPERTS), got 513"),
    ],
)
def test_hyperparameters_llama_cpp_refuses_are_one_error(key: str, value: int, message: str) -> None:
    header = read_header(model_file("gpt-oss-tiny"))
    with pytest.raises(GGUFError) as info:
        model_spec(replace(header, metadata={**header.metadata, key: value}))
    assert str(info.value) == f"{header.path}: {message}"
