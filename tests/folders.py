"""A folder for one test process's files, removed when that process exits (left behind, they filled /tmp: 177 MB of
models and a fitter home per run)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path


def process_folder(prefix: str) -> Path:
    """A new temporary folder, removed at the exit of the process that made it (a forked child leaves it alone)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:
            shutil.rmtree(folder, ignore_errors=True)

    atexit.register(remove)
    return folder
