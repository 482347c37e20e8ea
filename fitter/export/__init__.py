"""A tuned configuration for a launcher: llama-server's command line, a `--models-preset` INI section, a llama-swap
entry, llama-cpp-python kwargs, or the Pareto entry as JSON, every choice llama-server would make itself pinned."""

from __future__ import annotations

from fitter.export.launchers import FORMATS, Pick, pick, render

__all__ = ["FORMATS", "Pick", "pick", "render"]
