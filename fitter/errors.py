"""fitter's error family. Library code raises these; only the CLI turns them into a message and exit code 2."""

from __future__ import annotations


class FitterError(Exception):
    """A problem the user can fix: the message names the file or flag, the rule broken and the value seen."""


class GGUFError(FitterError):
    """A GGUF file (or a set of split shards) that cannot be read as llama.cpp would read it."""


class LaunchConfigError(FitterError):
    """A llama.cpp flag or flag combination that llama.cpp would reject."""


class SearchSpaceError(FitterError):
    """A search-space file (or a value in it) that fitter cannot turn into optuna distributions."""
