"""fitter.measure.llamacpp.tools: llama.cpp's tools built from the pinned sdist name the commit they were built from."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from fitter.errors import FitterError
from fitter.measure.llamacpp import tools
from fitter.measure.llamacpp.tools import LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON, SUBMODULE_HEAD, sdist_commit


def _sdist(tmp_path: Path, head: str | None) -> tarfile.TarFile:
    """An sdist laid out as llama-cpp-python's: the vendored llama.cpp, and its submodule HEAD under .git/modules."""
    path = tmp_path / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    root = f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    files = {f"{root}/vendor/llama.cpp/CMakeLists.txt": b"project(llama.cpp)\n"}
    if head is not None:
        files[f"{root}/{SUBMODULE_HEAD}"] = head.encode() + b"\n"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return tarfile.open(path)


def test_the_commit_comes_from_the_sdists_submodule_head(tmp_path: Path) -> None:
    with _sdist(tmp_path, "0c1e57098bba43ac29e6e3b677cdceebdd22334f") as tar:
        assert sdist_commit(tar, "x.tar.gz") == LLAMA_CPP_COMMIT == "0c1e570"
    assert tools.commit_args("0c1e570") == ["-DLLAMA_BUILD_COMMIT=0c1e570"]  # what --version then prints


def test_an_sdist_of_another_commit_or_without_one_is_refused(tmp_path: Path) -> None:
    with _sdist(tmp_path, "deadbeef" * 5) as tar, pytest.raises(FitterError) as e:
        sdist_commit(tar, "x.tar.gz")
    assert str(e.value) == (f"x.tar.gz: its vendored llama.cpp is commit deadbeefdead, not the pinned 0c1e570 "
                            f"(llama-cpp-python {LLAMA_CPP_PYTHON})")
    (tmp_path / "none").mkdir()
    with _sdist(tmp_path / "none", None) as tar, pytest.raises(FitterError) as e:
        sdist_commit(tar, "x.tar.gz")
    assert str(e.value) == ("x.tar.gz: no .git/modules/vendor/llama.cpp/HEAD: cannot tell which llama.cpp commit it "
                            "vendors")


def test_the_cache_is_keyed_by_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    # tools an older recipe built (without the commit) live elsewhere, so they are never taken for these
    now = tools.tools_dir()
    assert now.name.startswith(f"llama.cpp-{LLAMA_CPP_PYTHON}-{LLAMA_CPP_COMMIT}-")
    monkeypatch.setattr(tools, "CMAKE_ARGS", [*tools.CMAKE_ARGS, "-DGGML_CUDA=ON"])
    assert tools.tools_dir() != now and tools.tools_dir().parent == now.parent


@pytest.mark.tools("llama-server", "llama-bench")
def test_the_built_tools_name_their_commit(llama_tools: dict[str, Path]) -> None:
    version = subprocess.run([str(llama_tools["llama-server"]), "--version"], capture_output=True, text=True,
                             timeout=60)
    assert f"commit {LLAMA_CPP_COMMIT})" in version.stdout + version.stderr
    # and ggml says it too, not `unknown` (no git metadata) nor `-dirty` (a stale git index)
    from fitter.machine.llama_cpp import ggml_build
    from tests.conftest import BUILT_TOOLS

    assert ggml_build(BUILT_TOOLS)["ggml_commit"] == LLAMA_CPP_COMMIT


def _git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_extracted_source_is_its_commit_to_git_not_dirty(tmp_path: Path) -> None:
    # an sdist laid out as llama-cpp-python's: vendor/llama.cpp is a submodule whose git dir is .git/modules/…, and
    # its index holds the packager's file times; ggml's CMakeLists asks `git diff-index --quiet HEAD`
    import os

    from fitter.paths import fitter_home

    root = tmp_path / "pkg" / "llama_cpp_python-9.9.9"
    sub = root / "vendor" / "llama.cpp"
    sub.mkdir(parents=True)
    (sub / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    _git(sub, "init", "-q")
    _git(sub, "add", ".")
    _git(sub, "commit", "-qm", "x")
    _git(sub, "checkout", "-q", "--detach")  # a submodule's HEAD is the commit itself
    head = _git(sub, "rev-parse", "HEAD")
    (root / ".git" / "modules" / "vendor").mkdir(parents=True)
    os.replace(sub / ".git", root / ".git" / "modules" / "vendor" / "llama.cpp")
    (sub / ".git").write_text("gitdir: ../../.git/modules/vendor/llama.cpp\n")
    _git(root / ".git" / "modules" / "vendor" / "llama.cpp", "config", "core.worktree", "../../../../vendor/llama.cpp")
    archive = fitter_home() / "downloads" / "llama_cpp_python-9.9.9.tar.gz"
    archive.parent.mkdir(parents=True)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root, arcname=root.name)
    src, commit = tools.fetch_source(tmp_path / "work", tmp_path / "log", "9.9.9")  # extracted anew: new file times
    assert (src, commit) == (tmp_path / "work" / "src" / root.name / "vendor" / "llama.cpp", head[:7])
    assert _git(src, "rev-parse", "--short=7", "HEAD") == head[:7]
    assert subprocess.run(["git", "diff-index", "--quiet", "HEAD", "--", "."], cwd=src).returncode == 0  # clean
    (src / "CMakeLists.txt").write_text("changed\n")
    assert subprocess.run(["git", "diff-index", "--quiet", "HEAD", "--", "."], cwd=src).returncode == 1  # still told


def test_each_variant_counts_as_built_with_its_own_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    # the Vulkan build serves the emulated Vulkan GPU: one made before llama-perplexity and llama-quantize joined the
    # CPU build's tools is still a finished build, and is not rebuilt for them
    three = ("llama-server", "llama-bench", "llama-fit-params")
    assert {"cpu": (*three, "llama-perplexity", "llama-quantize"), "vulkan": three} == tools.VARIANT_TOOLS
    for variant in ("cpu", "vulkan"):
        home = tools.tools_dir(variant)
        home.mkdir(parents=True)
        (home / "build.json").write_text("{}\n")
        for name in three:
            (home / name).write_bytes(b"")
    assert tools.built_tools("vulkan") == tools.tools_dir("vulkan")
    assert tools.built_tools("cpu") is None
    built: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(tools, "build_llama_cpp", lambda home, targets, src=None, variant="cpu":
                        built.append((variant, targets)) or {})
    tools.ensure_tools(list(three), variant="vulkan")
    assert built == []
    tools.ensure_tools(["llama-perplexity"], variant="vulkan")  # asked for by name: built, beside the variant's own
    tools.ensure_tools(["llama-server"])  # there: nothing to build
    tools.ensure_tools(["llama-quantize"])  # missing: every tool of the CPU build, one tree
    assert built == [("vulkan", [*three, "llama-perplexity"]), ("cpu", list(tools.TOOLS))]
    for name in ("llama-perplexity", "llama-quantize"):
        (tools.tools_dir() / name).write_bytes(b"")
    assert tools.built_tools("cpu") == tools.tools_dir()
