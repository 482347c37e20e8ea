"""What a KV cache type, or a file of a model, costs in output quality: a table of llama.cpp's own measures
(fitter.measure.llamacpp.perplexity) against one reference, on the user's build and devices.

The reference is one file's run at f16 K and V (llama.cpp's default): the given file, or among several files of one
model (the same architecture and vocabulary, checked from their headers) the one with the most bits per weight, or
the one the caller names. Every row is one file with one K and V cache type, its KL divergence from that reference
over the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitter.measure.llamacpp.perplexity import (
    UNQUANTIZED,
    QualityError,
    QualityMeasure,
    Reference,
    check_kv,
    check_scored,
    check_text_length,
    measure_quality,
    reference_logits,
)

__all__ = ["SHIPPED_TEXT", "ModelFile", "QualityTable", "kv_pairs", "model_file", "quality_table", "reference_file",
           "render_quality"]

# the public-domain text fitter ships (its provenance: texts/README.md beside it)
SHIPPED_TEXT = Path(__file__).resolve().parent / "llamacpp" / "texts" / "founding-texts.txt"


@dataclass(frozen=True)
class ModelFile:
    """One GGUF file as the quality table compares it: what must match (architecture, vocabulary) and its
    precision (bits per weight over its tensors, from the header's types)."""

    path: str
    arch: str
    n_vocab: int
    bits_per_weight: float
    identity: str  # the header's hash (fitter.gguf.header): part of the reference's cache key


def model_file(path: str | Path) -> ModelFile:
    from fitter.gguf.model_spec import load_model_spec

    spec = load_model_spec(str(path))
    return ModelFile(str(path), spec.arch, spec.n_vocab, 8 * spec.tensor_bytes / max(1, spec.n_params), spec.identity)


def reference_file(files: Sequence[ModelFile], chosen: str | None = None) -> ModelFile:
    """The file the others are measured against: `chosen` (one of them), else the one with the most bits per
    weight (the first of equals). Files of different architectures or vocabularies are refused: KL divergence
    compares one token's probabilities under two files of one model."""
    first = files[0]
    for f in files[1:]:
        if f.arch != first.arch:
            raise QualityError(f"{f.path}: architecture {f.arch}, {first.path}'s is {first.arch}: quality compares "
                               "files of one model")
        if f.n_vocab != first.n_vocab:
            raise QualityError(f"{f.path}: its vocabulary has {f.n_vocab} tokens, {first.path}'s {first.n_vocab}: "
                               "quality compares files of one model")
    if chosen is None:
        return max(files, key=lambda f: f.bits_per_weight)
    found = [f for f in files if Path(f.path).resolve() == Path(chosen).resolve()]
    if not found:
        raise QualityError(f"--reference {chosen}: not one of the files measured ({', '.join(f.path for f in files)})")
    return found[0]


def kv_pairs(spec: str, supported: Sequence[str], flash_attn: str | None = None) -> list[tuple[str, str]]:
    """The K and V cache types `--kv-types` names: `all` is every type the build takes, the same for K and V (as
    users set them; without flash attention only the unquantized ones: llama.cpp refuses a quantized V cache
    then); else a comma-separated list of TYPE (K and V) or K/V."""
    if spec == "all":
        return [(t, t) for t in supported if flash_attn != "off" or t in UNQUANTIZED]
    pairs = []
    for item in spec.split(","):
        k, _, v = item.strip().partition("/")
        if not k or (item.count("/") and not v):
            raise QualityError(f"--kv-types {spec}: {item!r} is not TYPE or K/V; give e.g. f16,q8_0,q8_0/q4_0 or all")
        pairs.append((k, v or k))
    return pairs


@dataclass(frozen=True)
class QualityTable:
    reference: Reference
    reference_file: ModelFile
    flash_attn: str | None  # the configs' -fa (None: llama.cpp's auto); the reference runs at auto
    rows: tuple[QualityMeasure, ...]
    files: tuple[ModelFile, ...] = ()  # the files measured, in the order given

    def to_json(self) -> dict[str, Any]:
        ref = {**{k: getattr(self.reference, k) for k in ("model", "text", "n_ctx", "n_vocab", "n_chunk", "tokens",
                                                          "ppl", "ppl_sem", "seconds", "cached")},
               "cache_type_k": "f16", "cache_type_v": "f16", "logits": str(self.reference.path),
               "bits_per_weight": self.reference_file.bits_per_weight, "argv": list(self.reference.argv)}
        files = [{"path": f.path, "arch": f.arch, "n_vocab": f.n_vocab, "bits_per_weight": f.bits_per_weight}
                 for f in self.files]
        return {"reference": ref, "files": files, "rows": [r.to_json() for r in self.rows]}


def quality_table(tool: str | Path, files: Sequence[ModelFile], text: str | Path, n_ctx: int,
                  pairs: Sequence[tuple[str, str]], flash_attn: str | None = None, flags: Sequence[str] = (),
                  reference_flags: Sequence[str] = (), chunks: int | None = None, chosen: str | None = None,
                  timeout: float | None = None, progress: Callable[[str], None] | None = None) -> QualityTable:
    """Every file × every K/V pair against the reference file's f16 run. Everything that can be refused without
    running (the files, the text's length, the KV types, quantized V without flash attention) is refused before
    the first run; the reference comes from fitter's cache when it was made before."""
    ref_file = reference_file(files, chosen)
    check_text_length(Path(text), n_ctx)
    for k, v in pairs:
        check_kv(tool, k, v, flash_attn)
    say = progress or (lambda _: None)
    ref = reference_logits(tool, ref_file.path, text, n_ctx, reference_flags, chunks, ref_file.identity, timeout)
    check_scored(ref)
    say(f"reference: {ref_file.path}, f16 K and V, -c {ref.n_ctx}: {ref.n_chunk} chunks, {ref.tokens} tokens scored; "
        + ("cached" if ref.cached else f"{ref.seconds:.1f} s"))
    rows = []
    for f in files:
        for k, v in pairs:
            row = measure_quality(tool, f.path, ref, k, v, flash_attn, flags, f.n_vocab, timeout)
            say(f"{Path(f.path).name} -ctk {k} -ctv {v}: KLD {row.kld_mean:.6f}, {row.seconds:.1f} s")
            rows.append(row)
    return QualityTable(ref, ref_file, flash_attn, tuple(rows), tuple(files))


def _kld(x: float) -> str:
    return f"{x:.6f}"  # llama.cpp prints KLD with 6 decimals (perplexity.cpp kl_divergence)


def render_quality(table: QualityTable) -> str:
    """The table in llama.cpp's terms: one row per file and K/V pair."""
    ref = table.reference
    several = len({r.model for r in table.rows}) > 1
    ppl = f"; PPL(base) {ref.ppl:.4f} ± {ref.ppl_sem:.5f}" if ref.ppl is not None and ref.ppl_sem is not None else ""
    made = "from fitter's cache" if ref.cached else f"made in {ref.seconds:.1f} s"
    lines = [f"reference: {ref.model} (f16 K and V, {table.reference_file.bits_per_weight:.2f} bits per weight), "
             f"{made}",
             f"text: {ref.text}, -c {ref.n_ctx}: {ref.n_chunk} chunks, {ref.tokens} tokens scored{ppl}",
             f"flash attention: {table.flash_attn or 'auto'}", ""]
    bits = {f.path: f"{f.bits_per_weight:.2f}" for f in table.files}
    head = [*(["model", "bits/weight"] if several else []), "K/V", "mean KLD [95 % interval]", "99 % KLD",
            "same top token %", "PPL", "seconds"]
    body = []
    for r in table.rows:
        lo, hi = r.kld_interval95
        body.append([*([Path(r.model).name, bits.get(r.model, "?")] if several else []),
                     f"{r.cache_type_k}/{r.cache_type_v}",
                     f"{_kld(r.kld_mean)} [{_kld(lo)}, {_kld(hi)}]", _kld(r.kld_p99),
                     f"{r.same_top_pct:.3f} ± {r.same_top_sem_pct:.3f}", f"{r.ppl:.4f} ± {r.ppl_sem:.4f}",
                     f"{r.seconds:.1f}"])
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    left = {0, 2} if several else {0}  # the names left, the figures right
    for row in [head, *body]:
        lines.append("  ".join(c.ljust(w) if i in left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip())
    lines.append("")
    lines.append("KLD: llama.cpp's mean KL divergence from the reference's next-token distribution, per scored token; "
                 "its 95 % interval is mean ± 1.96 standard errors (llama.cpp's ±). same top token: how often the "
                 "most likely next token is the reference's.")
    return "\n".join(lines)
