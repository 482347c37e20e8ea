"""fitter.errors: every message is one line, as the CLI prints it."""

from __future__ import annotations

from fitter.errors import GGUFError


def test_a_newline_a_name_brings_is_written_as_backslash_n() -> None:
    # found by tests/results/test_pareto_properties.py: a recorded identity "a\nb" made a two-line error
    assert str(GGUFError("m.gguf: not the tuned model (a\nb\r)")) == "m.gguf: not the tuned model (a\\nb\\r)"
