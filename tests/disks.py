"""Disk faults for the tests: real small or read-only filesystems (a tmpfs of a given size, a folder bind-mounted
read-only over itself) and, for where mounting is refused, the same errno injected at the OS layer (`refused_writes`).
Mounting needs root (CAP_SYS_ADMIN): where it is refused (an unprivileged container) a test that mounts skips, and
its twin that injects the error runs everywhere."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest


def _mount(*args: str, busy_s: float = 0.0) -> None:
    """`mount ARGS`, or a skip where mounting is refused. `busy_s`: how long a "busy" refusal is tried again (a
    remount read-only waits for the files a child opened for writing through the new mount to close)."""
    deadline = time.monotonic() + busy_s
    while True:
        proc = subprocess.run(["mount", *args], capture_output=True, text=True)
        if proc.returncode == 0:
            return
        if "busy" not in proc.stderr or time.monotonic() > deadline:
            pytest.skip(f"mount {' '.join(args)} refused here: {proc.stderr.strip() or proc.returncode}")
        time.sleep(0.01)


def _umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)  # busy: detach it now, free it when unused


@contextmanager
def tmpfs(path: Path, size_kib: int) -> Iterator[Path]:
    """A tmpfs of `size_kib` KiB at `path` (created), unmounted on exit."""
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)


@contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """`path` read-only for every new open (a bind mount over itself, remounted ro), as it was on exit. Files open
    already keep writing through the mount below, as they would on a filesystem remounted read-only under them."""
    _mount("--bind", str(path), str(path))
    try:
        _mount("-o", "remount,bind,ro", str(path), busy_s=10)
        yield path
    finally:
        _umount(path)


def fill(folder: Path) -> None:
    """Take every free byte of the filesystem `folder` is on."""
    with (folder / "filler").open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
        except OSError:
            pass


@contextmanager
def refused_writes(folder: Path, code: int, suffix: str = "") -> Iterator[None]:
    """Within: the OS refuses (errno `code`) every os.write to a file under `folder` (a path prefix) whose name ends
    in `suffix`. fitter's writes (fitter.paths) go through os.write; SQLite's do not."""
    real = os.write

    def write(fd: int, data: Any) -> int:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.startswith(str(folder)) and name.endswith(suffix):
            raise OSError(code, os.strerror(code))
        return real(fd, data)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "write", write)
        yield
