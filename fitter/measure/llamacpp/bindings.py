"""llama-cpp-python on the tools' libraries: the set-up's second half, without a second compile of llama.cpp.

llama-cpp-python 0.3.36's CMakeLists.txt has `option(LLAMA_BUILD ... ON)`; with `-DLLAMA_BUILD=OFF` its wheel holds
the Python bindings only (no llama.cpp, no mtmd compiled), and llama_cpp/llama_cpp.py loads `libllama.so` from the
package's `lib/` (or from `$LLAMA_CPP_LIB_PATH`, which every process would then need). The libraries fitter's tools
were built with (fitter.measure.llamacpp.tools: the same pinned source, RPC on, portable CPU kernels) are copied into
that `lib/`, symlinks kept, so `import llama_cpp` works anywhere in the venv and the worker measures the very build
llama-server runs; a marker file there names the tools they came from. A llama-cpp-python that came with libraries
of its own (pip's RECORD lists them: e.g. one built with `CMAKE_ARGS=-DGGML_CUDA=on`) is never overwritten.

pip's wheel cache is bypassed for this install: it keys a wheel built from an sdist by the sdist, not by
CMAKE_ARGS, so a library-less wheel left there would be what a later plain `pip install llama-cpp-python` gets.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

from fitter.errors import FitterError
from fitter.machine.llama_cpp import ggml_build, llama_cpp_python_lib_dir, llama_cpp_python_version
from fitter.measure.llamacpp.tools import LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON, copy_entry, is_library, sdist_archive
from fitter.paths import fitter_home

MARKER = "fitter-tools.json"  # in llama_cpp/lib: which tools folder its libraries were copied from
NO_COMPILE = "-DLLAMA_BUILD=OFF"  # llama-cpp-python's CMakeLists.txt option: bindings only


def recorded_libraries() -> list[str]:
    """The llama.cpp libraries pip installed with llama-cpp-python (its RECORD): a build with libraries of its own
    has them; the bindings-only wheel has none, and what fitter copies in is never recorded."""
    try:
        files = importlib.metadata.distribution("llama-cpp-python").files or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return sorted(f.name for f in files if f.parent.name == "lib" and is_library(f.name))


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.iterdir()) if folder.is_dir() else []


def copy_libraries(tools: Path, lib_dir: Path) -> list[str]:
    """The tools' shared libraries, but their own code, into `lib_dir` (symlinks as symlinks, each file under a
    temporary name first), then the marker; libraries of an earlier copy that the tools no longer have are removed."""
    # the tools' own code (libllama-server-impl.so, …) stays with them: the bindings load libllama, ggml and mtmd
    names = sorted(p.name for p in _entries(tools) if is_library(p.name) and "-impl." not in p.name)
    if "libllama.so" not in names:
        raise FitterError(f"{tools}: no libllama.so; the tools were not built as shared libraries (rebuild them: "
                          "python -m fitter.measure.llamacpp.tools --rebuild)")
    lib_dir.mkdir(parents=True, exist_ok=True)
    for stale in _entries(lib_dir):
        if is_library(stale.name) and stale.name not in names:
            stale.unlink()
    for name in names:
        copy_entry(tools / name, lib_dir)
    (lib_dir / MARKER).write_text(json.dumps({"tools": str(tools), "libraries": names}, indent=1) + "\n")
    return names


def _pip_install(log: Path) -> None:
    env = {**os.environ, "CMAKE_ARGS": NO_COMPILE}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", str(sdist_archive(log))]
    with log.open("a") as f:
        f.write(f"$ CMAKE_ARGS={NO_COMPILE} {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise FitterError(f"installing llama-cpp-python {LLAMA_CPP_PYTHON} ({NO_COMPILE}) failed with status "
                          f"{proc.returncode}; its output is in {log}")


def _check_commit(folder: Path) -> None:
    commit = ggml_build(folder).get("ggml_commit", "unknown")
    if commit != LLAMA_CPP_COMMIT:
        raise FitterError(f"{folder}: its libggml-base says commit {commit}, not the pinned {LLAMA_CPP_COMMIT} that "
                          f"llama-cpp-python {LLAMA_CPP_PYTHON}'s bindings are written for")


def _check_loads(lib_dir: Path) -> None:
    """The copy loads in a fresh interpreter and has the RPC backend."""
    probe = "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_rpc() else 3)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        why = "it has no RPC backend" if proc.returncode == 3 else (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise FitterError(f"llama-cpp-python on the libraries in {lib_dir} does not load: {why}")


def install_llama_cpp_python(tools: Path) -> str:
    """llama-cpp-python (the pinned version) into this Python, loading the libraries in `tools`; what was done."""
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        raise FitterError(f"LLAMA_CPP_LIB_PATH={os.environ['LLAMA_CPP_LIB_PATH']} is set: llama-cpp-python would load "
                          "that instead of the tools' libraries; unset it")
    version = llama_cpp_python_version()
    if version is not None and recorded_libraries():
        other = "" if version == LLAMA_CPP_PYTHON else f", not the pinned {LLAMA_CPP_PYTHON}"
        return (f"llama-cpp-python {version}{other} came with its own llama.cpp in {llama_cpp_python_lib_dir()}: kept "
                "(pip uninstall llama-cpp-python, then run this again, to use the tools' libraries instead)")
    _check_commit(tools)  # before anything is installed or copied
    if version != LLAMA_CPP_PYTHON:
        log = fitter_home() / "logs" / "llama-cpp-python-install.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        _pip_install(log)
        importlib.invalidate_caches()
    lib_dir = llama_cpp_python_lib_dir()
    if lib_dir is None:
        raise FitterError(f"llama-cpp-python {LLAMA_CPP_PYTHON} was installed but {sys.executable} cannot find it")
    names = copy_libraries(tools, lib_dir)
    _check_loads(lib_dir)
    return f"llama-cpp-python {LLAMA_CPP_PYTHON}: {len(names)} libraries from {tools} in {lib_dir} (no compile)"
