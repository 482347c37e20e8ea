"""A capped llama.cpp RPC device on 127.0.0.1 that behaves like a small GPU on a CPU-only machine.

llama.cpp's RPC backend serves a device over TCP; the client sees a GPU-type device and names its buffers
`RPC0[127.0.0.1:PORT]`. Served as is, the device reports the host's RAM and never refuses an allocation. The
server started here runs with the LD_PRELOAD shim `fitter/native/capdev.c`, which advertises `cap_mib` MiB and
refuses every allocation past it, so an over-budget configuration fails the way it fails on a small GPU and at
the same stage: model weights (`unable to allocate RPC0[…] buffer`), KV cache (`failed to allocate buffer for kv
cache`) or compute buffers (`failed to allocate compute pp buffers`). The shim's counters (bytes in use, peak,
refusals) live in a shared file that `EmulatedGpu.stats()` reads.

The server is `python -m fitter.emulated_gpu serve …`: a child that calls ggml's
`ggml_backend_rpc_start_server(endpoint, cache_dir, n_threads, n_devices, devices)` (ggml/include/ggml-rpc.h,
llama.cpp 0c1e570) on the CPU device, through the ggml copies llama-cpp-python ships. It serves one client at a
time (ggml's accept loop is serial) and frees a client's buffers when it disconnects. It is stopped by `stop()`,
leaving the `with` block, interpreter exit, SIGTERM/SIGINT in the parent, or the parent's death (the child polls
its parent pid).

Linux only (LD_PRELOAD, /proc). The shim is compiled at first use with the system C compiler into
`fitter_home()/native/`, keyed by a hash of its source.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import hashlib
import importlib.util
import mmap
import os
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from fitter.errors import FitterError

__all__ = [
    "EmulatedGpu",
    "EmulatedGpuError",
    "EmulatedGpuStats",
    "parse_stats",
    "server_command",
    "server_env",
    "shim_library",
]

HOST = "127.0.0.1"
SHIM_SOURCE = "capdev.c"  # in the fitter.native package
MIB = 1024 * 1024

# The counters file, as fitter/native/capdev.c lays it out: little-endian 64-bit words.
STATS_SIZE = 4096
STATS_MAGIC = 0x3156454450414346  # "FCAPDEV1"
(
    _W_MAGIC,
    _W_VERSION,
    _W_SEQ,
    _W_CAP,
    _W_USED,
    _W_PEAK,
    _W_REFUSED,
    _W_LAST_REFUSED,
    _W_ALLOCS,
    _W_LIVE,
    _W_RESET_REQ,
    _W_RESET_SEEN,
    _W_PID,
    _W_MEMORY_QUERIES,
) = range(14)
_N_WORDS = 14
_WORDS = struct.Struct(f"<{_N_WORDS}Q")

_READY_POLL_S = 0.01
_PARENT_POLL_S = 0.2
_START_ATTEMPTS = 3  # a port found free can be taken before the server binds it: try another
_LOG_TAIL = 2000
_DIR_PREFIX = "fitter-emulated-gpu-"  # the temporary directory of a server's counters and log


class EmulatedGpuError(FitterError):
    """The emulated GPU could not be built, started or read."""


@dataclass(frozen=True)
class EmulatedGpuStats:
    """The cap's own counters, in bytes as the server allocated them (refused allocations are not in use)."""

    cap_bytes: int
    used_bytes: int  # buffers allocated and not yet freed
    peak_bytes: int  # the most bytes in use at once since start or the last reset_peak()
    refused: int  # allocations the cap refused
    last_refused_bytes: int  # bytes asked for by the last refused allocation (0: none refused)
    allocations: int = 0  # allocations that succeeded
    live_buffers: int = 0
    memory_queries: int = 0  # ggml_backend_dev_memory calls the cap answered (the client's free-memory queries)
    server_pid: int = 0


