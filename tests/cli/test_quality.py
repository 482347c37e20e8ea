"""`fitter quality`: the KLD table of KV cache types, and of several files of one model, through the pinned build's
llama-perplexity on the demo model; bad input in one line, before anything runs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fitter.cli import main
from fitter.measure.llamacpp.tools import tools_dir
from tests.conftest import BUILT_TOOLS
from tests.models import model_file

needs_tools = pytest.mark.tools("llama-perplexity", "llama-quantize")


@pytest.fixture
def pinned_tools(_fitter_home: Path) -> Path:
    """The session's pinned tools, seen from the test's own fitter home (where the command looks for them)."""
    tools_dir().parent.mkdir(parents=True)
    tools_dir().symlink_to(BUILT_TOOLS, target_is_directory=True)
    return tools_dir()


@needs_tools
def test_the_kld_table_of_kv_types(pinned_tools: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quality", "-c", "128", "--chunks", "4", "--kv-types", "f16,q8_0,q4_0", "-t", "2"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("reference: ") and lines[0].endswith(
        "fitter-demo-gpt-oss.gguf (f16 K and V, 4.66 bits per weight), made in " + lines[0].split("made in ")[1])
    assert lines[1].endswith(", -c 128: 4 chunks, 252 tokens scored; PPL(base) 2322.2230 ± 60.61533")
    assert [line.split()[0] for line in lines[4:8]] == ["K/V", "f16/f16", "q8_0/q8_0", "q4_0/q4_0"]
    assert lines[5].split()[1:3] == ["-0.000000", "[-0.000000,"]  # the reference's own config
    assert err.splitlines()[0].startswith("reference: ")  # progress on stderr, one line a run
    assert len(err.splitlines()) == 4
    # again: the reference comes from fitter's cache
    assert main(["quality", "-c", "128", "--chunks", "4", "-ctk", "q8_0", "-ctv", "q4_0", "-t", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["reference"]["cached"] is True and doc["reference"]["n_chunk"] == 4
    [row] = doc["rows"]
    assert (row["cache_type_k"], row["cache_type_v"], row["flags"], row["tokens"]) == ("q8_0", "q4_0", ["-t", "2"],
                                                                                        252)
    assert row["kld_interval95"][0] < row["kld_mean"] < row["kld_interval95"][1]


@needs_tools
def test_files_of_one_model_against_the_most_precise(pinned_tools: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from fitter.gguf.demo_models import demo_model_path

    demo = demo_model_path()
    q4 = tmp_path / "demo-Q4_0.gguf"  # the build's own llama-quantize: Q8_0 and MXFP4 requantized to Q4_0
    subprocess.run([str(pinned_tools / "llama-quantize"), "--allow-requantize", str(demo), str(q4), "Q4_0", "2"],
                   check=True, capture_output=True, timeout=120)
    assert main(["quality", str(q4), str(demo), "-c", "128", "--chunks", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["reference"]["model"] == str(demo)  # 4.66 bits per weight against Q4_0's 4.59
    assert [(f["path"], round(f["bits_per_weight"], 2)) for f in doc["files"]] == [(str(q4), 4.59), (str(demo), 4.66)]
    assert [(Path(r["model"]).name, r["cache_type_k"]) for r in doc["rows"]] == [("demo-Q4_0.gguf", "f16"),
                                                                               (demo.name, "f16")]
    q4_row, demo_row = doc["rows"]
    assert abs(demo_row["kld_mean"]) <= 1e-6 < q4_row["kld_interval95"][0]


@pytest.mark.parametrize(("args", "message"), [
    (["-np", "2"], "-np: llama-perplexity runs -b / -c sequences at once itself (perplexity.cpp: n_parallel); drop "
     "it for fitter quality"),
    (["-md", "/m/draft.gguf"], "-md: llama-perplexity loads no draft model; drop it for fitter quality"),
    (["-cram", "0"], "-cram: llama-server's prompt cache is no part of llama-perplexity; drop it for fitter quality"),
    (["-c", "0"], "-c 0: llama-perplexity scores chunks of -c tokens; give -c 1 or more (default 512)"),
    (["--chunks", "1"], "--chunks 1: llama-perplexity needs at least 2 chunks of -c tokens"),
    (["--kv-types", "all", "-ctk", "q8_0"], "--kv-types all and -ctk/-ctv: give the types one way"),
    (["/nonexistent/model.gguf"], "/nonexistent/model.gguf: no such model file"),
    (["--quality-text", "/nonexistent/text.txt"], "--quality-text /nonexistent/text.txt: no such file"),
])
def test_bad_input_is_one_line_before_anything_runs(args: list[str], message: str, _fitter_home: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quality", *args]) == 2
    assert capsys.readouterr().err == f"fitter: error: {message}\n"
    assert not (_fitter_home / "quality").exists()


def test_a_missing_llama_perplexity_is_named(_fitter_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quality", str(model_file("gpt-oss-tiny"))]) == 2
    assert capsys.readouterr().err == (f"fitter: error: llama-perplexity is not built in {tools_dir()}: run `python -m "
                                       "fitter.measure.llamacpp.tools` (a few minutes once), or give a build with "
                                       "--llama-cpp DIR\n")


@needs_tools
def test_files_of_two_models_are_refused(pinned_tools: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fitter.gguf.demo_models import demo_model_path

    tiny, demo = model_file("gpt-oss-tiny"), demo_model_path()
    assert main(["quality", str(demo), str(tiny)]) == 2
    assert capsys.readouterr().err == (f"fitter: error: {tiny}: its vocabulary has 512 tokens, {demo}'s 2048: "
                                       "quality compares files of one model\n")


@needs_tools
def test_a_users_build_measures_with_its_own_llama_perplexity(capsys: pytest.CaptureFixture[str]) -> None:
    # --llama-cpp DIR: that build's llama-perplexity (here the pinned build's folder, as a user's would be given)
    assert main(["quality", "--llama-cpp", str(BUILT_TOOLS), "-c", "128", "--chunks", "4", "-ctk", "q8_0", "-ctv",
                 "q8_0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["reference"]["argv"][0] == str(BUILT_TOOLS / "llama-perplexity")
    assert [(r["cache_type_k"], r["kld_mean"] > 0) for r in doc["rows"]] == [("q8_0", True)]
