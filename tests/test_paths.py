"""fitter.paths: a derived name is one folder or file name, whatever it was made from (`safe_name`); a file fitter
keeps is whole or not there, whatever stops the write (`write_atomic`)."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.paths import SOURCE_ROOT, WriteError, safe_name, write_atomic
from tests.disks import fill, tmpfs

SIZE = 8 << 20  # bytes: a write long enough (tens of ms with its fsync) for kills to land inside it
# Writes generation 1, 2, 3… of the file (each SIZE copies of one byte) as fast as it can, through write_atomic or
# the way a plain write_bytes does it (truncate, then write: the control that the check below can fail).
WRITER = """
import itertools, sys
from pathlib import Path
from fitter.paths import write_atomic
target, size, how = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
print("ready", flush=True)
for n in itertools.count(1):
    data = bytes([n % 251]) * size
    write_atomic(target, data) if how == "atomic" else target.write_bytes(data)
"""



@pytest.mark.parametrize(("text", "name"), [
    ("gpt-oss-20b-mxfp4", "gpt-oss-20b-mxfp4"),  # a sane name is kept
    ("0c1e570", "0c1e570"),
    ("my model (Q4_K_M)", "my-model-Q4_K_M"),
    ("..", "unknown"), (".", "unknown"), ("...", "unknown"), ("", "unknown"), ("-", "unknown"),
    ("../../etc", "etc"), ("/abs/path", "abs-path"), ("a/../b", "a-..-b"), ("a\\..\\b", "a-..-b"),
    (".hidden", "hidden"), ("v1.", "v1"), ("nul\0byte", "nul-byte"), ("two\nlines", "two-lines"),
    ("llama 🦙 模型", "llama"), ("ünï", "n"),
])
def test_safe_names(text: str, name: str) -> None:
    assert safe_name(text) == name


def test_keep_lets_a_character_through() -> None:
    assert safe_name("RTX-4090+RTX-4090-1a2b3c4d", keep="+") == "RTX-4090+RTX-4090-1a2b3c4d"
    assert safe_name("RTX-4090+RTX-4090-1a2b3c4d") == "RTX-4090-RTX-4090-1a2b3c4d"


def test_a_long_name_keeps_its_start_and_a_hash_of_the_whole() -> None:
    a, b = "x" * 300 + "a", "x" * 300 + "b"
    assert safe_name(a) == "x" * 111 + "-f5e724b7"  # sha256 of the whole text
    assert len(safe_name(a)) == 120 and safe_name(b) != safe_name(a)  # two long names stay apart
    assert safe_name("é" * 200) == "unknown"  # nothing kept: no hash of nothing either


def kill_writes(target: Path, how: str, kills: int) -> tuple[list[str], int]:
    """Kill -9 a writer of `target` at `kills` random moments. What the file was each time ("whole" or what was
    wrong with it), and how many kills landed inside a write (a temporary file was left)."""
    rng = random.Random(15)
    seen, inside = [], 0
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(SIZE), how], stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(SOURCE_ROOT)})
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        try:
            proc.wait(timeout=rng.uniform(0.0, 0.25))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        data = target.read_bytes()
        whole = len(data) == SIZE and data == data[:1] * SIZE
        seen.append("whole" if whole else f"{len(data)} bytes, {len(set(data))} distinct")
        left = list(target.parent.glob(f".{target.name}.*.tmp"))
        inside += bool(left)
        for tmp in left:
            tmp.unlink()
    return seen, inside


def test_kill_9_at_any_moment_leaves_the_old_file_or_the_new_one(tmp_path: Path) -> None:
    target = tmp_path / "pareto.json"
    write_atomic(target, b"\0" * SIZE)  # the old file, generation 0
    seen, inside = kill_writes(target, "atomic", 30)
    assert seen == ["whole"] * 30
    assert inside >= 10, inside  # most kills landed mid-write: the check saw writes cut short, not only idle gaps
    assert target.read_bytes()[:1] != b"\0"  # and newer generations did replace the old file
    assert [p.name for p in tmp_path.iterdir()] == ["pareto.json"]


def test_the_kill_check_catches_a_plain_write(tmp_path: Path) -> None:
    target = tmp_path / "pareto.json"
    target.write_bytes(b"\0" * SIZE)
    seen, _ = kill_writes(target, "plain", 10)
    assert any(s != "whole" for s in seen), seen  # a truncate-then-write is caught half-written


def test_a_new_file_has_the_mode_open_would_give_it(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = write_atomic(tmp_path / "trials.csv", "a,b\n")
    finally:
        os.umask(old)
    assert path.read_text() == "a,b\n" and path.stat().st_mode & 0o777 == 0o644


def test_a_full_disk_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", 256) as disk:
        target = disk / "pareto.json"
        write_atomic(target, "old\n")
        fill(disk)
        with pytest.raises(WriteError) as e:
            write_atomic(target, "new\n" * 50_000)
        assert str(e.value) == f"{target}: disk full (No space left on device)"
        assert (e.value.errno, e.value.remedy) == (errno.ENOSPC, "free space")
        assert target.read_text() == "old\n" and sorted(p.name for p in disk.iterdir()) == ["filler", "pareto.json"]


@pytest.mark.parametrize(("code", "message", "remedy"), [
    (errno.ENOSPC, "disk full (No space left on device)", "free space"),
    (errno.EROFS, "read-only (Read-only file system)", "make it writable"),
    (errno.EACCES, "not writable (Permission denied)", "make it writable"),
    (errno.EIO, "cannot write it (Input/output error)", "fix that"),
])
def test_an_os_error_mid_write_keeps_the_old_file_and_leaves_no_temporary_file(
        tmp_path: Path, code: int, message: str, remedy: str) -> None:
    # the twin of the real full disk above where mounting is refused: the OS refuses the second chunk of the write
    target = tmp_path / "pareto.json"
    write_atomic(target, "old\n")
    real_write, calls = os.write, []

    def refusing(fd: int, data: bytes) -> int:
        calls.append(fd)
        if len(calls) > 1:
            raise OSError(code, os.strerror(code))
        return real_write(fd, bytes(data)[:4096])

    with pytest.MonkeyPatch.context() as mp, pytest.raises(WriteError) as e:
        mp.setattr(os, "write", refusing)
        write_atomic(target, b"new\n" * 10_000)
    assert str(e.value) == f"{target}: {message}" and e.value.remedy == remedy
    assert len(calls) == 2 and target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["pareto.json"]
