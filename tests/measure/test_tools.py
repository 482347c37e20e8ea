"""fitter.measure.tools: llama.cpp's tools built from the pinned sdist name the commit they were built from."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from fitter.errors import FitterError
from fitter.measure import tools
from fitter.measure.tools import LLAMA_CPP_COMMIT, LLAMA_CPP_PYTHON, SUBMODULE_HEAD, sdist_commit


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
