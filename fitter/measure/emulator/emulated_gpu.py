"""A capped llama.cpp RPC device on 127.0.0.1 that behaves like a small GPU on a CPU-only machine.

llama.cpp's RPC backend serves a device over TCP; the client sees a GPU-type device and names its buffers
`RPC0[127.0.0.1:PORT]`. Served as is, the device reports the host's RAM and never refuses an allocation. The
server started here runs with the LD_PRELOAD shim `fitter/measure/emulator/native/capdev.c`, which advertises `cap_mib`
MiB and refuses every allocation past it, so an over-budget configuration fails the way it fails on a small GPU and at
the same stage: model weights (`unable to allocate RPC0[…] buffer`), KV cache (`failed to allocate buffer for kv
cache`) or compute buffers (`failed to allocate compute pp buffers`). The shim's counters (bytes in use, peak,
refusals) live in a shared file that `EmulatedGpu.stats()` reads.

The server is `python -m fitter.measure.emulator.capdev serve …` (fitter.measure.emulator.capdev): a child that calls
ggml's `ggml_backend_rpc_start_server(endpoint, cache_dir, n_threads, n_devices, devices)` (ggml/include/ggml-rpc.h,
llama.cpp 0c1e570) on the CPU device, through the ggml of a shared build with RPC beside the llama.cpp binary it
serves (`beside`), else the copies llama-cpp-python loads. It serves one client at a time (ggml's accept loop is
serial) and frees a client's buffers when it disconnects. It is stopped by `stop()`,
leaving the `with` block, interpreter exit, SIGTERM/SIGINT in the parent, or the parent's death (the child polls
its parent pid).

Linux only (LD_PRELOAD, /proc). The shim is compiled at first use with the system C compiler into
`fitter_home()/native/`, keyed by a hash of its source.
"""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

from fitter import ports, process
from fitter.machine.environment import with_environment
from fitter.measure.emulator.capdev import (
    _DIR_PREFIX,
    _LOG_TAIL,
    CUDA_RPC_ENV,
    STATS_SIZE,
    EmulatedGpuError,
    EmulatedGpuStats,
    _llama_lib_dir,
    capped_server_argv,
    cuda_library,
    emulated_gpu_problem,
    read_stats,
    request_peak_reset,
    server_env,
    set_held,
    shim_library,
)
from fitter.memory.backends.devices import CUDA, RPC, Device, rpc_device_name
from fitter.units import MIB

__all__ = ["EmulatedGpu", "EmulatedGpuError", "EmulatedGpuStats", "EmulatedGpus", "emulated_gpu_problem"]

HOST = ports.HOST
_READY_POLL_S = 0.01
_START_ATTEMPTS = 3  # a port found free can be taken before the server binds it: try another
# how a lost port race shows: the server's bind failed (ggml-rpc.cpp `ggml_backend_rpc_start_server`), or another
# process listens there too
_PORT_LOST = ("Failed to create server socket", "is taken by another process")


def emulated_device(name: str, cap_bytes: int, cuda: bool) -> Device:
    """The emulated GPU as the estimator sees it: free memory = its cap, RPC's rules or (CUDA-shaped) CUDA's."""
    (device,) = with_environment((Device(name, CUDA if cuda else RPC, cap_bytes, cap_bytes),))
    return device


def _set_cuda_endpoint(endpoint: str, on: bool) -> None:
    """Add or remove `endpoint` in the environment the children inherit (capi.CUDA_RPC_ENV)."""
    endpoints = [e for e in os.environ.get(CUDA_RPC_ENV, "").split(",") if e and e != endpoint]
    if on:
        endpoints.append(endpoint)
    if endpoints:
        os.environ[CUDA_RPC_ENV] = ",".join(endpoints)
    else:
        os.environ.pop(CUDA_RPC_ENV, None)


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((HOST, port)) == 0  # the server reads no HELLO and drops this connection


