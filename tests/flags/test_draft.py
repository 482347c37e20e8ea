"""fitter.flags.draft: a draft model's flags as llama-server reads them, pinned back, and the draft context
llama-server derives from the model's (common/speculative.cpp common_base_params_to_speculative)."""

from __future__ import annotations

import pytest

from fitter.errors import LaunchConfigError
from fitter.flags import LaunchConfig, parse_launch_flags, pin, resolve_context
from fitter.flags.config import TensorOverride, recorded_repr
from fitter.flags.draft import draft_context_config, draft_notes, measuring_problem
from fitter.flags.overrides import ncmoe_rules

DRAFT = ["-md", "draft.gguf"]


def test_every_spelling_of_the_drafts_flags_sets_its_field() -> None:
    long = parse_launch_flags(["--model-draft", "d.gguf", "--gpu-layers-draft", "all", "--n-cpu-moe-draft", "2",
                               "--override-tensor-draft", "x=CPU", "--cache-type-k-draft", "q8_0",
                               "--spec-draft-type-v", "q4_0", "--spec-type", "draft-simple,none",
                               "--spec-type", "draft-simple",
                               "--spec-draft-n-max", "8", "--spec-draft-n-min", "2", "-fa", "on"])
    assert (long.draft_model, long.draft_n_gpu_layers, long.draft_cache_type_k, long.draft_cache_type_v,
            long.spec_type, long.spec_draft_n_max, long.spec_draft_n_min) == (
        "d.gguf", -2, "q8_0", "q4_0", "draft-simple", 8, 2)
    assert long.draft_overrides == (*ncmoe_rules(2), TensorOverride("x", "CPU"))
    assert long.overrides == ()  # the model's own rules stay its own
    short = parse_launch_flags(["-md", "d.gguf", "-ngld", "3", "-cmoed"])
    assert (short.draft_n_gpu_layers, short.draft_overrides) == (
        3, (TensorOverride(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps", "CPU"),))


@pytest.mark.parametrize(("flags", "spec_type"), [
    (["--spec-type", "none,draft-simple"], "none"),  # `none` in a list ends it (common_speculative_types_from_names)
    (["--spec-type", "draft-simple", "--spec-type", "none"], "draft-simple"),  # each flag appends (common/arg.cpp)
    (["--spec-type", "none,draft-mtp"], "none"),  # what follows none is never read
])
def test_spec_type_is_read_as_llama_cpp_reads_its_list(flags: list[str], spec_type: str) -> None:
    assert parse_launch_flags([*DRAFT, *flags]).spec_type == spec_type


def test_pin_writes_every_draft_setting_and_reads_back_to_the_same_config() -> None:
    config = parse_launch_flags([*DRAFT, "-c", "4096", "-ngld", "5", "-ncmoed", "2", "-otd", "x=CPU", "-ctkd",
                                 "q8_0", "--spec-type", "draft-simple", "--spec-draft-n-max", "8"])
    flags = pin(config)
    assert flags[flags.index("-md"):] == [
        "-md", "draft.gguf", "-ngld", "5", "-ncmoed", "2", "-otd", "x=CPU", "-ctkd", "q8_0", "-ctvd", "f16",
        "--spec-type", "draft-simple", "--spec-draft-n-max", "8", "--spec-draft-n-min", "0", "-fit", "off"]
    again = parse_launch_flags(flags)
    for name in ("draft_model", "draft_n_gpu_layers", "draft_overrides", "draft_cache_type_k", "draft_cache_type_v",
                 "spec_type", "spec_draft_n_max", "spec_draft_n_min"):
        assert getattr(again, name) == getattr(config, name), name
    assert pin(again) == flags


def test_a_config_without_a_draft_pins_no_draft_flag_and_keeps_its_recorded_key() -> None:
    config = parse_launch_flags(["-c", "4096"])
    assert "draft" not in " ".join(pin(config)) and "spec" not in " ".join(pin(config))
    assert recorded_repr(LaunchConfig(ctx_size=4096)) == (
        "LaunchConfig(ctx_size=4096, batch_size=2048, ubatch_size=512, cache_type_k='f16', cache_type_v='f16', "
        "flash_attn='auto', n_gpu_layers=-1, overrides=(), parallel=-1, kv_unified=None, swa_full=False, "
        "no_kv_offload=False, no_op_offload=False, no_repack=False, load_mode='auto', fit=True, tensor_split=(), "
        "main_gpu=0, rpc=(), consumer='llama-server', flags=())")
    assert "draft_model='d.gguf'" in recorded_repr(LaunchConfig(draft_model="d.gguf"))


@pytest.mark.parametrize(("flags", "slots", "outputs"), [
    ([*DRAFT], 4, 4),  # -md alone: nothing drafts, one output per slot
    ([*DRAFT, "--spec-type", "draft-simple"], 4, 16),  # 4 slots × (1 + 3 drafted)
    ([*DRAFT, "--spec-type", "draft-simple", "--spec-draft-n-max", "16", "-np", "2"], 2, 34),
    ([*DRAFT, "--spec-type", "draft-simple", "-b", "8", "-ub", "8"], 4, 8),  # clamped to -b
    (["--spec-draft-n-max", "16"], None, None),  # a draft setting without a draft is refused
])
def test_the_model_reserves_logits_for_every_drafted_token(flags: list[str], slots: int | None,
                                                             outputs: int | None) -> None:
    if slots is None:
        with pytest.raises(LaunchConfigError, match=r"^--spec-draft-n-max: a draft model's setting without -md"):
            parse_launch_flags(flags)
        return
    ctx = resolve_context(parse_launch_flags([*flags, "-c", "1024"]), 4096)
    assert (ctx.n_seq_max, ctx.n_outputs_max) == (slots, outputs)


def test_the_draft_context_is_the_models_with_the_drafts_layers_rules_and_cache() -> None:
    config = parse_launch_flags([*DRAFT, "-c", "0", "-np", "3", "-ngl", "7", "-ncmoe", "1", "-ctk", "q8_0", "-fa",
                                 "on", "-ngld", "2", "-cmoed", "--spec-type", "draft-simple"])
    target = resolve_context(config, 8192)  # 3 separate slots of 2816 cells (8192 / 3 padded to 256)
    assert target.n_ctx == 8448
    draft = draft_context_config(config, target.n_ctx)
    assert (draft.ctx_size, draft.parallel, draft.n_gpu_layers, draft.cache_type_k, draft.cache_type_v,
            draft.flash_attn, draft.fit) == (8448, 3, 2, "f16", "f16", "on", False)
    assert draft.overrides == config.draft_overrides and not draft.draft_model
    ctx = resolve_context(draft, 2048)  # the draft's training context is not its context: the model's is
    assert (ctx.n_ctx, ctx.n_ctx_seq, ctx.n_outputs_max) == (8448, 2816, 3)


@pytest.mark.parametrize(("flags", "consumer", "error"), [
    (["--spec-type", "draft-simple"], "llama-server",
     "--spec-type draft-simple without -md: draft-simple requires a draft context (common/speculative.cpp); give "
     "the draft model with -md FILE"),
    (["-ngld", "9"], "llama-server",
     "-ngld: a draft model's setting without -md; give the draft model with -md FILE, or leave the flag out"),
    ([*DRAFT], "llama-bench",
     "-md draft.gguf: --for llama-bench has no speculative decoding (llama-server and llama-cli load a draft "
     "model)"),
    ([*DRAFT, "--spec-draft-n-max", "-1"], "llama-server",
     "--spec-draft-n-max -1: must be >= 0 (common/arg.cpp)"),
])
def test_what_llama_server_refuses_is_refused_naming_the_flag(flags: list[str], consumer: str, error: str) -> None:
    with pytest.raises(LaunchConfigError) as e:
        parse_launch_flags(flags, consumer)
    assert str(e.value) == error


def test_a_draft_that_drafts_nothing_is_said_and_one_of_another_vocabulary_refused() -> None:
    loaded = parse_launch_flags(DRAFT)
    assert draft_notes(loaded, 512, 2048) == [
        "-md draft.gguf without --spec-type draft-simple: llama-server loads the draft and its context (counted "
        "here) and drafts nothing; add --spec-type draft-simple to speculate"]
    drafting = parse_launch_flags([*DRAFT, "--spec-type", "draft-simple"])
    assert draft_notes(drafting, 512, 640) == []  # 128 apart: llama-server's limit
    with pytest.raises(LaunchConfigError, match=r"the model's vocabulary has 512 tokens and the draft's 641, more than "
                                                r"128 apart"):
        draft_notes(drafting, 512, 641)


def test_a_draft_whose_header_asks_for_mtp_is_refused_unless_the_type_is_given() -> None:
    with pytest.raises(LaunchConfigError, match=r"^-md draft\.gguf: without --spec-type llama-server speculates with "
                                                r"draft-mtp, which its header asks for"):
        draft_notes(parse_launch_flags(DRAFT), 512, 512, "draft-mtp")
    assert draft_notes(parse_launch_flags([*DRAFT, "--spec-type", "draft-simple"]), 512, 512, "draft-mtp") == []


def test_a_draft_is_measured_by_llama_server_and_a_speculation_only_on_text() -> None:
    loaded, drafting = parse_launch_flags(DRAFT), parse_launch_flags([*DRAFT, "--spec-type", "draft-simple"])
    assert measuring_problem(parse_launch_flags([]), "llama-bench") is None
    assert measuring_problem(loaded, "llama-server") is None
    assert measuring_problem(loaded, "sim") is None  # memory only: a draft that drafts nothing
    assert measuring_problem(loaded, "llama-cpp-python") == (
        "-md draft.gguf: llama-cpp-python loads no draft model; measure through llama-server (--llama-cpp DIR, your "
        "build's bin/ folder or the pinned one)")
    assert measuring_problem(drafting, "llama-server", "prompts.txt") is None
    assert str(measuring_problem(drafting, "llama-server")).startswith(
        "--spec-type draft-simple: how fast speculation decodes depends on how many drafted tokens the model "
        "accepts, i.e. on the text: give your prompts with --prompts FILE")
    assert str(measuring_problem(drafting, "sim", "prompts.txt")).startswith(
        "--spec-type draft-simple: a simulated machine has no text")
