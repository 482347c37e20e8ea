"""Speculative decoding with a draft model: what llama-server makes of `-md` and its settings.

llama.cpp 0c1e570: common/arg.cpp (`--spec-draft-model`/`-md`, `-ngld`, `-otd`, `-cmoed`, `-ncmoed`, `-ctkd`,
`-ctvd`, `--spec-type`, `--spec-draft-n-max/-min`; `--draft-max`/`--draft-min` are removed), tools/server/
server-context.cpp `load_model` (the target first, then one draft context every slot shares) and common/
speculative.cpp `common_base_params_to_speculative` (the draft's params are the target's, with the draft's model,
`-ngld`, tensor overrides and cache types; its context holds as many cells as the target's, `n_outputs_max` =
the slots). `-md` alone loads the draft and its context, and nothing drafts: speculation needs `--spec-type
draft-simple` (the default type list is `none`, and no type is inferred from a plain GGUF). Pure functions.
"""

from __future__ import annotations

import dataclasses

from fitter.errors import LaunchConfigError
from fitter.flags.config import DRAFT_FIELDS, LaunchConfig
from fitter.flags.consumers import consumer

# Of common/speculative.cpp's types fitter models none and draft-simple; the others' memory (an MTP context on the
# target's weights, an n-gram cache) is not modelled
OTHER_SPEC_TYPES = ("draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark", "ngram-simple", "ngram-map-k",
                    "ngram-map-k4v", "ngram-mod", "ngram-cache")
# llama-server's vocabulary check for draft-simple (common/speculative.cpp common_speculative_are_compatible)
SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128


def validate_draft(config: LaunchConfig) -> None:
    """llama.cpp's rules for the draft's flags, and what fitter does not model, as one-line errors."""
    defaults = LaunchConfig()
    if not config.draft_model:
        given = [name for name in DRAFT_FIELDS if getattr(config, name) != getattr(defaults, name)]
        if config.spec_type == "draft-simple":  # common_speculative_impl_draft_simple's constructor throws
            raise LaunchConfigError("--spec-type draft-simple without -md: draft-simple requires a draft context "
                                    "(common/speculative.cpp); give the draft model with -md FILE")
        if given:
            raise LaunchConfigError(f"{_spelling(given, config.given)}: a draft model's setting without -md; give "
                                    "the draft model with -md FILE, or leave the flag out")
        return
    if not consumer(config.consumer).outputs_per_slot:
        raise LaunchConfigError(f"-md {config.draft_model}: --for {config.consumer} has no speculative decoding "
                                "(llama-server and llama-cli load a draft model)")
    if config.spec_draft_n_max < 0:  # common/arg.cpp --spec-draft-n-max: "invalid value"
        raise LaunchConfigError(f"--spec-draft-n-max {config.spec_draft_n_max}: must be >= 0 (common/arg.cpp)")


def without_draft(config: LaunchConfig) -> LaunchConfig:
    """`config` with no draft model: every draft field at its default."""
    defaults = LaunchConfig()
    return dataclasses.replace(config, draft_model="", **{name: getattr(defaults, name) for name in DRAFT_FIELDS},
                               given=config.given - {"draft_model", *DRAFT_FIELDS})


def draft_context_config(config: LaunchConfig, n_ctx: int) -> LaunchConfig:
    """The draft's launch config as llama-server builds its context (common_base_params_to_speculative and
    common_speculative_init_result): the target's flags with the draft's -ngld, tensor overrides and cache types,
    the target's resolved context `n_ctx`; no fit of its own (llama.cpp's --fit only counts the draft's memory)."""
    return dataclasses.replace(
        without_draft(config), ctx_size=n_ctx, n_gpu_layers=config.draft_n_gpu_layers,
        overrides=config.draft_overrides, cache_type_k=config.draft_cache_type_k,
        cache_type_v=config.draft_cache_type_v, fit=False, given=frozenset())


def draft_notes(config: LaunchConfig, target_vocab: int, draft_vocab: int, inferred: str | None = None) -> list[str]:
    """What llama-server will make of this draft, as warnings: a draft that drafts nothing (`-md` without
    `--spec-type draft-simple`), and errors for a draft whose header makes llama-server pick a type fitter does not
    model (`inferred`: without --spec-type, common/arg.cpp takes draft-mtp from a draft with NextN layers and
    draft-dflash from a dflash one, common_speculative_types_from_gguf) and one draft-simple refuses by its
    vocabulary size (the token texts it also compares are not in a model spec: common/speculative.cpp
    common_speculative_are_compatible)."""
    if inferred is not None and "spec_type" not in config.given:
        raise LaunchConfigError(
            f"-md {config.draft_model}: without --spec-type llama-server speculates with {inferred}, which its header "
            f"asks for (common/arg.cpp common_speculative_types_from_gguf), and fitter does not model {inferred}'s "
            "memory; give --spec-type draft-simple or none to choose")
    if config.spec_type == "none":
        return [f"-md {config.draft_model} without --spec-type draft-simple: llama-server loads the draft and its "
                "context (counted here) and drafts nothing; add --spec-type draft-simple to speculate"]
    if abs(target_vocab - draft_vocab) > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        raise LaunchConfigError(
            f"-md {config.draft_model}: the model's vocabulary has {target_vocab} tokens and the draft's "
            f"{draft_vocab}, more than {SPEC_VOCAB_MAX_SIZE_DIFFERENCE} apart, so llama-server refuses it for "
            "draft-simple (common/speculative.cpp common_speculative_are_compatible)")
    return []


def _spelling(fields: list[str], given: frozenset[str]) -> str:
    """The flags of the first of `fields` a flag set (else of the first field), as llama-server spells them first:
    `-ctkd`, or `-cmoed/-ncmoed/-otd` for the draft's rules."""
    from fitter.flags.vocabulary import FLAGS

    field = next((f for f in fields if f in given), fields[0])
    return "/".join(f.canonical for f in FLAGS if f.field == field)


def measuring_problem(config: LaunchConfig, backend: str, prompts: str | None = None) -> str | None:
    """Why `backend` ("llama-server", "llama-cpp-python", "llama-bench", "sim", "replay") cannot measure a config
    with a draft model, or None. Only llama-server loads a draft; a speculation's speed depends on how many drafted
    tokens the model accepts, i.e. on the text, so it is measured only on the user's prompts (`prompts`: their file)
    and never on a simulated machine."""
    if not config.draft_model:
        return None
    if backend not in ("llama-server", "sim"):
        return (f"-md {config.draft_model}: {backend} loads no draft model; measure through llama-server "
                "(--llama-cpp DIR, your build's bin/ folder or the pinned one)")
    if config.spec_type == "none":
        return None
    if backend == "sim":
        return (f"--spec-type {config.spec_type}: a simulated machine has no text, and a speculation's speed depends "
                "on how many drafted tokens the model accepts; measure it through llama-server with --prompts FILE")
    if prompts is None:
        return (f"--spec-type {config.spec_type}: how fast speculation decodes depends on how many drafted tokens the "
                "model accepts, i.e. on the text: give your prompts with --prompts FILE (JSON lines, or one prompt "
                "per paragraph), and decode is measured on them")
    return None