class EmulatedGpu:
    """A llama.cpp RPC device on 127.0.0.1 capped at `cap_mib` MiB. Pass `--rpc <endpoint>` to llama.cpp.

    >>> with EmulatedGpu(512) as gpu:                     # doctest: +SKIP
    ...     load_and_capture(model, parse_launch_flags(["--rpc", gpu.endpoint, "-ngl", "99"]))
    ...     gpu.stats().peak_bytes
    """

    def __init__(self, cap_mib: int, threads: int = 1, cuda: bool = False, beside: str | Path | None = None) -> None:
        if cap_mib < 1:
            raise EmulatedGpuError(f"emulated GPU cap: must be at least 1 MiB, got {cap_mib}")
        if threads < 1:
            raise EmulatedGpuError(f"emulated GPU threads: must be at least 1, got {threads}")
        self.cap_mib = cap_mib
        self.threads = threads
        self.cuda = cuda  # CUDA-shaped: CUDA's buffer sizes on the server, its scheduling rules in the clients
        self.beside = beside  # the llama.cpp binary served: its shared ggml serves, when it has RPC
        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._dir: Path | None = None
        self._stats_file: mmap.mmap | None = None
        self._final: EmulatedGpuStats | None = None
        self._lock = threading.RLock()  # re-entrant: the signal handler's stop() may interrupt start()
        self.start_seconds = 0.0
        self.stop_seconds = 0.0

    # -- properties ------------------------------------------------------------------------------------------

    @property
    def cap_bytes(self) -> int:
        return self.cap_mib * MIB

    @property
    def endpoint(self) -> str:
        """`127.0.0.1:PORT`, the value for llama.cpp's `--rpc` (still readable after stop(), for reports)."""
        if self._port is None:
            raise EmulatedGpuError("emulated GPU endpoint: the server was never started (call start())")
        return f"{HOST}:{self._port}"

    @property
    def device_name(self) -> str:
        """The name llama.cpp gives this device's buffers and buffer type, e.g. `RPC0[127.0.0.1:50052]`.

        The 0 is the device's index on this server (it serves one), so it stays 0 whatever other RPC servers
        the client registers; the client's device list calls it `RPC<n>` with a client-wide counter.
        """
        return rpc_device_name(self.endpoint)

    def device(self) -> Device:
        """This device as the estimator sees it (`emulated_device`)."""
        return emulated_device(self.device_name, self.cap_bytes, self.cuda)

    @property
    def pid(self) -> int | None:
        """The server child's pid while it runs."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle -------------------------------------------------------------------------------------------

    def __enter__(self) -> EmulatedGpu:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self, timeout: float = 30.0, port: int | None = None) -> EmulatedGpu:
        """Start the server on a free port (or on `port`) and return once it accepts TCP connections."""
        with self._lock:
            if self._proc is not None:
                raise EmulatedGpuError(f"emulated GPU: already started at {self.endpoint}")
            t0 = time.perf_counter()
            shim = shim_library()
            if self.cuda:
                cuda_library()  # built now, so the clients only load it
            lib_dir = _llama_lib_dir(self.beside)
            self._final = None
            self._dir = Path(tempfile.mkdtemp(prefix=_DIR_PREFIX))
            try:
                self._start(shim, lib_dir, timeout, port)
            except BaseException:
                self._teardown()
                raise
            process.register(id(self), self.stop)
            if self.cuda:  # the clients fitter starts from now on give this device CUDA's rules (capi.py)
                _set_cuda_endpoint(self.endpoint, True)
            self.start_seconds = time.perf_counter() - t0
        return self

    def restart(self, timeout: float = 30.0) -> EmulatedGpu:
        """A fresh server on the same endpoint, after this one died: the trials' --rpc and the device's name carry
        the endpoint. The old server's connections may hold the port in TIME_WAIT; ggml's RPC server binds with
        SO_REUSEADDR (ggml/src/ggml-rpc/transport.cpp `create_server`), so only another listener stops it."""
        with self._lock:
            if self._port is None:
                raise EmulatedGpuError("emulated GPU restart: the server was never started (call start())")
            port = self._port
            self.stop()
            return self.start(timeout, port)

    def died(self, wait_s: float = 0.0) -> str | None:
        """How the server ended when it ended on its own (waiting up to `wait_s` for that): `exited with status N` or
        `killed by signal SIGKILL`; None while it runs, and after stop()."""
        proc = self._proc
        if proc is None:
            return None
        try:
            rc = proc.wait(timeout=wait_s) if wait_s > 0 else proc.poll()
        except subprocess.TimeoutExpired:
            return None
        if rc is None:
            return None
        return f"killed by signal {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"

    def _start(self, shim: Path, lib_dir: Path, timeout: float, fixed_port: int | None) -> None:
        assert self._dir is not None
        stats_path, log_path = self._dir / "stats", self._dir / "server.log"
        failures: list[str] = []
        for _ in range(1 if fixed_port is not None else _START_ATTEMPTS):
            stats_path.write_bytes(bytes(STATS_SIZE))
            port = fixed_port if fixed_port is not None else ports.pick_free_port("emulated GPU")
            env = server_env(os.environ, shim, stats_path, self.cap_bytes, self.cuda)
            cmd = capped_server_argv(f"{HOST}:{port}", self.threads, os.getpid(), lib_dir)
            with log_path.open("wb") as log:
                # Its own session: a terminal's Ctrl-C reaches the parent, whose handler decides (and stops it).
                self._proc = process.spawn(cmd, env=env, stdout=log, stderr=log)
            self._port = port
            why = self._wait_ready(port, timeout)
            if why is None:
                self._open_stats(stats_path)
                return
            self._kill()
            failures.append(why)
            if not any(lost in why for lost in _PORT_LOST):  # only a lost port race is worth another try
                break
        raise EmulatedGpuError(f"emulated GPU ({self.cap_mib} MiB) did not start: {failures[-1]}")

    def _wait_ready(self, port: int, timeout: float) -> str | None:
        """None once the child alone listens on `port` and accepts a connection; else why not."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self._proc.poll()
            if rc is not None:
                return f"the server exited with status {rc}: {self._log_tail()}"
            state = ports.port_state(self._proc.pid, port)
            if state == "taken":
                return f"{HOST}:{port} {_PORT_LOST[1]}"
            if state == "ours" and _accepts(port):
                return None
            time.sleep(_READY_POLL_S)
        return f"the server did not listen on {HOST}:{port} within {timeout:g} s: {self._log_tail()}"

    def _open_stats(self, path: Path) -> None:
        with path.open("r+b") as f:
            self._stats_file = mmap.mmap(f.fileno(), STATS_SIZE)
        st = self._read_stats()
        if st is None or st.server_pid != self.pid:
            raise EmulatedGpuError(
                f"emulated GPU: the memory cap shim was not loaded into the server (pid {self.pid}); "
                f"its counters read {st}: {self._log_tail()}"
            )

    def stop(self) -> None:
        """Stop the server (idempotent). stats() keeps answering with the last counters."""
        with self._lock:
            if self._proc is None and self._dir is None:
                return
            t0 = time.perf_counter()
            process.unregister(id(self))
            if self._stats_file is not None:
                self._final = self._read_stats() or self._final
            self._teardown()
            self.stop_seconds = time.perf_counter() - t0

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            process.stop(proc, grace_s=5)  # the child keeps SIGTERM's default action: it dies at once, even in ggml

    def _teardown(self) -> None:
        if self.cuda and self._port is not None:
            _set_cuda_endpoint(self.endpoint, False)
        self._kill()
        if self._stats_file is not None:
            self._stats_file.close()
            self._stats_file = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _log_tail(self) -> str:
        if self._dir is None:
            return ""
        try:
            text = (self._dir / "server.log").read_text(errors="replace")
        except OSError:
            return ""
        return text.strip()[-_LOG_TAIL:] or "(no output)"

    # -- counters --------------------------------------------------------------------------------------------

    def _read_stats(self) -> EmulatedGpuStats | None:
        return read_stats(self._stats_file) if self._stats_file is not None else None

    def stats(self) -> EmulatedGpuStats:
        """The cap's counters now (after stop(): as they were when it stopped)."""
        st = self._read_stats() if self._stats_file is not None else self._final
        if st is None:
            raise EmulatedGpuError("emulated GPU stats: the server was never started or its counters are unreadable")
        return st

    def reset_peak(self) -> None:
        """Restart the peak counter from the bytes in use now."""
        f = self._stats_file
        if f is None:
            raise EmulatedGpuError("emulated GPU reset_peak: the server is not running")
        request_peak_reset(f)

    def hold(self, held_bytes: int) -> None:
        """Let another process hold `held_bytes` of this device from now on (0: none), as a browser or a second
        model holds part of a real GPU: llama.cpp's clients see that much less free memory (`--list-devices`, the
        RPC server's memory answer) and an allocation past the cap less it is refused. The RPC server serves one
        client at a time, so a second client cannot hold memory on it; the shim counts this for one."""
        f = self._stats_file
        if f is None:
            raise EmulatedGpuError("emulated GPU hold: the server is not running")
        set_held(f, held_bytes)


