"""fitter's error family. Library code raises these; only the CLI turns them into a message and exit code 2."""

from __future__ import annotations

from typing import ClassVar


class FitterError(Exception):
    """A problem the user can fix: the message names the file or flag, the rule broken and the value seen."""

    quotes_output: ClassVar[bool] = False  # True: the message quotes a program's output, its lines kept

    def __init__(self, message: str = "") -> None:
        # One line, as the CLI prints it: a name may bring a newline with it (a path, a value read from a file).
        text = str(message)
        super().__init__(text if self.quotes_output else text.replace("\r", "\\r").replace("\n", "\\n"))


class GGUFError(FitterError):
    """A GGUF file (or a set of split shards) that cannot be read as llama.cpp would read it."""


class LaunchConfigError(FitterError):
    """A llama.cpp flag or flag combination that llama.cpp would reject."""


class SearchSpaceError(FitterError):
    """A search-space file (or a value in it) that fitter cannot turn into optuna distributions."""
