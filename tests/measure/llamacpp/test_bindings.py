"""fitter.measure.llamacpp.bindings: llama-cpp-python on the tools' libraries, never over a llama.cpp of its own."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fitter.errors import FitterError
from fitter.measure.llamacpp import bindings
from fitter.measure.llamacpp.bindings import MARKER, copy_libraries, install_llama_cpp_python
from fitter.measure.llamacpp.tools import LLAMA_CPP_COMMIT, install_build, is_library
from tests.conftest import BUILT_TOOLS


def _shared_build(folder: Path) -> Path:
    """A bin/ folder laid out as llama.cpp's shared build: versioned libraries, their soname and name links, tools."""
    folder.mkdir(parents=True)
    for lib in ("libllama", "libggml-base", "libggml"):
        (folder / f"{lib}.so.0.0.1").write_bytes(f"{lib} 0.0.1".encode())
        (folder / f"{lib}.so.0").symlink_to(f"{lib}.so.0.0.1")
        (folder / f"{lib}.so").symlink_to(f"{lib}.so.0")
    for tool in ("llama-server", "llama-bench", "llama-fit-params", "test-backend-ops"):
        (folder / tool).write_bytes(tool.encode())
    return folder


def test_libraries_are_told_from_tools_by_name() -> None:
    assert [n for n in ("libllama.so", "libggml-base.so.0", "libmtmd.so.0.0.1", "llama-server", "libfoo.a", "lib",
                        "llama-fit-params") if is_library(n)] == ["libllama.so", "libggml-base.so.0",
                                                                 "libmtmd.so.0.0.1"]


def test_the_build_is_cached_with_its_libraries_and_links(tmp_path: Path) -> None:
    bin_dir = _shared_build(tmp_path / "build" / "bin")
    home = tmp_path / "tools"
    home.mkdir()
    libraries = install_build(bin_dir, home, ["llama-server", "llama-fit-params"])
    assert libraries == ["libggml-base.so", "libggml-base.so.0", "libggml-base.so.0.0.1", "libggml.so",
                         "libggml.so.0", "libggml.so.0.0.1", "libllama.so", "libllama.so.0", "libllama.so.0.0.1"]
    assert sorted(p.name for p in home.iterdir()) == [*libraries, "llama-fit-params", "llama-server"]
    assert os.readlink(home / "libllama.so") == "libllama.so.0" and (home / "libllama.so").read_bytes() == (
        b"libllama 0.0.1")
    with pytest.raises(FitterError, match=r"^the build finished but .*/llama-cli is missing$"):
        install_build(bin_dir, home, ["llama-cli"])


def test_the_libraries_are_copied_into_llama_cpp_python_with_a_marker(tmp_path: Path) -> None:
    tools = _shared_build(tmp_path / "tools")
    lib_dir = tmp_path / "site-packages" / "llama_cpp" / "lib"
    lib_dir.mkdir(parents=True)
    (lib_dir / "libold.so").write_bytes(b"a library an earlier copy left")
    (lib_dir / MARKER).write_text("{}")
    names = copy_libraries(tools, lib_dir)
    assert sorted(p.name for p in lib_dir.iterdir()) == sorted([*names, MARKER])  # libold.so is gone
    assert (lib_dir / "libggml-base.so.0").is_symlink() and (lib_dir / "libggml-base.so.0").read_bytes() == (
        b"libggml-base 0.0.1")
    assert json.loads((lib_dir / MARKER).read_text()) == {"tools": str(tools), "libraries": names}


def test_a_static_build_has_nothing_to_give(tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "llama-server").write_bytes(b"static")
    with pytest.raises(FitterError, match=r"^.*/tools: no libllama\.so; the tools were not built as shared "
                                          r"libraries \(rebuild them: python -m fitter\.measure\.llamacpp\.tools "
                                          r"--rebuild\)$"):
        copy_libraries(tools, tmp_path / "lib")


def test_a_llama_cpp_python_with_its_own_libraries_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # pip's RECORD lists the libraries a build came with (a CUDA one, a newer one); a marker fitter left in an
    # earlier copy does not make them fitter's
    lib_dir = tmp_path / "llama_cpp" / "lib"
    lib_dir.mkdir(parents=True)
    (lib_dir / "libllama.so").write_bytes(b"a CUDA build of the user's")
    (lib_dir / MARKER).write_text("{}")
    monkeypatch.setattr(bindings, "llama_cpp_python_lib_dir", lambda: lib_dir)
    monkeypatch.setattr(bindings, "recorded_libraries", lambda: ["libggml-cuda.so", "libllama.so"])
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    for version, other in (("0.3.36", ""), ("0.3.40", ", not the pinned 0.3.36")):
        monkeypatch.setattr(bindings, "llama_cpp_python_version", lambda v=version: v)
        assert install_llama_cpp_python(_shared_build(tmp_path / f"tools-{version}")) == (
            f"llama-cpp-python {version}{other} came with its own llama.cpp in {lib_dir}: kept (pip uninstall "
            "llama-cpp-python, then run this again, to use the tools' libraries instead)")
    assert (lib_dir / "libllama.so").read_bytes() == b"a CUDA build of the user's"


