"""llama.cpp's own programs (llama-server, llama-bench, llama-fit-params) built from the source fitter pins.

llama-cpp-python ships only the libraries. To compare fitter with llama.cpp's tools, or to measure the binary users
deploy, the tools are built once from the llama.cpp vendored in the pinned llama-cpp-python sdist (fetched with
`pip download`, or a source tree given by the caller), statically, with the RPC backend, and cached in
fitter's home. Building is slow (about 6 minutes on 2 cores for the first target) and needs cmake and a C++ compiler.

The tools name their commit. The sdist's vendor/llama.cpp is a git submodule whose metadata lives in the sdist's
`.git/modules/vendor/llama.cpp/`; only vendor/llama.cpp is extracted, so cmake finds no git and would build
`commit unknown` (cmake/build-info.cmake). The submodule's HEAD is read from the sdist instead, checked against the
pin, and given to cmake as LLAMA_BUILD_COMMIT (CMakeLists.txt: `if (NOT DEFINED LLAMA_BUILD_COMMIT)`), which
`--version` (common/build-info.cpp.in `llama_print_build_info`) and llama-bench's `build_commit` print: the same 7
characters llama-cpp-python's own build took from git. The cache is keyed by the build recipe, so tools built
another way (an older fitter's, without the commit) are never reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from fitter.errors import FitterError
from fitter.paths import fitter_home

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python release fitter pins
LLAMA_CPP_COMMIT = "0c1e570"  # the llama.cpp it vendors (the sdist's submodule HEAD; checked when building)
TOOLS = {"llama-server": "tools/server", "llama-bench": "tools/llama-bench", "llama-fit-params": "tools/fit-params"}
CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_RPC=ON",
    "-DGGML_NATIVE=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries in the cache
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",  # this version has no LLAMA_CURL; OpenSSL is its HTTPS option, not needed on loopback
]


SUBMODULE_HEAD = ".git/modules/vendor/llama.cpp/HEAD"  # in the sdist: the vendored llama.cpp's commit


def recipe() -> dict[str, Any]:
    """What decides the binaries: the source, its commit, the cmake arguments."""
    return {"llama_cpp_python": LLAMA_CPP_PYTHON, "llama_cpp_commit": LLAMA_CPP_COMMIT,
            "cmake_args": [*CMAKE_ARGS, *commit_args(LLAMA_CPP_COMMIT)]}


def tools_dir() -> Path:
    """The cache of tools built from the pinned source with this recipe (its hash in the name)."""
    key = hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()[:8]
    return fitter_home() / "tools" / f"llama.cpp-{LLAMA_CPP_PYTHON}-{LLAMA_CPP_COMMIT}-{key}"


def commit_args(commit: str) -> list[str]:
    """The cmake arguments that make the tools report `commit` (llama.cpp's CMakeLists.txt LLAMA_BUILD_COMMIT)."""
    return [f"-DLLAMA_BUILD_COMMIT={commit}"]


def sdist_commit(tar: tarfile.TarFile, name: str) -> str:
    """The vendored llama.cpp's commit, from the sdist's submodule HEAD, checked against the pin; 7 characters."""
    roots = sorted({m.name.split("/", 1)[0] for m in tar.getmembers()})
    member = next((m for r in roots if (m := _member(tar, f"{r}/{SUBMODULE_HEAD}")) is not None), None)
    if member is None:
        raise FitterError(f"{name}: no {SUBMODULE_HEAD}: cannot tell which llama.cpp commit it vendors")
    f = tar.extractfile(member)
    head = (f.read() if f is not None else b"").decode(errors="replace").strip()
    if not head.startswith(LLAMA_CPP_COMMIT):
        raise FitterError(f"{name}: its vendored llama.cpp is commit {head[:12] or '?'}, not the pinned "
                          f"{LLAMA_CPP_COMMIT} (llama-cpp-python {LLAMA_CPP_PYTHON})")
    return head[: len(LLAMA_CPP_COMMIT)]


def _member(tar: tarfile.TarFile, name: str) -> tarfile.TarInfo | None:
    try:
        return tar.getmember(name)
    except KeyError:
        return None


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    with log.open("a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise FitterError(f"building llama.cpp's tools: `{shlex.join(cmd)}` failed with status {proc.returncode}; "
                          f"log {log}:\n{tail}")


def fetch_source(work: Path, log: Path) -> tuple[Path, str]:
    """llama-cpp-python's sdist (pip download) with only vendor/llama.cpp extracted: that folder and its commit."""
    dl = work / "sdist"
    dl.mkdir()
    pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
    _run([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(dl)], log)
    archives = sorted(dl.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        raise FitterError(f"pip download left no llama_cpp_python-*.tar.gz in {dl}")
    marker = "/vendor/llama.cpp/"
    out = work / "src"
    with tarfile.open(archives[0]) as tar:
        commit = sdist_commit(tar, archives[0].name)
        members = [m for m in tar.getmembers() if marker in m.name + "/" and "/.git/" not in m.name]
        if not members:
            raise FitterError(f"{archives[0].name} has no vendor/llama.cpp")
        kwargs: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(out, members=members, **kwargs)
    root = sorted({m.name.split(marker)[0] for m in members})[0]
    return out / root / "vendor" / "llama.cpp", commit


def ensure_tools(names: list[str], llama_src: Path | None = None, rebuild: bool = False) -> dict[str, Path]:
    """The cached tools, building the missing ones (in one build tree) first."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise FitterError(f"unknown llama.cpp tool(s) {unknown}; known: {', '.join(TOOLS)}")
    home = tools_dir()
    paths = {n: home / n for n in names}
    missing = [n for n in names if rebuild or not paths[n].is_file()]
    if not missing:
        return paths
    cmake = shutil.which("cmake")
    if cmake is None:
        raise FitterError("building llama.cpp tools needs cmake on PATH and a C++ compiler (apt-get install cmake g++)")
    home.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=home, prefix=".build-") as tmp:
        work = Path(tmp)
        log = work / "build.log"
        if llama_src is not None:  # a git checkout: cmake reads its commit itself
            src, named = llama_src.resolve(), []
        else:
            src, commit = fetch_source(work, log)
            named = commit_args(commit)
        build = work / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        _run([cmake, "-S", str(src), "-B", str(build), *gen, *CMAKE_ARGS, *named], log)
        jobs = str(max(1, os.cpu_count() or 1))
        _run([cmake, "--build", str(build), "--target", *missing, "-j", jobs], log)
        for name in missing:
            built = build / "bin" / name
            if not built.is_file():
                raise FitterError(f"the build finished but {built} is missing; log {log}")
            part = home / f".{name}.part"
            shutil.copy2(built, part)
            os.replace(part, paths[name])  # a half-copied binary is never cached
        info = {
            "llama_cpp_python": LLAMA_CPP_PYTHON,
            "llama_cpp_commit": LLAMA_CPP_COMMIT,
            "source": str(src) if llama_src is not None else f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist",
            "cmake_args": [*CMAKE_ARGS, *named],
            "targets": missing,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        (home / f"build-{'-'.join(missing)}.json").write_text(json.dumps(info, indent=1) + "\n")
    return paths


if __name__ == "__main__":
    # python -m fitter.measure.tools [--llama-src DIR] TOOL...
    args = sys.argv[1:]
    source = None
    if args[:1] == ["--llama-src"]:
        source, args = Path(args[1]), args[2:]
    for tool, path in ensure_tools(args or ["llama-server", "llama-bench"], source).items():
        print(f"{tool}: {path}")
