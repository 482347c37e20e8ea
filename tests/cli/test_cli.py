from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.cli import main
from tests.models import model_file, renamed_in_header


def test_estimate_json_follows_the_contract(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(model_file("gpt-oss-tiny"))
    assert main(["estimate", path, "--devices", "none", "-c", "2048", "-np", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"model", "devices", "buffers", "tensors", "llama_cpp"}
    assert out["model"]["arch"] == "gpt-oss" and out["model"]["shards"] == 1
    cpu = out["devices"]["CPU"]
    assert cpu["total"] == cpu["model"] + cpu["kv"] + cpu["compute"] + cpu["output"]
    assert sum(b["bytes"] for b in out["buffers"]) == cpu["total"]
    assert out["llama_cpp"]["commit"] == "0c1e570"
    assert out["context"]["n_ctx"] == 2048
    kv = [b["bytes"] for b in out["buffers"] if b["kind"] == "kv"]
    assert kv == [2048 * 2 * 64 * 2, 768 * 2 * 64 * 2]  # one full and one SWA layer, K+V f16, 2 heads x 32


def test_estimate_table_names_buffers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", str(model_file("gpt-oss-tiny")), "--devices", "cuda:8192", "-ncmoe", "1"]) == 0
    out = capsys.readouterr().out
    assert "CUDA0" in out and "CPU_Mapped" in out and "not yet against a CUDA build" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["estimate", "{missing}", "--devices", "none"], "no such file"),
        (["estimate", "{model}", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["estimate", "{model}", "-ctv", "q8_0", "-fa", "off"], "a quantized V cache requires flash attention"),
        (["estimate", "{model}", "--devices", "cuda:lots"], "'lots' is not a positive number of MiB"),
        (["estimate", "{notgguf}"], "not a GGUF file"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path: Path, args: list[str], message: str) -> None:
    notgguf = tmp_path / "notes.txt"
    notgguf.write_text("hello")
    subst = {"{missing}": str(tmp_path / "missing.gguf"), "{model}": str(model_file("gpt-oss-tiny")),
             "{notgguf}": str(notgguf)}
    argv = [subst.get(a, a) for a in args]
    proc = subprocess.run([sys.executable, "-m", "fitter.cli", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr


def test_estimate_of_a_tensor_table_that_lost_a_tensor_is_one_line_naming_file_and_tensor(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # issue 15: a mutant of the demo model's header died with `KeyError: 'blk.2.attn_k.weight'`
    path = renamed_in_header("demo", tmp_path, b"blk.2.attn_k.weight", b"blk.2.attn_x.weight")
    assert main(["estimate", str(path), "--devices", "none"]) == 2
    assert capsys.readouterr().err == (f"fitter: error: {path}: missing tensor 'blk.2.attn_k.weight', which "
                                       "llama.cpp's gpt-oss graph needs (llama_model_loader: missing tensor)\n")


def test_help_states_llama_server_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    out = capsys.readouterr().out
    assert "-np auto = 4 slots sharing one unified KV cache" in out
    assert "--swa-full off" in out


def test_each_command_module_registers_the_commands_app_lists_for_it() -> None:
    """A command line naming a command builds only its module's parsers (fitter.cli.app.COMMANDS): the list must
    name exactly what each module registers, and the full parser all of them."""
    import argparse
    import importlib

    from fitter.cli.app import COMMANDS, _subparsers, build_parser

    for module, commands in COMMANDS.items():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"fitter.cli.{module}").register(sub)
        assert tuple(sub.choices) == commands, module
        assert set(_subparsers(build_parser([commands[0], "--help"]))) == set(commands)
    assert set(_subparsers(build_parser())) == {c for commands in COMMANDS.values() for c in commands}


@pytest.mark.parametrize(("argv", "name"), [
    (["fit", "-md", "draft.gguf", "-ngld", "99"], "-md"),
    (["tune", "--spec-draft-n-max=8"], "--spec-draft-n-max"),
    (["estimate", "model.gguf", "-c", "4096", "--n-cpu-moe-draft", "3"], "--n-cpu-moe-draft"),
    (["bench", "--draft-max", "16"], "--draft-max"),
    (["tune", "--spec-type", "ngram-simple"], "--spec-type"),
])
def test_speculative_decoding_is_refused_by_name_not_misestimated(argv: list[str], name: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"fitter: error: {name}: speculative decoding (a draft model, MTP or n-gram drafts) is not modelled by fitter "
        "yet: a draft's weights, KV cache and compute would be missing from every figure, and its speed depends on "
        "your prompts; give the flags without it\n")
