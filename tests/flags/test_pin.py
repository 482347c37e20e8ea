"""fitter.flags.pin: the llama-server line `fitter fit` prints reads back as the same words in a POSIX shell."""

from __future__ import annotations

import shlex

import pytest

from fitter.flags import server_command
from tests.hostile import HOSTILE_PATHS


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_the_server_command_quotes_any_model_path(path: str) -> None:
    flags = ["-c", "4096", "-ot", r"blk\.(0|1)\.ffn_.*_exps=CPU", "-fit", "off"]
    assert shlex.split(server_command(path, flags)) == ["llama-server", "-m", path, *flags]