def parse_stats(data: bytes) -> EmulatedGpuStats | None:
    """The counters in a snapshot of the shim's stats file; None while the shim is mid-update or not started.

    A peak reset the shim has not applied yet (no allocation since) reads as peak = used, as the shim will set it.
    """
    if len(data) < _WORDS.size:
        raise EmulatedGpuError(f"emulated GPU stats: need {_WORDS.size} bytes, got {len(data)}")
    w = _WORDS.unpack_from(data)
    if w[_W_MAGIC] != STATS_MAGIC or w[_W_SEQ] % 2:
        return None
    peak = w[_W_USED] if w[_W_RESET_REQ] != w[_W_RESET_SEEN] else w[_W_PEAK]
    return EmulatedGpuStats(
        cap_bytes=w[_W_CAP],
        used_bytes=w[_W_USED],
        peak_bytes=peak,
        refused=w[_W_REFUSED],
        last_refused_bytes=w[_W_LAST_REFUSED],
        allocations=w[_W_ALLOCS],
        live_buffers=w[_W_LIVE],
        memory_queries=w[_W_MEMORY_QUERIES],
        server_pid=w[_W_PID],
    )


def server_command(endpoint: str, threads: int, parent_pid: int, lib_dir: Path) -> list[str]:
    """The argv of the server child (`python -m fitter.emulated_gpu serve …`)."""
    return [
        sys.executable, "-m", "fitter.emulated_gpu", "serve",
        "--endpoint", endpoint, "--threads", str(threads), "--parent-pid", str(parent_pid), "--lib-dir", str(lib_dir),
    ]  # fmt: skip


