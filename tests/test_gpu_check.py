"""scripts/pack_gpu_check.py and scripts/gpu_check.sh as far as a machine without a GPU can check them: what the
packed source keeps (all a CUDA build of the library reads, within the device tool's 64 MiB), and that the check
refuses a machine without an NVIDIA GPU with a one-line reason."""

from __future__ import annotations

import importlib.util
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent


def _pack() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pack_gpu_check", REPO / "scripts" / "pack_gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_packed_source_keeps_what_a_cuda_build_reads(tmp_path: Path) -> None:
    pack = _pack()
    top = "llama_cpp_python-0.3.36"
    files = {
        "CMakeLists.txt": b"x", "llama_cpp/llama.py": b"x", ".git/modules/vendor/llama.cpp/HEAD": b"0c1e570abc\n",
        ".git/modules/vendor/llama.cpp/objects/pack/p.pack": b"x" * 1000,
        "vendor/llama.cpp/ggml/src/ggml-cuda/fattn.cu": b"x", "vendor/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp": b"x",
        "vendor/llama.cpp/src/llama-context.cpp": b"x", "vendor/llama.cpp/tools/mtmd/mtmd.cpp": b"x",
        "vendor/llama.cpp/models/ggml-vocab-llama.gguf": b"x" * 1000, "vendor/llama.cpp/docs/build.md": b"x",
        "vendor/llama.cpp/tests/test-backend-ops.cpp": b"x", "vendor/llama.cpp/ggml/src/ggml-vulkan/v.cpp": b"x",
    }
    sdist = tmp_path / "sdist.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = tmp_path / "src.tar.gz"
    pack.trim(sdist, out)
    with tarfile.open(out) as tar:
        kept = {n.removeprefix(top + "/") for n in tar.getnames()}
    assert kept == {"CMakeLists.txt", "llama_cpp/llama.py", ".git/modules/vendor/llama.cpp/HEAD",
                    "vendor/llama.cpp/ggml/src/ggml-cuda/fattn.cu", "vendor/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp",
                    "vendor/llama.cpp/src/llama-context.cpp", "vendor/llama.cpp/tools/mtmd/mtmd.cpp"}


@pytest.mark.skipif(shutil.which("nvidia-smi", path="/usr/bin:/bin") is not None, reason="this machine has a GPU")
def test_the_check_refuses_a_machine_without_an_nvidia_gpu() -> None:
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_check.sh")]).returncode == 0
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # no nvidia-smi there on this machine
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "gpu_check: no nvidia-smi: not a machine with an NVIDIA GPU"
