"""A process's peak resident memory (VmHWM), which a trial reports beside its speeds."""

from __future__ import annotations

import contextlib
from pathlib import Path


def reset_peak_rss() -> None:
    """Restart this process's VmHWM from its current RSS (Linux 4.0+; nothing elsewhere)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss(pid: int | str = "self") -> int | None:
    """A process's resident-set high-water mark (VmHWM), read while it runs; for this process, getrusage where
    /proc is missing."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    if pid != "self":
        return None
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
