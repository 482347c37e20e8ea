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


def test_estimate_with_a_draft_counts_its_buffers_and_says_it_drafts_nothing(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    draft = model_file("llama-tiny")
    monkeypatch.chdir(draft.parent)  # a relative -md is read from here and recorded as an absolute path
    assert main(["estimate", str(model_file("qwen3-tiny")), "--devices", "none", "-c", "1024", "-md", draft.name,
                 "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    drafts = [b for b in out["buffers"] if b.get("model") == "draft"]
    assert [(b["buft"], b["kind"]) for b in drafts] == [("CPU_Mapped", "model"), ("CPU", "kv"), ("CPU", "compute"),
                                                         ("CPU", "output")]
    assert sum(b["bytes"] for b in out["buffers"]) == out["devices"]["CPU"]["total"]
    assert out["draft"]["model"]["path"] == str(draft) and out["draft"]["context"]["n_ctx"] == 1024
    assert f"-md {draft} without --spec-type draft-simple: llama-server loads the draft" in captured.err


def test_a_tune_with_a_draft_through_fitters_worker_is_refused_before_anything_starts(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    draft = str(model_file("llama-tiny"))
    assert main(["tune", str(model_file("qwen3-tiny")), "-md", draft, "--trials", "1", "--results", str(tmp_path)]) == 2
    assert capsys.readouterr().err.endswith(
        f"fitter: error: -md {draft}: llama-cpp-python loads no draft model; measure through llama-server "
        "(--llama-cpp DIR, your build's bin/ folder or the pinned one)\n")


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
    import re

    from fitter.cli.app import COMMANDS, build_parser

    def built(parser: argparse.ArgumentParser) -> set[str]:  # the usage line's {command,...}
        found = re.search(r"\{([a-z,-]+)\}", parser.format_usage())
        assert found is not None
        return set(found.group(1).split(","))

    for module, commands in COMMANDS.items():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"fitter.cli.{module}").register(sub)
        assert tuple(sub.choices) == commands, module
        assert built(build_parser([commands[0], "--help"])) == set(commands)
    assert built(build_parser()) == {c for commands in COMMANDS.values() for c in commands}


_UNMODELLED = ("fitter models a draft model (-md, -ngld, -ncmoed, -cmoed, -otd, -ctkd, -ctvd, --spec-type "
               "draft-simple, --spec-draft-n-max/-min) on the target's devices; this setting's memory or placement "
               "(the draft's own devices or threads, MTP, EAGLE3, n-gram drafts, a draft from Hugging Face) is not in "
               "its estimate; give the flags without it")


@pytest.mark.parametrize(("argv", "error"), [
    (["fit", "-md", "draft.gguf", "-devd", "none"], f"-devd: {_UNMODELLED}"),
    (["tune", "--spec-ngram-mod-n-max=8"], f"--spec-ngram-mod-n-max: {_UNMODELLED}"),
    (["estimate", "model.gguf", "-c", "4096", "--threads-draft", "3"], f"--threads-draft: {_UNMODELLED}"),
    (["bench", "--draft-max", "16"], "--draft-max: the argument has been removed from llama.cpp; use "
     "--spec-draft-n-max (common/arg.cpp), which fitter reads"),
    (["tune", "--draft-min=2"], "--draft-min: the argument has been removed from llama.cpp; use --spec-draft-n-min "
     "(common/arg.cpp), which fitter reads"),
])
def test_speculation_fitter_does_not_model_is_refused_by_name_not_misestimated(
        argv: list[str], error: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err == f"fitter: error: {error}\n"


def test_a_speculative_type_other_than_a_draft_models_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["estimate", "--spec-type", "ngram-simple", "--devices", "none"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        "fitter: error: fitter estimate: argument --spec-type: 'ngram-simple': fitter models a draft model's "
        "speculation (draft-simple) only; what ngram-simple allocates (an MTP, EAGLE3 or DFlash context, an n-gram "
        "cache) is not in its estimate\n")


def test_a_rule_flag_llama_cpp_cannot_read_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "-ncmoe", "x"]) == 2
    assert capsys.readouterr().err == "fitter: error: -ncmoe 'x': expected an integer\n"


def test_the_flags_given_are_what_estimate_shows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--ctx-size=2048", "-ngl", "auto", "--for=llama-cli"]) == 0
    assert "flags   -c 2048 -ngl auto  (for llama-cli)" in capsys.readouterr().out
