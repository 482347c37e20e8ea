"""The emulated small GPU: a capped llama.cpp RPC device, checked with real loads of the demo model."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fitter import ports
from fitter.flags import parse_launch_flags
from fitter.gguf.demo_models import SHAPES, write_model
from fitter.measure.emulator.capdev import (
    STATS_MAGIC,
    STATS_SIZE,
    EmulatedGpuError,
    EmulatedGpuStats,
    capped_server_argv,
    parse_stats,
    server_env,
    shim_library,
)
from fitter.measure.emulator.emulated_gpu import EmulatedGpu
from fitter.measure.logs import parse_buffer_lines, sum_by
from tests.ports import OCCUPANTS, first_pick_taken

MIB = 1024 * 1024

# ---------------------------------------------------------------------------------------------------------------
# Pure


def _words(**changes: int) -> bytes:
    # fitter/measure/emulator/native/capdev.c's layout: magic, version, seq, cap, used, peak, refused, last_refused,
    # allocs, live, reset_req, reset_seen, pid, memory_queries, held.
    w = [STATS_MAGIC, 1, 4, 64 * MIB, 3 * MIB, 5 * MIB, 2, 777, 9, 1, 0, 0, 4242, 6, 20 * MIB]
    names = ["magic", "version", "seq", "cap", "used", "peak", "refused", "last", "allocs", "live", "req", "seen"]
    for k, v in changes.items():
        w[names.index(k)] = v
    return struct.pack("<15Q", *w) + bytes(STATS_SIZE - 15 * 8)


def test_parse_stats_reads_the_shims_counters() -> None:
    assert parse_stats(_words()) == EmulatedGpuStats(
        cap_bytes=64 * MIB, used_bytes=3 * MIB, peak_bytes=5 * MIB, refused=2, last_refused_bytes=777,
        allocations=9, live_buffers=1, memory_queries=6, server_pid=4242, held_bytes=20 * MIB,
    )  # fmt: skip
    assert parse_stats(_words(seq=5)) is None  # odd: the shim is mid-update
    assert parse_stats(_words(magic=0)) is None  # the shim has not written the file yet
    # A reset_peak() the shim has not applied yet (no allocation since) reads as peak = used.
    st = parse_stats(_words(req=1))
    assert st is not None and st.peak_bytes == 3 * MIB
    with pytest.raises(EmulatedGpuError, match="need 120 bytes, got 8"):
        parse_stats(bytes(8))


def test_server_command_and_environment() -> None:
    cmd = capped_server_argv("127.0.0.1:5000", 1, 77, Path("/lib/x"))
    assert cmd[1:] == [
        "-m", "fitter.measure.emulator.capdev", "serve",
        "--endpoint", "127.0.0.1:5000", "--threads", "1", "--parent-pid", "77", "--lib-dir", "/lib/x",
    ]  # fmt: skip
    env = server_env({"LD_PRELOAD": "other.so", "X": "1"}, Path("/c/capdev.so"), Path("/t/stats"), 3 * MIB)
    assert env["LD_PRELOAD"] == "/c/capdev.so other.so"
    assert env["FITTER_CAPDEV_CAP_BYTES"] == str(3 * MIB)
    assert env["FITTER_CAPDEV_STATS"] == "/t/stats"
    assert env["X"] == "1"


def test_a_missing_c_compiler_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(EmulatedGpuError, match=r"needs a C compiler.*apt-get install gcc"):
        shim_library()


def test_the_cap_must_be_positive() -> None:
    with pytest.raises(EmulatedGpuError, match="at least 1 MiB, got 0"):
        EmulatedGpu(0)


# ---------------------------------------------------------------------------------------------------------------
# Real llama.cpp


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(SHAPES["demo"], tmp_path_factory.mktemp("models") / "demo.gguf")[0]


def _flags(gpu: EmulatedGpu) -> list[str]:
    return ["--rpc", gpu.endpoint, "-ngl", "99", "-c", "512", "-t", "1", "-fit", "off"]


def _load(model: Path, gpu: EmulatedGpu) -> tuple[bool, str, str]:
    from fitter.measure.loader import load_and_capture

    res = load_and_capture(model, parse_launch_flags(_flags(gpu)), timeout=120)
    assert res.returncode == 0, res.error  # failed allocations are errors, never a crash
    return res.ok, res.error or "", res.log


def _settled(gpu: EmulatedGpu) -> EmulatedGpuStats:
    """The counters once the server has freed the disconnected client's buffers (a deadline, not a count of polls:
    a loaded machine runs the server's cleanup seconds late, and an empty device returns at once)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = gpu.stats()
        if st.live_buffers == 0:
            return st
        time.sleep(0.01)
    raise AssertionError(f"the server kept buffers after the client left: {gpu.stats()}")


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


@pytest.mark.load
@pytest.mark.llama
def test_a_config_that_fits_loads_on_the_device_and_the_peak_covers_its_buffers(demo: Path) -> None:
    with EmulatedGpu(128) as gpu:
        pid = gpu.pid
        assert pid is not None and gpu.running
        assert gpu.device_name == f"RPC0[{gpu.endpoint}]"
        ok, error, log = _load(demo, gpu)
        assert ok, error
        # llama.cpp asked the device for its free memory and got the cap (ggml_backend_dev_memory in the server).
        assert f"using device RPC0 ({gpu.endpoint}) (unknown id) - 128 MiB free" in log
        got = sum_by(parse_buffer_lines(log))
        dev = gpu.device_name
        # The demo model with every layer offloaded: weights, two KV caches (SWA + full) of 2 MiB, compute.
        assert got[(dev, "model")] == 90.03
        assert got[(dev, "kv")] == 4.0
        assert got[(dev, "compute")] == 14.02
        st = _settled(gpu)
        assert st.cap_bytes == 128 * MIB
        assert st.peak_bytes >= (90.03 + 4.0 + 14.02 - 0.015) * MIB  # logged sizes are rounded to 0.01 MiB
        assert st.peak_bytes == 94408192 + 2 * 2097152 + 14698528  # the exact bytes the server allocated
        assert st.used_bytes == 0 and st.refused == 0 and st.allocations == 4
        assert st.memory_queries >= 2  # the server's start-up banner and the client
        gpu.reset_peak()
        assert gpu.stats().peak_bytes == 0
    assert not gpu.running and _gone(pid)
    assert gpu.stats().peak_bytes == 0  # the last counters outlive the server
    gpu.stop()  # idempotent


