"""Where fitter keeps things on disk: its home (caches of generated models, built tools, compiled shims), its own
source tree (so the child processes it starts import the same fitter), and how it writes a file it keeps: whole or
not at all (`write_atomic`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
from pathlib import Path

from fitter.errors import FitterError

PACKAGE_DIR = Path(__file__).resolve().parent  # fitter/
SOURCE_ROOT = PACKAGE_DIR.parent  # the folder that holds the fitter package: PYTHONPATH for `python -m fitter…`

# what a failed write means to the user, and what to do before running the command again
_PROBLEMS = {errno.ENOSPC: ("disk full", "free space"), errno.EDQUOT: ("disk quota exceeded", "free space"),
             errno.EROFS: ("read-only", "make it writable"), errno.EACCES: ("not writable", "make it writable"),
             errno.EPERM: ("not writable", "make it writable")}


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


class WriteError(FitterError):
    """A file fitter could not write; whatever was there before is left as it was."""

    def __init__(self, path: Path, error: OSError) -> None:
        self.path, self.errno = path, error.errno
        self.problem, self.remedy = _PROBLEMS.get(error.errno or 0, ("cannot write it", "fix that"))
        super().__init__(f"{path}: {self.problem} ({error.strerror or error})")


def write_atomic(path: Path, data: bytes | str) -> Path:
    """Write `data` (str as UTF-8) to `path` whole or not at all: into a temporary file beside it (same filesystem),
    flushed to the disk, then renamed over `path`. A kill at any point leaves the old file or the new one, never
    half of one (the rename is atomic); an error removes the temporary file, keeps the old one and raises
    WriteError. A kill -9 mid-write can leave the hidden temporary file (`.NAME.*.tmp`) behind, never a partial
    `path`."""
    payload = memoryview(data.encode() if isinstance(data, str) else data)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)  # umask applies, as for open()
        try:
            while payload:
                payload = payload[os.write(fd, payload):]
            os.fsync(fd)  # the data on the disk before the rename makes it the file: a power cut keeps old or new
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise WriteError(path, e) from None
        raise
    _sync_folder(path.parent)
    return path


def _sync_folder(folder: Path) -> None:
    """The rename itself on the disk (the folder's entry); a filesystem that cannot sync a folder still renamed."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
