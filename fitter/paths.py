"""Where fitter keeps things on disk: its home (caches of generated models, built tools, compiled shims) and its own
source tree (so the child processes it starts import the same fitter)."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent  # fitter/
SOURCE_ROOT = PACKAGE_DIR.parent  # the folder that holds the fitter package: PYTHONPATH for `python -m fitter…`


def fitter_home() -> Path:
    """Where fitter caches generated files: ``$FITTER_HOME`` or ``~/.cache/fitter``."""
    env = os.environ.get("FITTER_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fitter"


NAME_LIMIT = 120  # characters of a name fitter derives: two of them and a suffix stay under NAME_MAX (255 bytes)


def safe_name(text: str, keep: str = "", limit: int = NAME_LIMIT) -> str:
    """`text` (a model's file name or metadata, a machine, a build) as one folder or file name that stays where it is
    put: every run of characters outside [A-Za-z0-9._-] and `keep` becomes "-" ('/', '\\' and NUL among them), dots
    and dashes at either end go (never ".", ".." nor a hidden name), "unknown" if nothing is left, and past `limit`
    characters the start is kept with a hash of the whole, so two long names stay apart."""
    name = re.sub(f"[^A-Za-z0-9._{re.escape(keep)}-]+", "-", text).strip(".-")
    if len(name) > limit:
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        name = f"{name[:limit - 9].rstrip('.-')}-{digest}"
    return name or "unknown"
