"""Where fitter keeps things on disk: its home (caches of generated models, built tools, compiled shims) and its own
source tree (so the child processes it starts import the same fitter)."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent  # fitter/
SOURCE_ROOT = PACKAGE_DIR.parent  # the folder that holds the fitter package: PYTHONPATH for `python -m fitter…`


def fitter_home() -> Path:
    """Where fitter caches generated files: ``$FITTER_HOME`` or ``~/.cache/fitter``."""
    env = os.environ.get("FITTER_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fitter"
