"""llama.cpp's own programs (llama-server, llama-bench, llama-fit-params, llama-perplexity, llama-quantize) and its
libraries, built once from the source fitter pins.

To compare fitter with llama.cpp's tools, or to measure the binary users deploy, the tools are built once from the
llama.cpp vendored in the pinned llama-cpp-python sdist (fetched once with `pip download` and kept in fitter's
home, or a source tree given by the caller), with the RPC backend and portable CPU kernels, and cached in fitter's
home. The build is shared (`BUILD_SHARED_LIBS=ON`): llama.cpp writes the binaries and libllama/libggml*/libmtmd
into one `bin/` folder (CMakeLists.txt `CMAKE_RUNTIME_OUTPUT_DIRECTORY`/`CMAKE_LIBRARY_OUTPUT_DIRECTORY`), and with
the rpath `$ORIGIN` the cached folder is a llama.cpp build like any user's (`--llama-cpp DIR` takes it). The same
libraries are what llama-cpp-python loads when fitter's set-up installs it without its own compile
(fitter.measure.llamacpp.bindings): one compile (341 s with the download on 2 cores, from empty caches), needing cmake
and a C++ compiler.

The tools name their commit. The sdist's vendor/llama.cpp is a git submodule whose metadata lives in the sdist's
`.git/modules/vendor/llama.cpp/`; it is extracted with the tree, and git's index refreshed, so ggml/CMakeLists.txt
(which asks git: `git rev-parse --short HEAD`, `git diff-index --quiet HEAD`) and cmake/build-info.cmake read the
commit, clean. The submodule's HEAD is also read from the sdist, checked against the pin, and given to cmake as
LLAMA_BUILD_COMMIT (CMakeLists.txt: `if (NOT DEFINED LLAMA_BUILD_COMMIT)`; it is ggml's too where git is missing),
which `--version` (common/build-info.cpp.in `llama_print_build_info`) and llama-bench's `build_commit` print. A
build whose libggml-base does not say the sdist's commit (ggml_commit()) is refused before it is cached. The cache
is keyed by the build recipe, so tools built another way (an older fitter's: static, or without the commit) are
never reused, and a folder counts as built only with its build.json.
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
from fitter.machine.llama_cpp import ggml_build
from fitter.paths import fitter_home

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python release fitter pins
LLAMA_CPP_COMMIT = "0c1e570"  # the llama.cpp it vendors (the sdist's submodule HEAD; checked when building)
TOOLS = {"llama-server": "tools/server", "llama-bench": "tools/llama-bench", "llama-fit-params": "tools/fit-params",
         # output quality (fitter.measure.llamacpp.perplexity): KL divergence from a reference, and the files to compare
         "llama-perplexity": "tools/perplexity", "llama-quantize": "tools/quantize"}
CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_RPC=ON",
    "-DGGML_NATIVE=OFF",
    # one build for the tools and llama-cpp-python: shared libraries beside the binaries, found through $ORIGIN
    # wherever the folder is copied (cmake writes `$ORIGIN` literally; the loader expands it)
    "-DBUILD_SHARED_LIBS=ON",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",  # this version has no LLAMA_CURL; OpenSSL is its HTTPS option, not needed on loopback
]


SUBMODULE_HEAD = ".git/modules/vendor/llama.cpp/HEAD"  # in the sdist: the vendored llama.cpp's commit

# The builds fitter makes of the pinned source: the CPU one (with RPC: the emulated GPU) that everything uses, and a
# Vulkan one (`--vulkan`: fitter's emulated Vulkan GPU runs it on Mesa's software driver, lavapipe). The Vulkan one
# also needs glslc and the Vulkan headers (Debian: glslc, libvulkan-dev), and compiles against Debian 12's 1.3.239
# headers through fitter's compatibility header (compat/vulkan/vulkan.hpp), put first on the include path; the web UI
# is not fetched (LLAMA_USE_PREBUILT_UI).
VARIANTS: dict[str, list[str]] = {"cpu": [], "vulkan": ["-DGGML_VULKAN=ON", "-DLLAMA_USE_PREBUILT_UI=OFF"]}
# The tools each variant is built with and counted built by: the Vulkan build serves the emulated Vulkan GPU
# (llama-server, and llama-fit-params / llama-bench beside it); quality is measured with the CPU build's
# llama-perplexity, so a Vulkan build made before those tools were added stays a finished build.
VARIANT_TOOLS: dict[str, tuple[str, ...]] = {"cpu": tuple(TOOLS),
                                             "vulkan": ("llama-server", "llama-bench", "llama-fit-params")}
COMPAT = Path(__file__).resolve().parent / "compat"  # the Vulkan build's compatibility headers
VULKAN_PACKAGES = "mesa-vulkan-drivers libvulkan-dev glslc glslang-tools spirv-headers"  # Debian's, for --vulkan


def _compat_digest() -> str:
    files = sorted(p for p in COMPAT.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(p.relative_to(COMPAT).as_posix().encode() + p.read_bytes() for p in files)
                          ).hexdigest()[:16]


def recipe(variant: str = "cpu") -> dict[str, Any]:
    """What decides the binaries: the source, its commit, the cmake arguments (and, for the Vulkan build, its
    compatibility headers' contents)."""
    out: dict[str, Any] = {"llama_cpp_python": LLAMA_CPP_PYTHON, "llama_cpp_commit": LLAMA_CPP_COMMIT,
                           "cmake_args": [*CMAKE_ARGS, *VARIANTS[variant], *commit_args(LLAMA_CPP_COMMIT)]}
    if variant == "vulkan":
        out["compat_headers"] = _compat_digest()
    return out


def tools_dir(variant: str = "cpu") -> Path:
    """The cache of tools built from the pinned source with this recipe (its hash in the name)."""
    key = hashlib.sha256(json.dumps(recipe(variant), sort_keys=True).encode()).hexdigest()[:8]
    kind = "" if variant == "cpu" else f"{variant}-"
    return fitter_home() / "tools" / f"llama.cpp-{LLAMA_CPP_PYTHON}-{LLAMA_CPP_COMMIT}-{kind}{key}"


def built_tools(variant: str = "cpu") -> Path | None:
    """The folder of a finished build of `variant` (its build.json written last, every tool of VARIANT_TOOLS there),
    or None."""
    home = tools_dir(variant)
    return home if (home / "build.json").is_file() and all((home / n).is_file() for n in VARIANT_TOOLS[variant]) \
        else None


def vulkan_build_problem() -> str | None:
    """What the Vulkan build lacks on this machine (glslc, the Vulkan headers), or None."""
    missing = [what for what, ok in (("glslc", shutil.which("glslc") is not None),
                                     ("the Vulkan headers", Path("/usr/include/vulkan/vulkan.hpp").is_file()
                                      or bool(os.environ.get("VULKAN_SDK")))) if not ok]
    if not missing:
        return None
    return (f"the Vulkan build needs {' and '.join(missing)}: on Debian or Ubuntu `apt-get install "
            f"--no-install-recommends {VULKAN_PACKAGES}` (and vulkan-tools for vulkaninfo)")


def commit_args(commit: str) -> list[str]:
    """The cmake arguments that make the tools report `commit` (llama.cpp's CMakeLists.txt LLAMA_BUILD_COMMIT)."""
    return [f"-DLLAMA_BUILD_COMMIT={commit}"]


def submodule_head(tar: tarfile.TarFile, name: str) -> str:
    """The full commit of the llama.cpp an sdist of llama-cpp-python vendors (its submodule HEAD)."""
    roots = sorted({m.name.split("/", 1)[0] for m in tar.getmembers()})
    member = next((m for r in roots if (m := _member(tar, f"{r}/{SUBMODULE_HEAD}")) is not None), None)
    if member is None:
        raise FitterError(f"{name}: no {SUBMODULE_HEAD}: cannot tell which llama.cpp commit it vendors")
    f = tar.extractfile(member)
    return (f.read() if f is not None else b"").decode(errors="replace").strip()


def sdist_commit(tar: tarfile.TarFile, name: str) -> str:
    """The vendored llama.cpp's commit, from the sdist's submodule HEAD, checked against the pin; 7 characters."""
    head = submodule_head(tar, name)
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


def sdist_archive(log: Path, version: str = LLAMA_CPP_PYTHON) -> Path:
    """llama-cpp-python's sdist, downloaded once into fitter's home (pip download; 76 MB). The tools are built from
    the pinned one's vendored llama.cpp and llama-cpp-python is installed from it (fitter.measure.llamacpp.bindings):
    one download. Only the pinned version's commit is checked (another is what a drift benchmark asks for)."""
    home = fitter_home() / "downloads"
    path = home / f"llama_cpp_python-{version}.tar.gz"
    if path.is_file():
        return path
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home, prefix=".download-") as tmp:
        # --no-binary for llama-cpp-python alone: its build requirements come as wheels, not compiled for metadata
        pip = [sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps"]
        _run([*pip, f"llama-cpp-python=={version}", "-d", tmp], log)
        archives = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            raise FitterError(f"pip download left no llama_cpp_python-*.tar.gz in {tmp}")
        if version == LLAMA_CPP_PYTHON:
            with tarfile.open(archives[0]) as tar:
                sdist_commit(tar, archives[0].name)  # another commit is refused before it is kept
        os.replace(archives[0], path)  # a half-downloaded archive is never kept
    return path


def fetch_source(work: Path, log: Path, version: str = LLAMA_CPP_PYTHON) -> tuple[Path, str]:
    """The sdist's vendor/llama.cpp with its git metadata (extracted into `work`) and its commit (7 characters; the
    pinned version's checked against the pin)."""
    archive = sdist_archive(log, version)
    marker = "/vendor/llama.cpp/"
    out = work / "src"
    with tarfile.open(archive) as tar:
        commit = sdist_commit(tar, archive.name) if version == LLAMA_CPP_PYTHON else (
            submodule_head(tar, archive.name)[: len(LLAMA_CPP_COMMIT)])
        gitdir = "/" + SUBMODULE_HEAD.removesuffix("HEAD")
        members = [m for m in tar.getmembers()
                   if (marker in m.name + "/" and "/.git/" not in m.name) or gitdir in m.name + "/"]
        if not any(marker in m.name for m in members):
            raise FitterError(f"{archive.name} has no vendor/llama.cpp")
        kwargs: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(out, members=members, **kwargs)
    root = sorted({m.name.split(marker)[0] for m in members if marker in m.name})[0]
    src = out / root / "vendor" / "llama.cpp"
    _refresh_git_index(src, log)
    return src, commit


def _refresh_git_index(src: Path, log: Path) -> None:
    """Let git see the extracted tree as the commit it is. ggml/CMakeLists.txt asks git for the commit and whether
    the tree is dirty (`git diff-index --quiet HEAD`), and git's index still holds the packager's file times, so
    every file looked modified: llama-cpp-python's own build says `0c1e570-dirty`. A refresh re-reads the files'
    contents; a tree that really differs from the commit is still reported dirty. Without git, cmake falls back to
    LLAMA_BUILD_COMMIT (commit_args) for ggml too."""
    git = shutil.which("git")
    if git is not None and (src / ".git").exists():
        _run([git, "update-index", "-q", "--refresh"], log, cwd=src)


def is_library(name: str) -> bool:
    """A shared library of the build (libllama.so, libggml-base.so.0, libmtmd.so.0.0.1, …), not a tool."""
    return name.startswith("lib") and (name.endswith(".so") or ".so." in name)


def install_build(bin_dir: Path, home: Path, tools: list[str]) -> list[str]:
    """Copy a build's libraries (symlinks kept as symlinks) and then `tools` from `bin_dir` into `home`, each under a
    temporary name first: a half-copied file is never cached, and a tool is there only once its libraries are."""
    libraries = sorted(p.name for p in bin_dir.iterdir() if is_library(p.name))
    for name in [*libraries, *tools]:
        if not ((bin_dir / name).is_file() or (bin_dir / name).is_symlink()):
            raise FitterError(f"the build finished but {bin_dir / name} is missing")
        copy_entry(bin_dir / name, home)
    return libraries


def copy_entry(src: Path, folder: Path) -> None:
    """`src` into `folder` under its name, a symlink as the same symlink (sonames point at versioned files), through
    a temporary name: a half-copied file is never there."""
    part = folder / f".{src.name}.part"
    part.unlink(missing_ok=True)
    if src.is_symlink():
        part.symlink_to(os.readlink(src))
    else:
        shutil.copy2(src, part)
    os.replace(part, folder / src.name)


def ensure_tools(names: list[str], llama_src: Path | None = None, rebuild: bool = False,
                 variant: str = "cpu") -> dict[str, Path]:
    """The cached tools, building them all (one tree: the libraries they share) first when one is missing: the
    variant's tools (VARIANT_TOOLS) and any other one asked for."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise FitterError(f"unknown llama.cpp tool(s) {unknown}; known: {', '.join(TOOLS)}")
    home = tools_dir(variant)
    paths = {n: home / n for n in names}
    if rebuild or not (home / "build.json").is_file() or not all(p.is_file() for p in paths.values()):
        # every tool: one built later in another tree would come with other copies of the libraries
        targets = [*VARIANT_TOOLS[variant], *(n for n in names if n not in VARIANT_TOOLS[variant])]
        build_llama_cpp(home, targets, llama_src, variant=variant)
    return paths


def build_llama_cpp(home: Path, targets: list[str], llama_src: Path | None = None,
                    version: str = LLAMA_CPP_PYTHON, variant: str = "cpu") -> dict[str, Any]:
    """Build `targets` with fitter's recipe from `llama_src` (a git checkout: cmake reads its commit itself) or from
    llama-cpp-python `version`'s sdist, into `home` with the libraries; what was built (also in home/build.json)."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise FitterError("building llama.cpp tools needs cmake on PATH and a C++ compiler (apt-get install cmake g++)")
    if variant == "vulkan" and (problem := vulkan_build_problem()) is not None:
        raise FitterError(problem)
    home.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=home, prefix=".build-") as tmp:
        work = Path(tmp)
        log = work / "build.log"
        if llama_src is not None:
            src, named, commit = llama_src.resolve(), [], None
        else:
            src, commit = fetch_source(work, log, version)
            named = commit_args(commit)
        build = work / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        extra = list(VARIANTS[variant])
        if variant == "vulkan":  # the compatibility headers first on the include path, from a copy in the build
            shutil.copytree(COMPAT, work / "compat")
            extra.append(f"-DCMAKE_CXX_FLAGS=-I{work / 'compat'}")
        _run([cmake, "-S", str(src), "-B", str(build), *gen, *CMAKE_ARGS, *extra, *named], log)
        jobs = str(max(1, os.cpu_count() or 1))
        _run([cmake, "--build", str(build), "--target", *targets, "-j", jobs], log)
        ggml_commit = ggml_build(build / "bin").get("ggml_commit", "unknown")
        if llama_src is None and ggml_commit != commit:  # checked before anything is cached
            raise FitterError(f"the build of {src} says commit {ggml_commit} (its ggml_commit()), not the sdist's "
                              f"{commit}")
        (home / "build.json").unlink(missing_ok=True)  # the folder is a finished build only once it is back
        libraries = install_build(build / "bin", home, targets)
        info = {
            "llama_cpp_python": version if llama_src is None else None,
            "llama_cpp_commit": commit,
            "source": str(src) if llama_src is not None else f"llama-cpp-python {version} sdist",
            "cmake_args": [*CMAKE_ARGS, *VARIANTS[variant], *named],
            "variant": variant,
            "targets": targets,
            "libraries": libraries,
            "ggml_commit": ggml_commit,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        (home / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m fitter.measure.llamacpp.tools",
                                 description="Build llama.cpp's tools and libraries once from the pinned source.")
    ap.add_argument("tools", nargs="*", help=f"default: {' '.join(TOOLS)} (the Vulkan build: "
                    f"{' '.join(VARIANT_TOOLS['vulkan'])})")
    ap.add_argument("--llama-src", type=Path, help="a llama.cpp git checkout instead of the pinned sdist")
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--llama-cpp-python", action="store_true",
                    help="also install llama-cpp-python into this Python without its own compile, on these libraries")
    ap.add_argument("--vulkan", action="store_true",
                    help="also build the Vulkan variant (fitter's emulated Vulkan GPU runs it on Mesa's lavapipe; "
                    f"needs {VULKAN_PACKAGES})")
    ns = ap.parse_args(argv)
    try:
        for tool, path in ensure_tools(ns.tools or list(VARIANT_TOOLS["cpu"]), ns.llama_src, ns.rebuild).items():
            print(f"{tool}: {path}")
        if ns.vulkan:
            for tool, path in ensure_tools(ns.tools or list(VARIANT_TOOLS["vulkan"]), ns.llama_src, ns.rebuild,
                                           variant="vulkan").items():
                print(f"{tool} (Vulkan): {path}")
        if ns.llama_cpp_python:
            from fitter.measure.llamacpp.bindings import install_llama_cpp_python

            print(install_llama_cpp_python(tools_dir()))
    except FitterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # python -m fitter.measure.llamacpp.tools [--llama-src DIR] [--rebuild] [--llama-cpp-python] [--vulkan] [TOOL...]
    sys.exit(main())