class EmulatedGpus:
    """Several capped devices, one RPC server each (`--emulated-gpu 96,48`): the client registers every endpoint
    (`--rpc A,B`) and names the devices `RPC0[A]`, `RPC0[B]`, each server's device 0 (ggml-rpc.cpp), so llama.cpp's
    own loader splits layers by their free memory (their caps) and each runs out of memory on its own cap."""

    def __init__(self, caps_mib: tuple[int, ...], threads: int = 1, cuda: bool = False,
                 beside: str | Path | None = None) -> None:
        if not caps_mib:
            raise EmulatedGpuError("emulated GPUs: give at least one cap")
        self.gpus = tuple(EmulatedGpu(cap, threads, cuda, beside) for cap in caps_mib)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(g.endpoint for g in self.gpus)

    def devices(self) -> tuple[Device, ...]:
        return tuple(g.device() for g in self.gpus)

    def __enter__(self) -> EmulatedGpus:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> EmulatedGpus:
        try:
            for g in self.gpus:
                g.start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for g in self.gpus:
            g.stop()

    def died(self, wait_s: float = 0.0) -> str | None:
        """How the first server that ended on its own ended, naming it; None while all run."""
        for g in self.gpus:
            how = g.died(wait_s)
            if how is not None:
                return f"({g.endpoint}) {how}"
        return None

    def restart_dead(self) -> bool:
        """Restart every server that died, on its endpoint; whether any did."""
        dead = [g for g in self.gpus if g.died() is not None]
        for g in dead:
            g.restart()
        return bool(dead)

    def reset_peak(self) -> None:
        for g in self.gpus:
            g.reset_peak()

    def wait_until_empty(self, timeout_s: float = 10.0) -> bool:
        """Wait until no buffer is allocated on any of the devices (False: some still were after `timeout_s`).

        A client's frees reach the server after the client has moved on (ggml-rpc sends FREE_BUFFER without waiting
        for the server; a client that exits is torn down by the server after it left), and the shim restarts a peak
        from the bytes in use when it applies the reset: a reset the server meets before those frees would count
        the previous trial's buffers in the next one's peak."""
        deadline = time.monotonic() + timeout_s
        while any(g.stats().used_bytes for g in self.gpus):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def peaks(self) -> dict[str, int]:
        """Peak bytes per device name since the last reset."""
        return {g.device_name: g.stats().peak_bytes for g in self.gpus}