@pytest.mark.llama
def test_the_server_listens_on_127_0_0_1_only() -> None:
    with EmulatedGpu(64) as gpu:
        assert gpu.pid is not None
        port = int(gpu.endpoint.rsplit(":", 1)[1])
        assert gpu.endpoint == f"127.0.0.1:{port}"
        argv = Path(f"/proc/{gpu.pid}/cmdline").read_bytes().decode().split("\0")
        assert argv[argv.index("--endpoint") + 1] == gpu.endpoint
        assert ports.listening_addresses(gpu.pid) == {("127.0.0.1", port)}


@pytest.mark.llama
@pytest.mark.parametrize("how", OCCUPANTS)
def test_a_port_taken_before_the_server_binds_it_is_given_up_for_another(
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    with first_pick_taken(monkeypatch, how) as picks, EmulatedGpu(64) as gpu:
        assert len(picks) == 2 and picks[0] != picks[1]
        assert gpu.endpoint == f"127.0.0.1:{picks[1]}"
        assert gpu.pid is not None and ports.listening_addresses(gpu.pid) == {("127.0.0.1", picks[1])}


@pytest.mark.llama
def test_a_server_that_died_is_restarted_on_its_endpoint() -> None:
    with EmulatedGpu(64) as gpu:
        old, endpoint = gpu.pid, gpu.endpoint
        assert old is not None and gpu.died() is None
        os.kill(old, signal.SIGKILL)
        assert gpu.died(wait_s=5) == "killed by signal SIGKILL"
        gpu.restart()
        assert gpu.running and gpu.died() is None
        assert gpu.pid != old and gpu.endpoint == endpoint
        assert gpu.pid is not None and ports.listening_addresses(gpu.pid) == {("127.0.0.1", int(endpoint[10:]))}
        assert gpu.stats().server_pid == gpu.pid  # the fresh server's counters
    assert gpu.died() is None  # stopped, not dead


# cap MiB → the stage that fails, from the fitting load's sizes: model 90.03 MiB (94408192 B), then KV 2 x 2 MiB,
# then compute 14.02 MiB (14698528 B). The message llama.cpp raises, and the allocation the cap refused.
STAGES = [
    pytest.param(64, "llama_model_load_from_file failed", "unable to allocate {dev} buffer", 94408192, id="model"),
    pytest.param(91, "llama_init_from_model failed", "failed to allocate buffer for kv cache", 2097152, id="kv"),
    pytest.param(100, "llama_init_from_model failed", "failed to allocate compute pp buffers", 14698528, id="compute"),
]


@pytest.mark.llama
@pytest.mark.parametrize(("cap", "where", "message", "refused"), STAGES)
def test_over_budget_configs_fail_at_the_right_stage(
    demo: Path, cap: int, where: str, message: str, refused: int
) -> None:
    with EmulatedGpu(cap) as gpu:
        pid = gpu.pid
        assert pid is not None
        ok, error, _ = _load(demo, gpu)
        assert not ok
        dev = gpu.device_name
        assert error.startswith(where)
        assert message.format(dev=dev) in error
        # ggml names the buffer and the bytes it asked for: exactly what the cap refused.
        assert f"failed to allocate {dev} buffer of size {refused}" in error
        st = _settled(gpu)
        assert st.refused == 1 and st.last_refused_bytes == refused
        assert st.used_bytes == 0
        assert gpu.running  # the server survives a refused allocation
    assert _gone(pid)


@pytest.mark.llama
def test_a_server_without_the_cap_is_refused(demo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # ld.so only warns when LD_PRELOAD names a missing file: the server would run uncapped.
    monkeypatch.setattr("fitter.measure.emulator.emulated_gpu.shim_library", lambda: tmp_path / "missing.so")
    gpu = EmulatedGpu(64)
    with pytest.raises(EmulatedGpuError, match="the memory cap shim was not loaded into the server"):
        gpu.start()
    assert not gpu.running


_PARENT = """
import os, signal, sys, time
from fitter.measure.emulator.emulated_gpu import EmulatedGpu
gpu = EmulatedGpu(64).start()
print(gpu.pid, gpu._dir, flush=True)
os.kill(os.getpid(), getattr(signal, sys.argv[1]))
time.sleep(30)
"""


def _dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (a parent killed with SIGKILL leaves its child to init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.mark.load
@pytest.mark.llama
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_the_server_does_not_outlive_its_parent(demo: Path, sig: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _PARENT, sig], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -getattr(signal, sig), proc.stderr
    pid, own_dir = int(proc.stdout.split()[0]), Path(proc.stdout.split()[1])
    deadline = time.monotonic() + 60  # the server's watchdog and cleanup run late on a loaded machine
    while not (_dead(pid) and not own_dir.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dead(pid)
    assert not own_dir.exists()  # the counters and log go with the server
