"""fitter.process: the children fitter starts get one environment, a process group each, and die with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fitter import process
from fitter.paths import SOURCE_ROOT


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split()[2] != "Z"


def test_the_environment_finds_this_fitter_and_keeps_gdb_away() -> None:
    env = process.child_env({"PYTHONPATH": "/elsewhere", "GGML_NO_BACKTRACE": "0"}, X="1")
    assert env["PYTHONPATH"] == f"{SOURCE_ROOT}{os.pathsep}/elsewhere"
    assert env["GGML_NO_BACKTRACE"] == "0" and env["X"] == "1"  # the caller's own choice stands
    assert process.child_env({})["GGML_NO_BACKTRACE"] == "1"


def test_a_child_leads_its_own_group_and_stop_all_kills_it() -> None:
    child = process.spawn(["sleep", "60"])
    assert os.getpgid(child.pid) == child.pid != os.getpgid(0)
    process.stop_all()
    assert child.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.load
def test_run_kills_a_child_past_its_timeout_and_keeps_what_it_wrote() -> None:
    assert process.run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=30) == (3, "out\n", "err\n")
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        process.run(["sh", "-c", "echo started; exec sleep 60"], timeout=0.5)
    assert time.monotonic() - t0 < 10 and e.value.stdout == "started\n"


@pytest.mark.load
@pytest.mark.parametrize("how", ["exits", "is terminated"])
def test_children_die_when_fitter_exits_or_is_terminated(how: str) -> None:
    code = ("import sys\nfrom fitter import process\n"
            "child = process.spawn(['sleep', '300'])\nprint(child.pid, flush=True)\nsys.stdin.readline()\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=process.child_env())
    assert parent.stdin is not None and parent.stdout is not None
    pid = int(parent.stdout.readline())
    assert _alive(pid)
    if how == "exits":
        parent.stdin.close()  # it reads EOF and exits normally
    else:
        parent.send_signal(signal.SIGTERM)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


@pytest.mark.load
def test_the_first_ctrl_c_only_asks_to_stop_and_the_second_stops_the_children() -> None:
    # Ctrl-C enabled in the child whatever this test was started with: a background shell starts everything with
    # SIGINT ignored, the child inherits that, and fitter rightly keeps an ignored Ctrl-C ignored
    # the callback writes with os.write, as fitter's own do (fitter.cli.tune): a print from a signal handler while the
    # main thread's print holds stdout's buffer raises "reentrant call" (seen on a loaded CI machine)
    code = ("import os, signal, time\nfrom fitter import process\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "child = process.spawn(['sleep', '300'])\n"
            "try:\n    with process.first_interrupt_deferred(lambda: os.write(1, b'asked\\n')):\n"
            "        print(child.pid, flush=True)  # the first Ctrl-C is sent once this is read: deferred by then\n"
            "        while True:\n            time.sleep(0.05)\n"
            "except KeyboardInterrupt:\n    print('interrupted', flush=True)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=process.child_env())
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    parent.send_signal(signal.SIGINT)
    assert parent.stdout.readline() == "asked\n" and _alive(pid)  # the child goes on
    parent.send_signal(signal.SIGINT)
    assert parent.stdout.readline() == "interrupted\n" and parent.wait(timeout=30) == 0
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)  # stopped with the second
