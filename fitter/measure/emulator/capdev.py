"""The emulated GPU's server side: the memory-cap shim (`fitter/measure/emulator/native/capdev.c`, compiled at first
use), the layout of its counters file, and the server child `python -m fitter.measure.emulator.capdev serve …`, which
serves ggml's CPU device over llama.cpp's RPC backend with the shim preloaded.

The child calls `ggml_backend_rpc_start_server(endpoint, cache_dir, n_threads, n_devices, devices)`
(ggml/include/ggml-rpc.h, llama.cpp 0c1e570) through the ggml of a shared llama.cpp build with RPC (the one beside
the user's llama-server, or fitter's tools) or, without one, the copies llama-cpp-python loads; serves one client
at a time (ggml's accept loop is serial) and exits when its parent dies (it polls the parent's pid).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import mmap
import os
import shlex
import shutil
import signal
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

from fitter import process
from fitter.errors import FitterError
from fitter.machine.llama_cpp import llama_cpp_python_lib_dir
from fitter.paths import fitter_home

CUDA_RPC_ENV = "FITTER_CUDA_RPC"  # RPC endpoints (comma-separated) of CUDA-shaped emulated GPUs, for the children
SHIM_SOURCE = "capdev.c"  # in the fitter.measure.emulator.native package: the server's memory cap
CUDA_SOURCE = "cudadev.c"  # the client's CUDA device rules (the CUDA-shaped emulated GPU)
_HEADERS = ("cudarules.h",)  # included by both
# The counters file, as fitter/measure/emulator/native/capdev.c lays it out: little-endian 64-bit words.
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
    _W_HELD,
) = range(15)
_N_WORDS = 15
_WORDS = struct.Struct(f"<{_N_WORDS}Q")
_PARENT_POLL_S = 0.2
_LOG_TAIL = 2000
_DIR_PREFIX = "fitter-emulated-gpu-"  # the temporary directory of a server's counters and log


class EmulatedGpuError(FitterError):
    """The emulated GPU could not be built, started or read."""

    quotes_output = True  # the server's log or the compiler's output, line by line


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
    held_bytes: int = 0  # what another process holds on the device (`set_held`): counted against the cap, not free


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
        held_bytes=w[_W_HELD],
    )


def read_stats(stats: mmap.mmap) -> EmulatedGpuStats | None:
    """The counters of a mapped stats file, read consistently (a seqlock: retried while the shim is mid-update);
    None when no consistent read came in 10000 tries."""
    for _ in range(10000):
        seq = struct.unpack_from("<Q", stats, _W_SEQ * 8)[0]
        st = parse_stats(stats[: _WORDS.size])
        if st is not None and struct.unpack_from("<Q", stats, _W_SEQ * 8)[0] == seq:
            return st
        time.sleep(0)
    return None


def request_peak_reset(stats: mmap.mmap) -> None:
    """Ask the shim to restart its peak from the bytes in use now (it applies it at the next allocation)."""
    req = struct.unpack_from("<Q", stats, _W_RESET_REQ * 8)[0]
    struct.pack_into("<Q", stats, _W_RESET_REQ * 8, req + 1)  # the parent is this word's only writer


def set_held(stats: mmap.mmap, held_bytes: int) -> None:
    """Say that another process holds `held_bytes` of the device (a browser, a second model on a real GPU): the shim
    answers memory queries with that much less free and refuses allocations past the cap less it."""
    if held_bytes < 0:
        raise EmulatedGpuError(f"emulated GPU held memory: must be 0 or more bytes, got {held_bytes}")
    struct.pack_into("<Q", stats, _W_HELD * 8, held_bytes)  # the parent is this word's only writer


def capped_server_argv(endpoint: str, threads: int, parent_pid: int, lib_dir: Path) -> list[str]:
    """The argv of the server child (`python -m fitter.measure.emulator.capdev serve …`)."""
    return process.python_module("fitter.measure.emulator.capdev", "serve", "--endpoint", endpoint, "--threads",
                                 str(threads), "--parent-pid", str(parent_pid), "--lib-dir", str(lib_dir))


def server_env(base: Mapping[str, str], shim: Path, stats_path: Path, cap_bytes: int,
               cuda: bool = False) -> dict[str, str]:
    """The server child's environment: `base` plus the shim preloaded, its cap and its counters file (and CUDA's
    buffer rules for a CUDA-shaped device)."""
    preload = str(shim) + (" " + base["LD_PRELOAD"] if base.get("LD_PRELOAD") else "")
    extra = {"FITTER_CAPDEV_CUDA": "1"} if cuda else {}
    return process.child_env(base, LD_PRELOAD=preload, FITTER_CAPDEV_CAP_BYTES=str(cap_bytes),
                             FITTER_CAPDEV_STATS=str(stats_path), **extra)


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", ""))
    if cc and shutil.which(cc[0]):
        return cc
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise EmulatedGpuError(
        "the emulated GPU's memory cap (fitter/measure/emulator/native/capdev.c) is compiled at first use and needs a "
        f"C compiler: none of $CC ({os.environ.get('CC', 'unset')!r}), cc, gcc, clang is on PATH; install one "
        "(e.g. `apt-get install gcc`) or set CC"
    )


def _sources(name: str) -> dict[str, bytes]:
    """A native library's C file and the headers it may include, from the fitter.measure.emulator.native package."""
    native = resources.files("fitter.measure.emulator.native")
    return {f: native.joinpath(f).read_bytes() for f in (name, *_HEADERS)}


