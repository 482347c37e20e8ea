"""fitter.measure.quality: the files compared, the K/V pairs asked for, and the table in llama.cpp's terms."""

from __future__ import annotations

from pathlib import Path

import pytest

from fitter.measure.llamacpp.perplexity import QualityError, Reference, parse_quality
from fitter.measure.quality import (
    SHIPPED_TEXT,
    ModelFile,
    QualityTable,
    kv_pairs,
    model_file,
    quality_table,
    reference_file,
    render_quality,
)
from tests.conftest import BUILT_TOOLS

LOGS = Path(__file__).resolve().parent / "llamacpp" / "perplexity_logs"
KV = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")  # the pinned build's (its --help)


def test_the_shipped_text_is_long_enough_for_c_512() -> None:
    # 2 × 512 tokens whatever the tokenizer: byte-level BPE at worst one token a byte; ~8,000 tokens for English
    # tokenizers of about 4 characters a token (texts/README.md)
    assert SHIPPED_TEXT.stat().st_size == 34626
    assert SHIPPED_TEXT.read_text().startswith("In Congress, July 4, 1776.")


def test_a_files_bits_per_weight_come_from_its_header(_fitter_home: Path) -> None:
    from fitter.gguf.demo_models import demo_model_path

    demo = model_file(demo_model_path())
    # the demo's tensors: 12,582,912 Q8_0 weights (34 bytes a block of 32), 150,994,944 MXFP4 (17 bytes a block of
    # 32), 484,224 F32 (gguf.constants GGML_QUANT_SIZES)
    bits = 8 * (12582912 * 34 / 32 + 150994944 * 17 / 32 + 484224 * 4) / (12582912 + 150994944 + 484224)
    assert (demo.arch, demo.n_vocab, round(demo.bits_per_weight, 9)) == ("gpt-oss", 2048, round(bits, 9))


def _file(path: str, bpw: float, arch: str = "llama", n_vocab: int = 32000) -> ModelFile:
    return ModelFile(path, arch, n_vocab, bpw, "")


def test_the_reference_is_the_most_precise_file_of_one_model() -> None:
    q4, q8, f16 = _file("/m/q4.gguf", 4.8), _file("/m/q8.gguf", 8.5), _file("/m/f16.gguf", 16.0)
    assert reference_file([q4, f16, q8]) == f16
    assert reference_file([q4, f16, q8], "/m/q8.gguf") == q8
    with pytest.raises(QualityError) as e:
        reference_file([q4, q8], "/m/f16.gguf")
    assert str(e.value) == "--reference /m/f16.gguf: not one of the files measured (/m/q4.gguf, /m/q8.gguf)"
    with pytest.raises(QualityError) as e:
        reference_file([q4, _file("/m/other.gguf", 8.5, arch="qwen3")])
    assert str(e.value) == ("/m/other.gguf: architecture qwen3, /m/q4.gguf's is llama: quality compares files of one "
                            "model")
    with pytest.raises(QualityError) as e:
        reference_file([q4, _file("/m/other.gguf", 8.5, n_vocab=128256)])
    assert str(e.value) == ("/m/other.gguf: its vocabulary has 128256 tokens, /m/q4.gguf's 32000: quality compares "
                            "files of one model")


def test_the_kv_pairs_asked_for() -> None:
    assert kv_pairs("all", KV) == [(t, t) for t in KV]
    assert kv_pairs("all", KV, "off") == [("f32", "f32"), ("f16", "f16"), ("bf16", "bf16")]  # no quantized V
    assert kv_pairs("f16, q8_0,q8_0/q4_0", KV) == [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "q4_0")]
    with pytest.raises(QualityError) as e:
        kv_pairs("q8_0/", KV)
    assert str(e.value) == "--kv-types q8_0/: 'q8_0/' is not TYPE or K/V; give e.g. f16,q8_0,q8_0/q4_0 or all"


def test_the_table_says_what_llama_cpp_printed() -> None:
    row = parse_quality((LOGS / "kld-q4_0-c128.log").read_text(), "/m/demo.gguf", "/m/demo.gguf", "q4_0", "q4_0",
                        seconds=0.53)
    ref = Reference(path=Path("/h/quality/demo.kld"), model="/m/demo.gguf", text="/t/text.txt", n_ctx=128,
                    n_vocab=2048, n_chunk=4, tokens=252, ppl=2322.223, ppl_sem=60.61533, argv=(), seconds=0.41,
                    cached=False)
    table = QualityTable(ref, _file("/m/demo.gguf", 4.658), None, (row,))
    assert render_quality(table).splitlines() == [
        "reference: /m/demo.gguf (f16 K and V, 4.66 bits per weight), made in 0.4 s",
        "text: /t/text.txt, -c 128: 4 chunks, 252 tokens scored; PPL(base) 2322.2230 ± 60.61533",
        "flash attention: auto",
        "",
        "K/V             mean KLD [95 % interval]  99 % KLD  same top token %                  PPL  seconds",
        "q4_0/q4_0  0.003274 [0.003194, 0.003354]  0.004895    85.317 ± 2.234  2313.0200 ± 61.6470      0.5",
        "",
        "KLD: llama.cpp's mean KL divergence from the reference's next-token distribution, per scored token; its 95 % "
        "interval is mean ± 1.96 standard errors (llama.cpp's ±). same top token: how often the most likely next "
        "token is the reference's.",
    ]
    doc = table.to_json()
    assert doc["reference"]["ppl"] == 2322.223 and doc["rows"][0]["kld_mean"] == 0.003274


@pytest.mark.tools("llama-perplexity")
def test_what_can_be_refused_is_refused_before_any_run(_fitter_home: Path) -> None:
    demo = _file(str(_fitter_home / "absent.gguf"), 4.658, "gpt-oss", 2048)  # never opened: nothing runs
    with pytest.raises(QualityError, match=r"^-ctv q4_0 with -fa off: a quantized V cache needs flash attention"):
        quality_table(BUILT_TOOLS / "llama-perplexity", [demo], SHIPPED_TEXT, 512, [("f16", "f16"), ("q8_0", "q4_0")],
                      flash_attn="off")
    assert not (_fitter_home / "quality").exists()