def test_a_build_of_another_commit_is_refused_before_anything_is_installed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pip(log: Path) -> None:
        raise AssertionError("pip ran")

    monkeypatch.setattr(bindings, "llama_cpp_python_version", lambda: None)
    monkeypatch.setattr(bindings, "_pip_install", no_pip)
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    tools = _shared_build(tmp_path / "tools")  # its libggml-base is no library: it names no commit
    with pytest.raises(FitterError) as e:
        install_llama_cpp_python(tools)
    assert str(e.value) == (f"{tools}: its libggml-base says commit unknown, not the pinned 0c1e570 that "
                            "llama-cpp-python 0.3.36's bindings are written for")


@pytest.mark.tools("llama-server")
def test_a_bindings_only_install_gets_the_tools_libraries(llama_tools: dict[str, Path], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # not installed: pip installs the bindings-only wheel (faked here: it makes llama_cpp/ without lib/), then the
    # tools' libraries are copied in
    package = tmp_path / "site-packages" / "llama_cpp"
    installed: list[Path] = []

    def pip(log: Path) -> None:
        package.mkdir(parents=True)
        installed.append(log)

    monkeypatch.setattr(bindings, "llama_cpp_python_version", lambda: None)
    monkeypatch.setattr(bindings, "_pip_install", pip)
    monkeypatch.setattr(bindings, "llama_cpp_python_lib_dir", lambda: package / "lib" if package.is_dir() else None)
    monkeypatch.setattr(bindings, "_check_loads", lambda lib_dir: None)  # it would import the real llama_cpp
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    said = install_llama_cpp_python(BUILT_TOOLS)
    names = json.loads((package / "lib" / MARKER).read_text())["libraries"]
    assert said == (f"llama-cpp-python 0.3.36: {len(names)} libraries from {BUILT_TOOLS} in {package / 'lib'} "
                    "(no compile)")
    assert len(installed) == 1 and "libllama.so" in names and "libggml-rpc.so.0" in names
    assert not any("-impl." in n for n in names)  # the tools' own code stays with them
    assert (package / "lib" / "libggml-base.so.0").read_bytes() == (BUILT_TOOLS / "libggml-base.so.0").read_bytes()


def test_llama_cpp_lib_path_would_shadow_the_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
    with pytest.raises(FitterError) as e:
        install_llama_cpp_python(tmp_path)
    assert str(e.value) == (f"LLAMA_CPP_LIB_PATH={tmp_path} is set: llama-cpp-python would load that instead of the "
                            "tools' libraries; unset it")


@pytest.mark.tools("llama-server")
def test_the_tools_folder_is_a_relocatable_shared_build(llama_tools: dict[str, Path], tmp_path: Path) -> None:
    # the libraries llama-server links are found through $ORIGIN: a copy of the folder runs anywhere
    import shutil
    import subprocess

    assert (BUILT_TOOLS / "libllama.so").is_file() and (BUILT_TOOLS / "libggml-rpc.so").is_file()
    moved = tmp_path / "moved"
    shutil.copytree(BUILT_TOOLS, moved, symlinks=True)
    proc = subprocess.run([str(moved / "llama-server"), "--version"], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ.get("PATH", "")})
    assert proc.returncode == 0 and f"commit {LLAMA_CPP_COMMIT})" in proc.stdout + proc.stderr


@pytest.mark.llama
@pytest.mark.tools("llama-server")
def test_llama_cpp_python_set_up_by_fitter_loads_the_tools_libraries(llama_tools: dict[str, Path]) -> None:
    # the set-up's one compile: where fitter filled llama-cpp-python's lib/, its libraries are the tools' files
    from fitter.machine.llama_cpp import llama_cpp_python_lib_dir

    lib_dir = llama_cpp_python_lib_dir()
    assert lib_dir is not None
    if not (lib_dir / MARKER).is_file() and os.environ.get("FITTER_REQUIRE_TOOLS") != "1":  # .ci/setup's must be
        pytest.skip(f"llama-cpp-python in {lib_dir} came with its own llama.cpp (not set up by fitter)")
    assert json.loads((lib_dir / MARKER).read_text())["tools"] == str(BUILT_TOOLS)
    for name in ("libllama.so", "libggml-base.so.0", "libggml-rpc.so.0", "libggml-cpu.so.0"):
        assert (lib_dir / name).read_bytes() == (BUILT_TOOLS / name).read_bytes(), name