def _library_path(name: str, sources: dict[str, bytes]) -> Path:
    digest = hashlib.sha256(b"".join(sources[f] for f in sorted(sources))).hexdigest()[:16]
    return fitter_home() / "native" / f"{Path(name).stem}-{digest}.so"


def shim_library() -> Path:
    """The compiled server shim, built on first use into `fitter_home()/native/capdev-<source hash>.so`."""
    return native_library(SHIM_SOURCE)


def cuda_library() -> Path:
    """The compiled client rules of the CUDA-shaped emulated GPU (`cudadev.c`), built like the shim."""
    return native_library(CUDA_SOURCE)


def native_library(name: str) -> Path:
    """`fitter/measure/emulator/native/<name>` compiled on first use into `fitter_home()/native/<stem>-<sources
    hash>.so`."""
    sources = _sources(name)
    out = _library_path(name, sources)
    if out.is_file():
        return out
    cc = _compiler()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        for file, text in sources.items():
            (Path(tmp) / file).write_bytes(text)
        src, lib = Path(tmp) / name, Path(tmp) / f"{Path(name).stem}.so"
        cmd = [*cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl", "-pthread"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise EmulatedGpuError(f"compiling {name} with `{shlex.join(cmd)}` failed: {e}") from e
        if proc.returncode != 0 or not lib.is_file():
            raise EmulatedGpuError(
                f"compiling {name} with `{shlex.join(cmd)}`: exit status {proc.returncode}: "
                f"{(proc.stderr or proc.stdout).strip()[-_LOG_TAIL:]}"
            )
        os.replace(lib, out)  # atomic: a concurrent build of the same source writes the same file
    return out


RPC_LIBRARIES = ("libggml-base.so.0", "libggml.so.0", "libggml-rpc.so.0")  # what the server loads, by soname


def has_rpc_libraries(folder: Path) -> bool:
    """`folder` holds a shared ggml with the RPC backend (a llama.cpp shared build's bin/, llama_cpp/lib)."""
    return all((folder / name).is_file() for name in RPC_LIBRARIES)


def binary_folder(binary: str | Path) -> Path:
    """The folder a binary really lives in (PATH looked up, symlinks resolved): where its $ORIGIN libraries are."""
    return Path(shutil.which(str(binary)) or binary).resolve().parent


def _llama_lib_dir(beside: str | Path | None = None) -> Path:
    """Where the server's ggml comes from: the folder of the llama.cpp binary it serves (`beside`), when that is a
    shared build with RPC (the same build on both ends of the protocol, no llama-cpp-python needed), else
    llama-cpp-python's libraries."""
    build = binary_folder(beside) if beside is not None else None
    if build is not None and has_rpc_libraries(build):
        return build
    lib_dir = llama_cpp_python_lib_dir()
    if lib_dir is None:
        beside = f"{build} has no shared ggml with RPC ({', '.join(RPC_LIBRARIES)}), and " if build else ""
        raise EmulatedGpuError(
            f"the emulated GPU serves llama.cpp's RPC backend from a shared llama.cpp build or from "
            f"llama-cpp-python: {beside}llama-cpp-python is not installed (python -m fitter.measure.llamacpp.tools "
            "--llama-cpp-python builds both)"
        )
    rpc = lib_dir / "libggml-rpc.so.0"
    if not rpc.is_file():
        raise EmulatedGpuError(
            f"the emulated GPU needs llama.cpp's RPC backend: {rpc} is missing; "
            'rebuild llama-cpp-python with CMAKE_ARGS="-DGGML_RPC=ON"'
        )
    return lib_dir


def emulated_gpu_problem(beside: str | Path | None = None) -> str | None:
    """Why an emulated GPU cannot start on this machine (no shared ggml with RPC beside the binary `beside`,
    llama-cpp-python missing or built without RPC, no C compiler for the shim that is not built yet); None when it
    can. Asked before a command creates anything."""
    try:
        _llama_lib_dir(beside)
        if not _library_path(SHIM_SOURCE, _sources(SHIM_SOURCE)).is_file():
            _compiler()
    except EmulatedGpuError as e:
        return str(e)
    return None


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
    if not hasattr(rpc, "ggml_backend_rpc_add_server"):  # before it, start_server had another signature
        print(f"emulated GPU server: {lib_dir / 'libggml-rpc.so.0'} predates the multi-device RPC server "
              "(no ggml_backend_rpc_add_server)", file=sys.stderr)
        return 3
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
    parser = argparse.ArgumentParser(prog="python -m fitter.measure.emulator.capdev")
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
