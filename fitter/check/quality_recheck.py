"""`fitter check` on a result tuned with `--objectives …,quality`: the pick's KV class is measured again with the
build's llama-perplexity when the build changed (a new llama.cpp can change what a quantized cache costs: PR #21038's
rotation did), against a reference the new build makes over the same text; a divergence whose 95 % interval lies
above the recorded one fails the check. With the build unchanged the recorded figure stands (the measurement is
deterministic for one build, text and model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fitter.results.pareto import Entry, ParetoDoc
from fitter.results.quality_record import QUALITY, describe, kv_of_flags, quality_record


def recheck_quality(doc: ParetoDoc, entry: Entry, model: str, tool: Path | None
                    ) -> tuple[list[str], list[str], dict[str, Any]]:
    """(lines, failures, details) of the pick's quality: re-measured when the build changed, else as recorded."""
    if entry.quality is None or not entry.flags:
        return [], [], {}
    from fitter.measure.llamacpp.perplexity import measure_quality, reference_logits, tool_build

    kv = kv_of_flags(entry.flags)
    old = entry.quality
    if tool is None or not tool.is_file():
        return [f"quality: {kv} KV: {describe(old)} as tuned; not re-measured: no llama-perplexity in the build"], \
            [], {QUALITY: {"recorded": old}}
    build = tool_build(tool)
    recorded = str((doc.llama_cpp or {}).get("commit") or "")
    if build["commit"] == recorded:
        return [f"quality: {kv} KV: {describe(old)} as tuned (the same build {recorded}: not re-measured)"], [], \
            {QUALITY: {"recorded": old}}
    about = doc.data.get(QUALITY) or {}
    text, n_ctx = about.get("text"), about.get("n_ctx")
    reference_model = str(about.get("reference_model") or model)
    if not text or not Path(text).is_file() or not isinstance(n_ctx, int):
        return [f"quality: {kv} KV: {describe(old)} as tuned with {recorded}; not re-measured with "
                f"{build['commit']}: the text it was measured on ({text}) is gone"], [], {QUALITY: {"recorded": old}}
    ref = reference_logits(tool, reference_model, text, n_ctx)
    ctk, ctv = kv.split("/")
    now = quality_record(measure_quality(tool, model, ref, ctk, ctv))
    line = f"quality: {kv} KV: {describe(old)} with {recorded}; now {describe(now)} with {build['commit']}"
    failures = []
    if now["kld_interval"][0] > float(old["kld_interval"][1]):
        failures.append(f"quality: the {kv} KV cache's KL divergence rose beyond noise with build {build['commit']} "
                        f"({old['kld']:.4g} → {now['kld']:.4g})")
    return [line], failures, {QUALITY: {"recorded": old, "now": now}}


def perplexity_for(doc: ParetoDoc) -> Path | None:
    """The llama-perplexity a check measures quality with: the user's build's, beside the llama-server it was tuned
    through (`--llama-cpp DIR`), else the pinned tools' (None when they are not built)."""
    from fitter.measure.llamacpp.tools import built_tools

    binary = (doc.llama_cpp or {}).get("llama_server")
    if isinstance(binary, str):
        return Path(binary).parent / "llama-perplexity"
    home = built_tools()
    return home / "llama-perplexity" if home is not None else None
