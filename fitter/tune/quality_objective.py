"""Quality as an objective of the tune (`--objectives …,quality`): what a config's KV cache types cost in output
quality, measured once per (K type, V type) with the build's own llama-perplexity (fitter.measure.llamacpp.perplexity)
against the model with an f16 cache, and kept in the study's attributes so a resumed study, or another worker of a
fleet, measures no class twice.

Quality does not depend on the placement, the batch sizes or the threads (the same arithmetic runs whichever device
holds a layer: an emulated GPU is ggml's CPU backend behind RPC), so it is pooled over them, as decode is pooled by
physics. The value a trial is told is the mean KL divergence (lower is better); its 95 % interval decides whether two
classes differ beyond the text's sampling noise (`quality_beyond_noise`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution

from fitter.errors import FitterError
from fitter.flags import KV_CACHE_TYPES, LaunchConfig
from fitter.gguf.model_spec import ModelSpec
from fitter.memory.plan.estimator import estimate
from fitter.results.quality_record import QUALITY, describe, quality_record
from fitter.tune.options import TuneOptions

if TYPE_CHECKING:
    from fitter.measure.llamacpp.builds import LlamaCppBuild

__all__ = ["QUALITY", "QualityBook", "check_quality", "kv_bytes", "kv_class", "quality_book", "widened_kv_types"]

REFERENCE_KV = ("f16", "f16")  # llama.cpp's default cache: the reference's types
KV_KEYS = ("cache-type-k", "cache-type-v")

# (K type, V type) → the measurement's JSON (fitter.measure.llamacpp.perplexity QualityMeasure.record())
QualityMeter = Callable[[str, str], dict[str, Any]]


def kv_class(config: LaunchConfig) -> str:
    """The pooled class of a config's quality: its K and V cache types, `q8_0/q8_0`."""
    return f"{config.cache_type_k}/{config.cache_type_v}"


def widened_kv_types(distributions: Mapping[str, BaseDistribution], supported: tuple[str, ...]
                     ) -> dict[str, BaseDistribution]:
    """With quality measured, the KV cache types searched are every type the build takes (common/arg.cpp
    kv_cache_types), where the space searches them at all (flags that fix -ctk/-ctv keep them out); a quantized V
    with flash attention off is refused per config (fitter.search.space.is_valid_combination)."""
    out = dict(distributions)
    for key in KV_KEYS:
        if isinstance(out.get(key), CategoricalDistribution):
            out[key] = CategoricalDistribution(tuple(t for t in supported if t in KV_CACHE_TYPES))
    return out


class QualityBook:
    """The study's measured quality per KV class: read from the study's attributes, measured when missing."""

    def __init__(self, study: optuna.Study, meter: QualityMeter, about: Mapping[str, Any],
                 log: Callable[[str], None] = lambda _: None):
        self.study = study
        self.meter = meter
        self.about = dict(about)  # how it is measured: the tool, the text, -c, the reference (pareto.json says)
        self.log = log

    def section(self) -> dict[str, Any]:
        """pareto.json's `quality`: how it was measured and every class measured."""
        return {**self.about, "reference": "/".join(REFERENCE_KV), "classes": self.table()}

    def table(self) -> dict[str, dict[str, Any]]:
        return dict(self.study.user_attrs.get(QUALITY) or {})

    def of(self, config: LaunchConfig) -> dict[str, Any]:
        """The quality of config's KV class, measured now when the study has none (seconds to minutes: a
        llama-perplexity run over the text)."""
        key = kv_class(config)
        known = self.table().get(key)
        if known is not None:
            return dict(known)
        self.log(f"fitter: measuring the quality of a {key} KV cache (llama-perplexity, KL divergence from f16)")
        record = self.meter(config.cache_type_k, config.cache_type_v)
        table = self.table()
        table[key] = record
        self.study.set_user_attr(QUALITY, table)
        self.log(f"fitter: {key}: {describe(record)}")
        return dict(record)