def server_env(base: Mapping[str, str], shim: Path, stats_path: Path, cap_bytes: int) -> dict[str, str]:
    """The server child's environment: `base` plus the shim preloaded, its cap and its counters file."""
    env = dict(base)
    env["LD_PRELOAD"] = str(shim) + (" " + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    env["FITTER_CAPDEV_CAP_BYTES"] = str(cap_bytes)
    env["FITTER_CAPDEV_STATS"] = str(stats_path)
    root = str(Path(__file__).resolve().parent.parent)  # so `-m fitter…` resolves from any directory
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("GGML_NO_BACKTRACE", "1")  # an abort would otherwise run gdb for a backtrace
    return env


# ---------------------------------------------------------------------------------------------------------------
# The shim


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", ""))
    if cc and shutil.which(cc[0]):
        return cc
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise EmulatedGpuError(
        "the emulated GPU's memory cap (fitter/native/capdev.c) is compiled at first use and needs a C compiler: "
        f"none of $CC ({os.environ.get('CC', 'unset')!r}), cc, gcc, clang is on PATH; install one "
        "(e.g. `apt-get install gcc`) or set CC"
    )


def shim_library() -> Path:
    """The compiled shim, built on first use into `fitter_home()/native/capdev-<source hash>.so`."""
    from fitter.demo_models import fitter_home  # numpy/gguf: not needed in the server child

    source = resources.files("fitter.native").joinpath(SHIM_SOURCE).read_bytes()
    out = fitter_home() / "native" / f"capdev-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if out.is_file():
        return out
    cc = _compiler()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        src, lib = Path(tmp) / SHIM_SOURCE, Path(tmp) / "capdev.so"
        src.write_bytes(source)
        cmd = [*cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl", "-pthread"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise EmulatedGpuError(f"compiling {SHIM_SOURCE} with `{shlex.join(cmd)}` failed: {e}") from e
        if proc.returncode != 0 or not lib.is_file():
            raise EmulatedGpuError(
                f"compiling {SHIM_SOURCE} with `{shlex.join(cmd)}`: exit status {proc.returncode}: "
                f"{(proc.stderr or proc.stdout).strip()[-_LOG_TAIL:]}"
            )
        os.replace(lib, out)  # atomic: a concurrent build of the same source writes the same file
    return out


def _llama_lib_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise EmulatedGpuError(
            "the emulated GPU serves llama.cpp's RPC backend from llama-cpp-python, which is not installed: "
            'install fitter[llama] built with CMAKE_ARGS="-DGGML_RPC=ON"'
        )
    lib_dir = Path(spec.origin).parent / "lib"
    rpc = lib_dir / "libggml-rpc.so.0"
    if not rpc.is_file():
        raise EmulatedGpuError(
            f"the emulated GPU needs llama.cpp's RPC backend: {rpc} is missing; "
            'rebuild llama-cpp-python with CMAKE_ARGS="-DGGML_RPC=ON"'
        )
    return lib_dir


# ---------------------------------------------------------------------------------------------------------------
# Ports


def _port_is_free(port: int) -> bool:
    """Nothing listens on HOST:port and it can be bound (bind without SO_REUSEADDR is the stricter test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) != 0


def _pick_free_port() -> int:
    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if _port_is_free(port):
            return port
    raise EmulatedGpuError(f"emulated GPU: found no free TCP port on {HOST} in 20 tries")


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on HOST:port (or any address) per /proc/net/tcp."""
    wanted = {f"0100007F:{port:04X}", f"00000000:{port:04X}"}
    inodes: set[str] = set()
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return inodes
    for line in lines:
        f = line.split()
        if len(f) > 9 and f[1] in wanted and f[3] == "0A":  # st 0A: TCP_LISTEN
            inodes.add(f[9])
    return inodes


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on HOST:port (True where /proc cannot tell)."""
    if not Path("/proc/net/tcp").is_file():
        return True
    inodes = _listening_inodes(port)
    if not inodes:
        return False
    links = {f"socket:[{i}]" for i in inodes}
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in links:
                return True
        except OSError:
            continue
    return False


def _accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((HOST, port)) == 0  # the server reads no HELLO and drops this connection


# ---------------------------------------------------------------------------------------------------------------
# Cleanup on exit and on signals


_LIVE: set[EmulatedGpu] = set()
_LIVE_LOCK = threading.RLock()  # re-entrant: a signal handler may run while it is held
_PREVIOUS: dict[int, Any] = {}
_ATEXIT_REGISTERED = False
_SIGNALS_INSTALLED = False


def _stop_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for gpu in live:
        gpu.stop()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _stop_all()
    previous = _PREVIOUS.get(signum)
    if callable(previous):
        previous(signum, frame)
    else:  # SIG_DFL (or a handler set outside Python): die as the signal would have killed us
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_hooks() -> None:
    """atexit once; SIGTERM/SIGINT handlers that stop the servers and then defer to the previous handlers."""
    global _ATEXIT_REGISTERED, _SIGNALS_INSTALLED
    if not _ATEXIT_REGISTERED:
        atexit.register(_stop_all)
        _ATEXIT_REGISTERED = True
    if _SIGNALS_INSTALLED or threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; the child still sees the parent die
    _SIGNALS_INSTALLED = True
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)
        if previous == signal.SIG_IGN:  # the process goes on after this signal: so does its server
            continue
        _PREVIOUS[signum] = previous
        signal.signal(signum, _on_signal)


# ---------------------------------------------------------------------------------------------------------------
# The device


class EmulatedGpu:
    """A llama.cpp RPC device on 127.0.0.1 capped at `cap_mib` MiB. Pass `--rpc <endpoint>` to llama.cpp.

    >>> with EmulatedGpu(512) as gpu:                     # doctest: +SKIP
    ...     load_and_capture(model, parse_launch_flags(["--rpc", gpu.endpoint, "-ngl", "99"]))
    ...     gpu.stats().peak_bytes
    """

    def __init__(self, cap_mib: int, threads: int = 1) -> None:
        if cap_mib < 1:
            raise EmulatedGpuError(f"emulated GPU cap: must be at least 1 MiB, got {cap_mib}")
        if threads < 1:
            raise EmulatedGpuError(f"emulated GPU threads: must be at least 1, got {threads}")
        self.cap_mib = cap_mib
        self.threads = threads
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
        return f"RPC0[{self.endpoint}]"

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

    def start(self, timeout: float = 30.0) -> EmulatedGpu:
        """Start the server on a free port and return once it accepts TCP connections."""
        with self._lock:
            if self._proc is not None:
                raise EmulatedGpuError(f"emulated GPU: already started at {self.endpoint}")
            t0 = time.perf_counter()
            shim = shim_library()
            lib_dir = _llama_lib_dir()
            _install_hooks()
            self._final = None
            self._dir = Path(tempfile.mkdtemp(prefix=_DIR_PREFIX))
            try:
                self._start(shim, lib_dir, timeout)
            except BaseException:
                self._teardown()
                raise
            with _LIVE_LOCK:
                _LIVE.add(self)
            self.start_seconds = time.perf_counter() - t0
        return self

    def _start(self, shim: Path, lib_dir: Path, timeout: float) -> None:
        assert self._dir is not None
        stats_path, log_path = self._dir / "stats", self._dir / "server.log"
        failures: list[str] = []
        for _ in range(_START_ATTEMPTS):
            stats_path.write_bytes(bytes(STATS_SIZE))
            port = _pick_free_port()
            env = server_env(os.environ, shim, stats_path, self.cap_bytes)
            cmd = server_command(f"{HOST}:{port}", self.threads, os.getpid(), lib_dir)
            with log_path.open("wb") as log:
                # Its own session: a terminal's Ctrl-C reaches the parent, whose handler decides (and stops it).
                self._proc = subprocess.Popen(
                    cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
                )
            self._port = port
            why = self._wait_ready(port, timeout)
            if why is None:
                self._open_stats(stats_path)
                return
            self._kill()
            failures.append(why)
            if "Failed to create server socket" not in why:  # only a lost port race is worth another try
                break
        raise EmulatedGpuError(f"emulated GPU ({self.cap_mib} MiB) did not start: {failures[-1]}")

    def _wait_ready(self, port: int, timeout: float) -> str | None:
        """None once the child listens on `port` and accepts a connection; else why not."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self._proc.poll()
            if rc is not None:
                return f"the server exited with status {rc}: {self._log_tail()}"
            if _listens(self._proc.pid, port) and _accepts(port):
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
            with _LIVE_LOCK:
                _LIVE.discard(self)
            if self._stats_file is not None:
                self._final = self._read_stats() or self._final
            self._teardown()
            self.stop_seconds = time.perf_counter() - t0

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()  # the child keeps SIGTERM's default action: it dies at once, even inside ggml
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _teardown(self) -> None:
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
        f = self._stats_file
        if f is None:
            return None
        for _ in range(10000):  # seqlock: retry while the shim is mid-update
            seq = struct.unpack_from("<Q", f, _W_SEQ * 8)[0]
            st = parse_stats(f[: _WORDS.size])
            if st is not None and struct.unpack_from("<Q", f, _W_SEQ * 8)[0] == seq:
                return st
            time.sleep(0)
        return None

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
        req = struct.unpack_from("<Q", f, _W_RESET_REQ * 8)[0]
        struct.pack_into("<Q", f, _W_RESET_REQ * 8, req + 1)  # the parent is this word's only writer


# ---------------------------------------------------------------------------------------------------------------
# Server child: `python -m fitter.emulated_gpu serve …`


def _watch_parent(parent_pid: int, own_dir: Path | None) -> None:
    while True:
        if os.getppid() != parent_pid:  # reparented: the parent died without stopping us
            if own_dir is not None:  # the parent can no longer remove the counters and log
                shutil.rmtree(own_dir, ignore_errors=True)
            os._exit(0)  # from this thread too: the main thread is inside ggml's accept loop
        time.sleep(_PARENT_POLL_S)


def _serve(endpoint: str, threads: int, parent_pid: int, lib_dir: Path) -> int:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a Ctrl-C in the terminal stops us even inside ggml
    if os.getppid() != parent_pid:
        return 0
    stats = os.environ.get("FITTER_CAPDEV_STATS")
    own_dir = Path(stats).parent if stats else None
    if own_dir is not None and not own_dir.name.startswith(_DIR_PREFIX):
        own_dir = None  # not a directory EmulatedGpu made: leave it alone
    threading.Thread(target=_watch_parent, args=(parent_pid, own_dir), daemon=True).start()
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    # By soname: the very copies libggml-rpc links against (the unversioned .so would be a second ggml).
    ctypes.CDLL(str(lib_dir / "libggml-base.so.0"))
    ggml = ctypes.CDLL(str(lib_dir / "libggml.so.0"))
    rpc = ctypes.CDLL(str(lib_dir / "libggml-rpc.so.0"))
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_by_type.restype = vp
    rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, sz, sz, ctypes.POINTER(vp)]
    rpc.ggml_backend_rpc_start_server.restype = None
    cpu = ggml.ggml_backend_dev_by_type(0)  # enum ggml_backend_dev_type: GGML_BACKEND_DEVICE_TYPE_CPU
    if not cpu:
        print("emulated GPU server: ggml has no CPU device", file=sys.stderr)
        return 3
    devices = (vp * 1)(cpu)
    # Blocks serving clients; returns only if it could not start (ggml prints why).
    rpc.ggml_backend_rpc_start_server(endpoint.encode(), None, threads, 1, devices)
    sys.stdout.flush()
    return 1


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m fitter.emulated_gpu")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the CPU device over llama.cpp RPC (run with the capdev shim)")
    serve.add_argument("--endpoint", required=True)
    serve.add_argument("--threads", type=int, default=1)
    serve.add_argument("--parent-pid", type=int, required=True)
    serve.add_argument("--lib-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    return _serve(args.endpoint, args.threads, args.parent_pid, args.lib_dir)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
