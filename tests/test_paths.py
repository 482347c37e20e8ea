"""fitter.paths.safe_name: a derived name is one folder or file name, whatever it was made from."""

from __future__ import annotations

import pytest

from fitter.paths import safe_name


@pytest.mark.parametrize(("text", "name"), [
    ("gpt-oss-20b-mxfp4", "gpt-oss-20b-mxfp4"),  # a sane name is kept
    ("0c1e570", "0c1e570"),
    ("my model (Q4_K_M)", "my-model-Q4_K_M"),
    ("..", "unknown"), (".", "unknown"), ("...", "unknown"), ("", "unknown"), ("-", "unknown"),
    ("../../etc", "etc"), ("/abs/path", "abs-path"), ("a/../b", "a-..-b"), ("a\\..\\b", "a-..-b"),
    (".hidden", "hidden"), ("v1.", "v1"), ("nul\0byte", "nul-byte"), ("two\nlines", "two-lines"),
    ("llama 🦙 模型", "llama"), ("ünï", "n"),
])
def test_safe_names(text: str, name: str) -> None:
    assert safe_name(text) == name


def test_keep_lets_a_character_through() -> None:
    assert safe_name("RTX-4090+RTX-4090-1a2b3c4d", keep="+") == "RTX-4090+RTX-4090-1a2b3c4d"
    assert safe_name("RTX-4090+RTX-4090-1a2b3c4d") == "RTX-4090-RTX-4090-1a2b3c4d"


def test_a_long_name_keeps_its_start_and_a_hash_of_the_whole() -> None:
    a, b = "x" * 300 + "a", "x" * 300 + "b"
    assert safe_name(a) == "x" * 111 + "-f5e724b7"  # sha256 of the whole text
    assert len(safe_name(a)) == 120 and safe_name(b) != safe_name(a)  # two long names stay apart
    assert safe_name("é" * 200) == "unknown"  # nothing kept: no hash of nothing either
