"""fitter.measure.llamacpp.perplexity: llama-perplexity's KL divergence, run as llama.cpp documents it.

The logs in perplexity_logs/ are the pinned build's own output (llama.cpp 0c1e570, fitter's CPU tools) on the demo
model with fitter's shipped text: kld-q4_0-c128.log is `-ctk q4_0 -ctv q4_0 -c 128` against a reference of 4 chunks
(`--chunks 4`); kld-q8_0-lost-lines.log a q8_0 run of that reference whose log lost its last lines (the tool exited
0: common/log.cpp's worker had not written them when llama-perplexity returned); help.txt its `--help`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fitter.measure.llamacpp import perplexity
from fitter.measure.llamacpp.perplexity import (
    LOG_FLAGS,
    QualityError,
    check_kv,
    config_argv,
    measure_quality,
    parse_kv_types,
    parse_quality,
    read_kld_header,
    reference_argv,
    reference_logits,
)
from fitter.measure.quality import SHIPPED_TEXT
from tests.conftest import BUILT_TOOLS
from tests.models import model_file

LOGS = Path(__file__).resolve().parent / "perplexity_logs"
TOOL = BUILT_TOOLS / "llama-perplexity"
needs_tool = pytest.mark.tools("llama-perplexity")


# -- pure: command lines and parsing ------------------------------------------------------------------------------


def test_the_command_lines_are_the_documented_ones() -> None:
    assert reference_argv("/b/llama-perplexity", "/m/a.gguf", "/t.txt", 512, "/h/r.kld", ["-ngl", "0"], 8) == [
        "/b/llama-perplexity", "-m", "/m/a.gguf", "-f", "/t.txt", "-c", "512", "--kl-divergence-base", "/h/r.kld",
        "--chunks", "8", "-ngl", "0", "--no-log-prefix", "--no-log-timestamps", "--log-colors", "off"]
    assert config_argv("/b/llama-perplexity", "/m/a.gguf", "/h/r.kld", 512, "q8_0", "q4_0", "on", ["-t", "2"]) == [
        "/b/llama-perplexity", "-m", "/m/a.gguf", "--kl-divergence-base", "/h/r.kld", "--kl-divergence", "-ctk",
        "q8_0", "-ctv", "q4_0", "-fa", "on", "-c", "512", "-t", "2", *LOG_FLAGS]
    # -fa left to the tool's default (auto) when not given
    assert "-fa" not in config_argv("t", "m", "r", 512, "f16", "f16")


def test_the_statistics_are_parsed_from_a_real_log() -> None:
    q = parse_quality((LOGS / "kld-q4_0-c128.log").read_text(), "/m/demo.gguf", "/m/demo.gguf", "q4_0", "q4_0",
                      ["-t", "2"], 0.53)
    assert (q.chunks, q.n_ctx, q.tokens) == (4, 128, 252)  # 4 × (128 - 1 - 64)
    assert (q.kld_mean, q.kld_sem, q.kld_p99, q.kld_median, q.kld_max) == (0.003274, 0.000041, 0.004895, 0.003194,
                                                                           0.004968)
    assert (q.same_top_pct, q.same_top_sem_pct) == (85.317, 2.234)
    assert (q.ppl, q.ppl_sem, q.ppl_base, q.ppl_base_sem) == (2313.01996, 61.647026, 2322.221737, 60.61529)
    assert (q.flags, q.seconds) == (("-t", "2"), 0.53)
    # llama.cpp's ± is a standard error: the 95 % interval is ± 1.959964 of them
    lo, hi = q.kld_interval95
    assert (round(lo, 9), round(hi, 9)) == (round(0.003274 - 1.959963985 * 0.000041, 9),
                                            round(0.003274 + 1.959963985 * 0.000041, 9))
    assert q.to_json()["kld_interval95"] == [lo, hi]


def test_a_log_without_the_statistics_is_an_error_never_a_zero() -> None:
    log = (LOGS / "kld-q8_0-lost-lines.log").read_text()
    with pytest.raises(QualityError) as e:
        parse_quality(log, "/m/demo.gguf", "/m/demo.gguf", "q8_0", "q8_0")
    assert str(e.value).startswith("llama-perplexity printed no 'Mean PPL(Q)' line for /m/demo.gguf (-ctk q8_0 -ctv "
                                   "q8_0); its log ends:\n")
    assert str(e.value).endswith("   3    2238.8625 ±   65.5913      -0.00127 ±    0.00178       0.00033 ±    0.00003"
                                 "     0.001 ±  0.000 %    97.884 ±  1.050 %")


def test_the_kv_types_come_from_the_builds_help() -> None:
    assert parse_kv_types((LOGS / "help.txt").read_text()) == (
        "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")  # common/arg.cpp kv_cache_types
    assert parse_kv_types("usage: llama-perplexity\n") == ()


def test_a_text_too_short_for_any_tokenizer_is_refused_before_a_run(tmp_path: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_text("x" * 1021)
    with pytest.raises(QualityError) as e:  # 1021 bytes + BOS + a space prefix < 2 × 512 tokens
        reference_logits("/nonexistent/llama-perplexity", "/nonexistent/m.gguf", text, 512)
    assert str(e.value) == (f"{text}: 1021 bytes cannot make the 1024 tokens llama-perplexity needs at -c 512 (two "
                            "chunks of -c tokens; a token holds at least one byte); give a longer text or a smaller -c")


# -- the reference's cache, with a stand-in tool -------------------------------------------------------------------


def _fake_tool(tmp_path: Path, body: str) -> Path:
    """A stand-in llama-perplexity: a shell script that writes what `body` says to the file after
    --kl-divergence-base (its 8th argument in reference_argv's order) and counts its runs."""
    tool = tmp_path / "llama-perplexity"
    tool.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho run >> {tmp_path / 'runs'}\nbase=$8\n{body}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return tool


def _whole_file() -> str:
    # the head of a reference of n_ctx 8, n_vocab 2, 2 chunks: its tokens (2 × 8 int32) and per chunk 3 rows of
    # nv = 2 * ((2 + 1) / 2) + 4 = 6 uint16: 8 + 12 + 64 + 2 × 3 × 6 × 2 = 156 bytes
    return ("printf '_logits_\\010\\000\\000\\000\\002\\000\\000\\000\\002\\000\\000\\000' > \"$base\"\n"
            "head -c 136 /dev/zero >> \"$base\"\necho 'Final estimate: PPL = 1.5000 +/- 0.01000'")


def test_the_reference_is_made_once_and_kept_whole(tmp_path: Path, _fitter_home: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("y" * 100)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    tool = _fake_tool(tmp_path, _whole_file())
    first = reference_logits(tool, model, text, 8)
    assert (first.n_ctx, first.n_vocab, first.n_chunk, first.tokens, first.ppl, first.ppl_sem, first.cached) == (
        8, 2, 2, 6, 1.5, 0.01, False)
    assert first.path.parent == _fitter_home / "quality" and first.path.stat().st_size == 156
    assert read_kld_header(first.path).size == 156
    mtime = first.path.stat().st_mtime_ns
    again = reference_logits(tool, model, text, 8)
    assert again.cached and again.path == first.path and again.ppl == 1.5
    assert first.path.stat().st_mtime_ns == mtime and (tmp_path / "runs").read_text() == "run\n"  # not run again
    assert str(first.path) in again.argv  # the run that made it, under its final name
    # another -c, another text or other flags: another reference
    assert reference_logits(tool, model, text, 8, ["-t", "1"]).path != first.path
    assert (tmp_path / "runs").read_text() == "run\nrun\n"


def test_an_interrupted_or_broken_reference_run_leaves_no_file(tmp_path: Path, _fitter_home: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("y" * 100)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    half = _fake_tool(tmp_path, "printf '_logits_\\010\\000\\000\\000\\002\\000\\000\\000\\002\\000\\000\\000' > "
                                "\"$base\"\nhead -c 10 /dev/zero >> \"$base\"")
    with pytest.raises(QualityError, match=r"wrote 30 bytes, not the 156 its head implies; its log ends:\n$"):
        reference_logits(half, model, text, 8)
    assert os.listdir(_fitter_home / "quality") == []
    hung = _fake_tool(tmp_path, "printf '_logits_' > \"$base\"\nsleep 30")
    with pytest.raises(QualityError, match=r"ran past 0.5 s; its log ends:"):
        reference_logits(hung, model, text, 8, timeout=0.5)
    assert os.listdir(_fitter_home / "quality") == []


def test_a_text_the_tool_finds_too_short_is_told_even_when_its_log_lost_the_line(tmp_path: Path,
                                                                                 _fitter_home: Path) -> None:
    # perplexity.cpp writes the magic and n_ctx, then returns on a short text (exit status 0)
    text = tmp_path / "t.txt"
    text.write_text("y" * 100)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    tool = _fake_tool(tmp_path, "printf '_logits_\\010\\000\\000\\000' > \"$base\"")
    with pytest.raises(QualityError) as e:
        reference_logits(tool, model, text, 8)
    assert str(e.value) == (f"{text}: it tokenizes to fewer than the 16 tokens -c 8 needs with {model} "
                            "(llama-perplexity scores chunks of -c tokens and needs two: "
                            "tools/perplexity/perplexity.cpp); give a longer text or a smaller -c")
    assert os.listdir(_fitter_home / "quality") == []


# -- the real tool on the demo model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_ref(tmp_path_factory: pytest.TempPathFactory) -> perplexity.Reference:
    if not TOOL.is_file():
        pytest.skip("llama-perplexity not built")
    from fitter.gguf.demo_models import demo_model_path

    home = tmp_path_factory.mktemp("home")
    model = demo_model_path(home / "demo.gguf")
    with pytest.MonkeyPatch.context() as mp:  # the reference's cache, kept for the module's tests
        mp.setenv("FITTER_HOME", str(home))
        return reference_logits(TOOL, model, SHIPPED_TEXT, 128, chunks=4)


@needs_tool
def test_the_kv_types_order_on_the_demo_model(demo_ref: perplexity.Reference) -> None:
    assert (demo_ref.n_ctx, demo_ref.n_vocab, demo_ref.n_chunk, demo_ref.tokens) == (128, 2048, 4, 252)
    assert demo_ref.path.stat().st_size == read_kld_header(demo_ref.path).size
    rows = {t: measure_quality(TOOL, demo_ref.model, demo_ref, t, t, n_vocab=2048) for t in ("f16", "q8_0", "q4_0")}
    for r in rows.values():
        assert (r.chunks, r.n_ctx, r.tokens, r.reference_model) == (4, 128, 252, demo_ref.model)
        # the reference's PPL over the same tokens, from the file's 16-bit log-probabilities (2322.221737) where the
        # reference run printed its own from the logits (2322.2230)
        assert demo_ref.ppl is not None and abs(r.ppl_base - demo_ref.ppl) < 0.01
    f16 = rows["f16"]  # the reference's own config: only the file's 16-bit rounding of the log-probabilities
    assert abs(f16.kld_mean) <= 1e-6 and f16.kld_max <= 1e-6 and f16.same_top_pct == 100.0
    # measured on this model (0.000364 and 0.003274 at 4 chunks of 128): q4_0's KLD is well above q8_0's, their
    # 95 % intervals apart
    assert rows["q8_0"].kld_interval95[1] < rows["q4_0"].kld_interval95[0]
    assert 0 < rows["q8_0"].kld_mean < rows["q4_0"].kld_mean


@needs_tool
def test_bad_kv_types_and_vocabularies_are_refused_in_one_line(demo_ref: perplexity.Reference) -> None:
    with pytest.raises(QualityError) as e:
        check_kv(TOOL, "q6_k", "f16", None)
    assert str(e.value) == (f"-ctk q6_k: not a KV cache type of the build of {TOOL}; it takes f32, f16, bf16, q8_0, "
                            "q4_0, q4_1, iq4_nl, q5_0, q5_1")
    with pytest.raises(QualityError) as e:
        measure_quality(TOOL, demo_ref.model, demo_ref, "q8_0", "q8_0", "off")
    assert str(e.value) == ("-ctv q8_0 with -fa off: a quantized V cache needs flash attention (llama.cpp refuses "
                            "it: src/llama-context.cpp llama_init_from_model); give -fa on or auto")
    tiny = model_file("gpt-oss-tiny")  # 512 tokens
    with pytest.raises(QualityError) as e:  # from the header, before a run
        measure_quality(TOOL, tiny, demo_ref, "f16", "f16", n_vocab=512)
    assert str(e.value) == (f"{tiny}: its vocabulary has 512 tokens, the reference's ({demo_ref.model}) 2048: KL "
                            "divergence compares the same tokens' probabilities; give files of one model")
    with pytest.raises(QualityError) as e:  # llama-perplexity's own check, translated
        measure_quality(TOOL, tiny, demo_ref, "f16", "f16")
    assert str(e.value) == (f"{tiny}: its vocabulary has 512 tokens, the reference's ({demo_ref.model}) 2048 "
                            "(llama-perplexity: inconsistent vocabulary); give files of one model")


@needs_tool
def test_a_text_the_tokenizer_makes_too_short_is_the_tools_count(tmp_path: Path, demo_ref: perplexity.Reference,
                                                                  _fitter_home: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_bytes(SHIPPED_TEXT.read_bytes()[:200])  # 200 bytes: byte-level BPE merges some of them
    with pytest.raises(QualityError) as e:
        reference_logits(TOOL, demo_ref.model, text, 100)
    assert str(e.value) == (f"{text}: tokenizes to 172 tokens with {demo_ref.model}; -c 100 needs at least 200 "
                            "(llama-perplexity scores chunks of -c tokens and needs two: "
                            "tools/perplexity/perplexity.cpp); give a longer text or a smaller -c")
    assert os.listdir(_fitter_home / "quality") == []


def test_a_run_whose_log_lost_its_statistics_is_run_again(tmp_path: Path) -> None:
    # llama-perplexity returns without common_log_flush: on a busy machine its last lines never reach the pipe
    # (kld-q8_0-lost-lines.log, exit status 0). The stand-in loses them on its first run only.
    runs = tmp_path / "runs"
    tool = tmp_path / "llama-perplexity"
    tool.write_text(f"#!/bin/sh\nif [ \"$1\" = --help ]; then cat {LOGS / 'help.txt'}; exit 0; fi\n"
                    f"echo run >> {runs}\nif [ $(wc -l < {runs}) = 1 ]; then cat {LOGS / 'kld-q8_0-lost-lines.log'}; "
                    f"else cat {LOGS / 'kld-q4_0-c128.log'}; fi\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    ref = perplexity.Reference(path=tmp_path / "r.kld", model="/m/demo.gguf", text="t", n_ctx=128, n_vocab=2048,
                               n_chunk=4, tokens=252, ppl=None, ppl_sem=None, argv=(), seconds=0.0, cached=True)
    q = measure_quality(tool, "/m/demo.gguf", ref, "q4_0", "q4_0")
    assert (q.kld_mean, runs.read_text()) == (0.003274, "run\nrun\n")
    lost = tmp_path / "lost"  # every run loses them: an error after ATTEMPTS runs, with the log's tail
    lost.write_text(f"#!/bin/sh\nif [ \"$1\" = --help ]; then cat {LOGS / 'help.txt'}; exit 0; fi\n"
                    f"echo run >> {tmp_path / 'lost-runs'}\ncat {LOGS / 'kld-q8_0-lost-lines.log'}\n")
    lost.chmod(lost.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(QualityError, match=r"^llama-perplexity printed no 'Mean PPL\(Q\)' line for /m/demo.gguf"):
        measure_quality(lost, "/m/demo.gguf", ref, "q8_0", "q8_0")
    assert (tmp_path / "lost-runs").read_text() == "run\n" * perplexity.ATTEMPTS
