"""The tests that once depended on how the suite was started, run as a background shell starts them: SIGINT
ignored (and so inherited ignored by every child), stdin /dev/null, no controlling terminal, PATH without
/usr/sbin. The README's test command hung for 66 minutes that way: the Ctrl-C test waited forever on a child that,
as fitter rightly does, kept an inherited ignored Ctrl-C ignored (so did the tune's Ctrl-C fault tests); the
PostgreSQL fleet tests could not find runuser. Each runs here in a pytest of its own under those conditions, with a
deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.storage.postgres import server_binaries

REPO = Path(__file__).resolve().parent.parent
CTRL_C = "tests/test_process.py::test_the_first_ctrl_c_only_asks_to_stop_and_the_second_stops_the_children"
TUNE_CTRL_C = "tests/storage/test_faults.py::test_the_first_ctrl_c_ends_the_running_trial_and_the_same_command_resumes"
FLEET = "tests/storage/test_fleet.py::test_claims_hold_settle_finish_and_go_stale[postgres]"


def _ignore_sigint() -> None:  # what `cmd &` in a non-interactive shell does to its children
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_as_background_shell(*nodes: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PATH", "TERM")}
    env["PATH"] = "/usr/bin:/bin"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodes], cwd=REPO, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240,
                          preexec_fn=_ignore_sigint, start_new_session=True)


@pytest.mark.load
def test_the_ctrl_c_tests_pass_when_the_suite_starts_with_sigint_ignored() -> None:
    run = _run_as_background_shell(CTRL_C, TUNE_CTRL_C)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 passed" in run.stdout


@pytest.mark.skipif(server_binaries() is None, reason="no PostgreSQL server binaries (.ci/setup installs them)")
def test_the_postgresql_fleet_tests_find_their_tools_without_usr_sbin_on_path() -> None:
    run = _run_as_background_shell(FLEET)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout
