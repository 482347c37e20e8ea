"""`fitter check` on a result tuned with quality: the pick's KV class measured again with the build's own
llama-perplexity when the build changed, the recorded figure kept when it did not."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from fitter.check.quality_recheck import recheck_quality
from fitter.measure.quality import SHIPPED_TEXT
from fitter.results.pareto import Entry, ParetoDoc
from tests.models import model_file

RECORDED = {"kv": "q4_0/q4_0", "kld": 1e-9, "kld_interval": [0.0, 2e-9], "kld_p99": 1e-8, "same_top_pct": 100.0}


def _doc(commit: str, text: Path | None = None) -> ParetoDoc:
    about = {"text": str(text), "n_ctx": 128} if text is not None else {}
    return cast(ParetoDoc, SimpleNamespace(llama_cpp={"commit": commit}, data={"quality": about}))


def _entry(quality: dict[str, Any] | None = RECORDED) -> Entry:
    return Entry.from_json({"trial": 4, "flags": ["-c", "4096", "-ctk", "q4_0", "-ctv", "q4_0"],
                            **({"quality": quality} if quality else {})}, "r/pareto.json")


def test_without_a_tool_or_a_recorded_quality_the_recorded_figure_stands(tmp_path: Path) -> None:
    assert recheck_quality(_doc("abc"), _entry(None), "m.gguf", None) == ([], [], {})
    lines, failures, details = recheck_quality(_doc("abc"), _entry(), "m.gguf", tmp_path / "llama-perplexity")
    assert lines == ["quality: q4_0/q4_0 KV: KLD 1e-09 [0–2e-09], 99 % KLD 1e-08, 100.0 % same top token as tuned; "
                     "not re-measured: no llama-perplexity in the build"]
    assert failures == [] and details == {"quality": {"recorded": RECORDED}}


@pytest.mark.tools("llama-perplexity")
def test_a_new_build_measures_the_picks_quality_again(llama_tools: dict[str, Path], tmp_path: Path,
                                                      _fitter_home: Path) -> None:
    tool = llama_tools["llama-perplexity"]
    text = tmp_path / "text.txt"
    text.write_text(SHIPPED_TEXT.read_text()[:6000])
    model = str(model_file("gpt-oss-tiny"))
    from fitter.measure.llamacpp.perplexity import tool_build

    same = tool_build(tool)["commit"]
    lines, failures, _ = recheck_quality(_doc(same, text), _entry(), model, tool)
    assert lines[0].endswith(f"as tuned (the same build {same}: not re-measured)") and failures == []
    # recorded with another build at a divergence below what q4_0 costs: measured again, and it rose beyond noise
    lines, failures, details = recheck_quality(_doc("0000000", text), _entry(), model, tool)
    now = details["quality"]["now"]
    assert now["kv"] == "q4_0/q4_0" and now["kld_interval"][0] > 2e-9 and now["tokens"] > 100
    assert lines[0].startswith("quality: q4_0/q4_0 KV: KLD 1e-09 [0–2e-09], 99 % KLD 1e-08, 100.0 % same top token "
                               "with 0000000; now KLD ")
    assert failures == [f"quality: the q4_0/q4_0 KV cache's KL divergence rose beyond noise with build {same} "
                        f"(1e-09 → {now['kld']:.4g})"]
