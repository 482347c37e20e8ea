"""What the property tests ask of every example: a bounded run, and a failure that is one line naming its input."""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

MIB = 1024 * 1024
# The README's test command runs a quarter of each property test's examples (derandomized: the same ones on every run);
# CI's second command runs them all (`FITTER_ALL_EXAMPLES=1 pytest -m "slow or properties"`, .ci/run).
ALL_EXAMPLES = os.environ.get("FITTER_ALL_EXAMPLES") == "1"


def examples(n: int) -> int:
    """A property test's example count: all `n` under FITTER_ALL_EXAMPLES=1, else a quarter of them."""
    return n if ALL_EXAMPLES else max(20, n // 4)


class Runaway(Exception):
    """An example ran past its time limit (a loop over a count read from the input)."""


_FIRST: dict[str, int] = {}  # the address space at each test's first bounded example


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


@contextmanager
def bounded(seconds: float = 5.0, extra_bytes: int = 256 * MIB) -> Iterator[None]:
    """Run the body within `seconds` of wall time and `extra_bytes` more address space than the process holds now
    (a mapped file counts: the demo model's 96 MiB), and never 512 MiB past what it held at the test's first bounded
    example (memory a failing example leaves behind would otherwise raise the next one's limit, up to an OOM kill).
    A count of 2^60 that reaches an allocation fails with MemoryError at once, and a loop over it raises Runaway
    (hypothesis's deadline only judges an example after it has ended)."""
    def alarm(signum: int, frame: FrameType | None) -> None:
        raise Runaway(f"still running after {seconds} s")

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    previous = signal.signal(signal.SIGALRM, alarm)
    now = _address_space()
    first = _FIRST.setdefault(os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0], now)
    limit = min(now + extra_bytes, first + 512 * MIB)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def assert_one_line_naming(error: BaseException, *names: str) -> None:
    """The error's message is one line (the CLI prints it after `fitter: error: `) and names one of `names`."""
    message = str(error)
    assert "\n" not in message and "\r" not in message, f"more than one line: {message!r}"
    assert any(name in message for name in names), f"names none of {names}: {message!r}"