def kv_bytes(spec: ModelSpec, config: LaunchConfig) -> dict[str, int]:
    """The KV cache's bytes with config's types and with f16 ones (what a quantized cache saves), from the
    estimator, planned on the CPU alone: the cache's cells and types, not its devices, decide its size."""
    config = replace(config, split_mode="layer", tensor_split=(), rpc=(), device_names=(), overrides=(),
                     n_gpu_layers=0, mmproj="", draft_model="")
    f16 = replace(config, cache_type_k=REFERENCE_KV[0], cache_type_v=REFERENCE_KV[1])
    return {name: sum(b.bytes for b in estimate(spec, c).buffers if b.kind == "kv" and not b.model)
            for name, c in (("this", config), ("f16", f16))}


# -- the meter: the build's llama-perplexity (fitter.measure.llamacpp.perplexity) ---------------------------------


def quality_text(o: TuneOptions) -> Path:
    """The text quality is measured on: --quality-text, else the user's --prompts file, else the one fitter ships."""
    from fitter.measure.quality import SHIPPED_TEXT

    if o.search.quality_text:
        return Path(o.search.quality_text)
    if o.workload.prompts is not None:
        return Path(o.workload.prompts.file)
    return SHIPPED_TEXT


def perplexity_tool(users: LlamaCppBuild | None) -> Path:
    """The user's build's llama-perplexity (--llama-cpp DIR), else the pinned tools' (built by the set-up)."""
    from fitter.measure.llamacpp.tools import built_tools

    if users is not None:
        return users.perplexity_tool()
    home = built_tools()
    if home is None:
        raise FitterError("--objectives quality measures with llama.cpp's llama-perplexity: build the pinned tools "
                          "(python -m fitter.measure.llamacpp.tools) or give your build with --llama-cpp DIR")
    return home / "llama-perplexity"


def check_quality(o: TuneOptions, users: LlamaCppBuild | None) -> TuneOptions:
    """Before anything starts: the tool is there, the text exists and is long enough for -c (two windows); the
    options with the KV types the build takes (what the search widens to)."""
    if QUALITY not in o.search.objectives:
        return o
    from fitter.measure.llamacpp.perplexity import check_text_length, kv_types_of

    tool = perplexity_tool(users)
    text = quality_text(o)
    if not text.is_file():
        raise FitterError(f"--quality-text {text}: no such file")
    check_text_length(text, o.search.quality_ctx)
    return replace(o, search=replace(o.search, quality_kv_types=kv_types_of(str(tool))))


def quality_book(o: TuneOptions, users: LlamaCppBuild | None, study: optuna.Study,
                 log: Callable[[str], None]) -> QualityBook:
    """The study's book of quality, measured with the build's llama-perplexity on the model's own devices (llama.cpp
    fits them itself): the reference (an f16 cache) made once per model, text, -c and build, kept in fitter's home."""
    from fitter.measure.llamacpp.perplexity import measure_quality, reference_logits

    tool, text, n_ctx = perplexity_tool(users), quality_text(o), o.search.quality_ctx
    ref_model = o.search.quality_reference or o.model
    refs: list[Any] = []

    def meter(ctk: str, ctv: str) -> dict[str, Any]:
        if not refs:
            log(f"fitter: the quality reference: {ref_model} with an f16 KV cache over {text} at -c {n_ctx}")
            refs.append(reference_logits(tool, ref_model, text, n_ctx,
                                         identity=o.spec.identity if ref_model == o.model else ""))
        return quality_record(measure_quality(tool, o.model, refs[0], ctk, ctv, n_vocab=o.spec.n_vocab))

    about = {"tool": f"{tool.name} --kl-divergence", "text": str(text), "n_ctx": n_ctx,
             "reference_model": str(Path(ref_model).resolve())}
    return QualityBook(study, meter, about, log)
