"""The child processes fitter starts (the worker, the loader, the emulated GPU's server, a user's llama-server):
one environment, one process group each, and one cleanup that kills them when fitter exits.

- Environment: the caller's, with fitter's own source first on PYTHONPATH (so `python -m fitter…` imports this very
  fitter from any directory) and `GGML_NO_BACKTRACE=1` (a ggml abort would otherwise run gdb for a backtrace).
- Process group: every child leads a session of its own, so a terminal's Ctrl-C reaches fitter alone (which decides
  what stops) and killing the group also kills whatever the child started.
- Cleanup: at interpreter exit and on SIGTERM/SIGINT every registered stopper runs (then the previous handler, or
  the signal's default action). A child fitter cannot stop that way (kill -9 of fitter) stops itself: the worker
  and the loader end on their stdin's EOF, the emulated GPU's server polls its parent pid.
- A graceful Ctrl-C (`first_interrupt_deferred`): the first SIGINT only tells the caller to stop at its next safe
  point (a tune: after the running trial), the second one stops everything as above.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import IO, Any

from fitter.paths import SOURCE_ROOT

_STOPPERS: dict[int, Callable[[], None]] = {}
_LOCK = threading.RLock()  # re-entrant: a signal handler may run while it is held
_PREVIOUS: dict[int, Any] = {}
_HOOKED = {"atexit": False, "signals": False}

Stream = int | IO[Any] | None


def child_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (default: this process's environment) with fitter's source on PYTHONPATH and no gdb on an abort."""
    env = dict(os.environ if base is None else base)
    root = str(SOURCE_ROOT)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("GGML_NO_BACKTRACE", "1")
    env.update(extra)
    return env


def python_module(module: str, *args: str) -> list[str]:
    """The argv that runs `python -m module args…` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def spawn(argv: Sequence[str], *, env: Mapping[str, str] | None = None, stdin: Stream = subprocess.DEVNULL,
          stdout: Stream = None, stderr: Stream = None,
          cpus: tuple[int, ...] | None = None) -> subprocess.Popen[bytes]:
    """Start a child in a session of its own, pinned to `cpus` (before it starts any thread) when given, and
    registered so fitter's exit kills its process group."""
    proc = subprocess.Popen(list(argv), env=dict(env) if env is not None else child_env(), stdin=stdin,
                            stdout=stdout, stderr=stderr, start_new_session=True)
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    register(proc.pid, lambda: _forget(kill_group(proc)))
    return proc


def _forget(_: object) -> None:
    pass


def kill_group(proc: subprocess.Popen[Any], sig: signal.Signals = signal.SIGKILL) -> int:
    """Signal the child's process group, wait for the child and forget it; its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
    rc = proc.wait()
    unregister(proc.pid)
    return rc


def stop(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> int:
    """SIGTERM to the child's group, SIGKILL after `grace_s`; its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    return kill_group(proc)


def run(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    """Run a child to its end: (exit status, stdout, stderr), text. Past `timeout` its process group is killed and
    subprocess.TimeoutExpired raised with what it wrote so far."""
    proc = spawn(argv, env=env if env is not None else dict(os.environ), stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(list(argv), timeout, _text(out), _text(err)) from None
    unregister(proc.pid)
    return proc.returncode, _text(out), _text(err)


def _text(data: bytes | None) -> str:
    return data.decode(errors="replace") if data else ""


def register(key: int, stopper: Callable[[], None]) -> None:
    """Run `stopper` when fitter exits or is told to stop, unless `unregister(key)` came first."""
    _install_hooks()
    with _LOCK:
        _STOPPERS[key] = stopper


def unregister(key: int) -> None:
    with _LOCK:
        _STOPPERS.pop(key, None)


def stop_all() -> None:
    with _LOCK:
        stoppers = list(_STOPPERS.values())
        _STOPPERS.clear()
    for stopper in stoppers:
        with contextlib.suppress(Exception):
            stopper()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    stop_all()
    previous = _PREVIOUS.get(signum)
    if callable(previous):
        previous(signum, frame)
    else:  # SIG_DFL (or a handler set outside Python): die as the signal would have killed us
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_hooks() -> None:
    """atexit once; SIGTERM/SIGINT handlers that stop the children and then defer to the previous handlers."""
    with _LOCK:
        if not _HOOKED["atexit"]:
            atexit.register(stop_all)
            _HOOKED["atexit"] = True
        if _HOOKED["signals"] or threading.current_thread() is not threading.main_thread():
            return  # handlers can only be set from the main thread; the children still see fitter exit
        _HOOKED["signals"] = True
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:  # the process goes on after this signal: so do its children
                continue
            _PREVIOUS[signum] = previous
            signal.signal(signum, _on_signal)


@contextlib.contextmanager
def first_interrupt_deferred(on_first: Callable[[], None]) -> Iterator[None]:
    """Within the block, the first SIGINT (Ctrl-C) only calls `on_first` (from the signal handler: it should set a
    flag and at most write a line): fitter's children go on, and the caller stops at its next safe point. A second
    SIGINT does what SIGINT does outside the block: the children are stopped and KeyboardInterrupt is raised. Outside
    the main thread (where Python cannot set handlers) the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _install_hooks()  # this module's handler (stop the children) is the one a second Ctrl-C falls through to
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:  # started with Ctrl-C ignored (nohup, `&`): it stays ignored
        yield
        return
    fired = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if not fired:
            fired = True
            on_first()
        elif callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is handler:
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def signals_passed_on(pid: Callable[[], int | None]) -> Iterator[list[int]]:
    """Within the block SIGINT and SIGTERM are sent on to the process `pid()` names (a server fitter runs in the
    foreground, which decides itself how to stop), not acted on: fitter's other children stay up until it exits.
    The block gets the list of the signals that came while `pid()` was None, to send once it has started that
    process. The handlers only call os.kill. Outside the main thread the block changes nothing."""
    early: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield early
        return
    _install_hooks()  # fitter's own handlers first, so that spawning inside the block does not put them back

    def handler(signum: int, frame: FrameType | None) -> None:
        target = pid()
        if target is None:
            early.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signum)

    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        signal.signal(s, handler)
    try:
        yield early
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
