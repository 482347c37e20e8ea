"""fitter.workload.prompts: the user's text as decode runs on it, and how a workload carries and records it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fitter.flags import parse_launch_flags
from fitter.workload import Workload, WorkloadError, load_workload, measure_problem, prompts_problem
from fitter.workload.prompts import Prompts, PromptsError, read_prompts


def test_a_text_file_holds_one_prompt_per_paragraph(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("\n\nOnce upon a time\nthere was\n\n\n  \ndef f(n):\n    return n\n")
    prompts = read_prompts(str(path))
    assert prompts.texts == ("Once upon a time\nthere was", "def f(n):\n    return n")
    assert prompts.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert prompts.to_json() == {"file": str(path.resolve()), "count": 2, "sha256": prompts.sha256}


def test_json_lines_hold_strings_or_prompt_objects(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('"first\\nline"\n\n{"prompt": "second", "id": 7}\n')
    assert read_prompts(str(path)).texts == ("first\nline", "second")


@pytest.mark.parametrize(("name", "content", "error"), [
    ("p.jsonl", '{"text": "x"}\n', r"p\.jsonl:1: expected a JSON string or \{\"prompt\": \"...\"\} with text"),
    ("p.jsonl", "not json\n", r"p\.jsonl:1: not JSON: Expecting value"),
    ("p.txt", "\n \n", r"p\.txt: no prompts \(JSON lines, or text with one prompt per paragraph\)"),
])
def test_a_file_that_holds_no_prompts_is_refused_naming_the_line(tmp_path: Path, name: str, content: str,
                                                                 error: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(PromptsError, match=error):
        read_prompts(str(path))


def test_a_missing_or_binary_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PromptsError, match=r"^--prompts .*nope\.txt: no such file$"):
        read_prompts(str(tmp_path / "nope.txt"))
    (tmp_path / "b.txt").write_bytes(b"ab\xffcd")
    with pytest.raises(PromptsError, match=r"b\.txt: not UTF-8 text \(byte 2\)"):
        read_prompts(str(tmp_path / "b.txt"))


def test_a_workload_records_its_prompts_and_a_check_refuses_changed_ones(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("one\n\ntwo\n")
    w = Workload(n_prompt=64, n_gen=32, prompts=read_prompts(str(path)))
    record = w.to_json()
    assert record["prompts"]["count"] == 2
    assert Workload.from_json(record, "pareto.json").prompts == w.prompts
    assert w.label() == f"-p 64 -n 32 -d 0, decode on 2 prompts of {path.resolve()}"
    path.write_text("one\n\nthree\n")
    with pytest.raises(PromptsError, match=r"p\.txt: not the prompts the result was measured with \(SHA-256 "
                                           r"[0-9a-f]{64}, recorded "):
        Workload.from_json(record, "pareto.json")


def test_a_workload_file_names_its_prompts_beside_it_and_a_result_records_them_absolute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "flags"  # a folder of any name: not the "flags" a workload from the command line says
    folder.mkdir()
    (folder / "chat.txt").write_text("hello\n")
    (folder / "w.toml").write_text('gen = 64\nprompts = "chat.txt"\n')
    monkeypatch.chdir(tmp_path)
    w = load_workload("flags/w.toml")
    assert w.prompts is not None and w.prompts.texts == ("hello",)
    assert w.prompts.file == str(folder / "chat.txt")
    monkeypatch.chdir(folder)  # a check from elsewhere reads the same file
    assert Workload.from_json(w.to_json(), "pareto.json").prompts == w.prompts


def test_prompts_are_decoded_at_depth_0_in_one_stream() -> None:
    prompts = Prompts("p.txt", "0" * 64, ("hi",))
    with pytest.raises(WorkloadError, match=r"prompts p\.txt are decoded from their own text, in one stream"):
        Workload(depths=(0, 4096), prompts=prompts)
    with pytest.raises(WorkloadError, match=r"prompts p\.txt with gen 0: nothing is decoded"):
        Workload(n_gen=0, prompts=prompts)


def test_only_llama_server_decodes_text() -> None:
    w = Workload(prompts=Prompts("p.txt", "0" * 64, ("hi",)))
    assert prompts_problem(w, "llama-server") is None
    assert prompts_problem(Workload(), "llama-bench") is None
    assert prompts_problem(w, "llama-bench") == (
        "--prompts p.txt: llama-bench measures synthetic tokens, not text; decode on your prompts runs through "
        "llama-server (--llama-cpp DIR)")
    drafting = parse_launch_flags(["-md", "d.gguf", "--spec-type", "draft-simple"])
    assert measure_problem(w, drafting, "llama-server") is None
    assert str(measure_problem(Workload(), drafting, "llama-server")).startswith("--spec-type draft-simple: how fast")
