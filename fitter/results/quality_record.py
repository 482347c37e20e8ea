"""A measured quality record (fitter.measure.llamacpp.perplexity's JSON: the KL divergence of a config's next-token
distributions from the reference's, in llama-perplexity's terms) as the tune, the table and the exports read it."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fitter.flags import KV_CACHE_TYPES
from fitter.units import MIB

if TYPE_CHECKING:  # a type only: results are read without importing the tool's runner
    from fitter.measure.llamacpp.perplexity import QualityMeasure

QUALITY = "quality"  # the objective, the study attribute and the entries' key


RECORD_NUMBERS = ("kld", "kld_p99", "same_top_pct")  # what every record holds, with its kld_interval


def record_problem(record: Any) -> str | None:
    """Why a quality record read from a result is not one (None: it is): the numbers the table and picks show."""
    if not isinstance(record, dict):
        return f"must be a measured quality record, got {record!r}"
    bad = [k for k in RECORD_NUMBERS if not isinstance(record.get(k), int | float) or isinstance(record.get(k), bool)]
    iv = record.get("kld_interval")
    if not (isinstance(iv, list) and len(iv) == 2 and all(isinstance(x, int | float) for x in iv)):
        bad.append("kld_interval")
    return f"lacks the numbers {', '.join(bad)}" if bad else None


def quality_record(m: QualityMeasure) -> dict[str, Any]:
    """The record a result keeps of one llama-perplexity measurement: its K/V class, the mean KL divergence with its
    95 % interval (not below 0: a divergence is not negative where mean − 1.96 σ of a ~0 mean is), the 99th
    percentile, the same-top-token share, the perplexities and what it cost."""
    lo, hi = m.kld_interval95
    return {"kv": f"{m.cache_type_k}/{m.cache_type_v}", "kld": m.kld_mean, "kld_interval": [max(lo, 0.0), hi],
            "kld_p99": m.kld_p99, "kld_median": m.kld_median, "same_top_pct": m.same_top_pct, "ppl": m.ppl,
            "ppl_base": m.ppl_base, "tokens": m.tokens, "seconds": round(m.seconds, 2)}


def quality_value(record: Mapping[str, Any]) -> float:
    """The objective's value: the mean KL divergence from the reference (lower is better)."""
    return float(record["kld"])


def quality_beyond_noise(better: Mapping[str, Any], worse: Mapping[str, Any]) -> bool:
    """`better`'s KL divergence lies below `worse`'s beyond the text's sampling noise: their 95 % intervals do not
    overlap."""
    return float(better["kld_interval"][1]) < float(worse["kld_interval"][0])


def describe(record: Mapping[str, Any]) -> str:
    """In llama-perplexity's terms: `KLD 0.0012 [0.0010-0.0014], 99 % KLD 0.011, 99.6 % same top token`."""
    lo, hi = record["kld_interval"]
    return (f"KLD {_g(record['kld'])} [{_g(lo)}–{_g(hi)}], 99 % KLD {_g(record['kld_p99'])}, "
            f"{record['same_top_pct']:.1f} % same top token")


def _g(x: float) -> str:
    """4 significant digits; a divergence is never below 0 (llama.cpp prints -0.000000 for a rounding's -1e-9)."""
    return f"{max(float(x), 0.0):.4g}"


def is_quantized(kv: str) -> bool:
    """A K/V class with a block-quantized type (q8_0, q4_0, iq4_nl, ...)."""
    return any(KV_CACHE_TYPES[t][0] > 1 for t in kv.split("/") if t in KV_CACHE_TYPES)


def kv_note(kv: str, quality: Mapping[str, Any] | None, saved: Mapping[str, int] | None) -> str | None:
    """What a pick's KV cache types cost and gain, or None for llama.cpp's default f16 cache: `q8_0/q8_0 KV: KLD
    0.0012 [0.0010–0.0014], 99 % KLD 0.011, 99.6 % same top token; saves 1.1 GiB`, or that its cost was not
    measured."""
    if kv == "f16/f16":
        return None
    gain = ""
    if saved and saved.get("f16", 0) > saved.get("this", 0):
        gain = f"; saves {(saved['f16'] - saved['this']) / MIB:.1f} MiB of KV cache against f16"
    if quality is None:
        return (f"{kv} KV: its cost in quality was not measured (--objectives ...,quality measures it with "
                f"llama-perplexity){gain}")
    return f"{kv} KV: {describe(quality)}{gain}"


def kv_of_flags(flags: Sequence[str]) -> str:
    """The K/V class of a pinned llama-server line (its -ctk/-ctv, else llama.cpp's f16)."""
    kv = {"k": "f16", "v": "f16"}
    for flag, value in itertools.pairwise(flags):
        for which, names in (("k", ("-ctk", "--cache-type-k")), ("v", ("-ctv", "--cache-type-v"))):
            if flag in names:
                kv[which] = value
    return f"{kv['k']}/{kv['v']}"
