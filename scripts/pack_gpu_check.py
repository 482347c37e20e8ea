#!/usr/bin/env python
"""Pack what scripts/gpu_check.sh needs on a GPU machine without network, within the device tool's 64 MiB.

Writes `.gpu-check/` (git-ignored; name it in the device tool's `carry`):

- `llama-cpp-python-<version>-cuda-src.tar.gz`: the pinned llama-cpp-python sdist (pip download, as
  fitter.measure.llamacpp.tools fetches it) less what a CUDA build of the library never reads: llama.cpp's models, docs,
  tests, benches, examples, media, the other GPU backends' sources and git's objects (the build is told its commit,
  LLAMA_BUILD_COMMIT, which the submodule HEAD kept here names).
- `wheels/`: pure-Python wheels the build and fitter import there (scikit-build-core and what it needs, gguf,
  nvidia-ml-py, diskcache), for `pip install --no-index`.

    python scripts/pack_gpu_check.py [--out .gpu-check]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "0.3.36"
LIMIT = 64 * 2**20  # the device tool's working tree, carried paths included
# Under vendor/llama.cpp/: never read by `pip install` of the library with -DGGML_CUDA=on.
DROP = ("models/", "docs/", "tests/", "benches/", "examples/", "media/", "pocs/", "app/", "ci/", "gguf-py/",
        "tools/server/public", "tools/ui", "ggml/src/ggml-sycl/", "ggml/src/ggml-vulkan/", "ggml/src/ggml-opencl/",
        "ggml/src/ggml-hexagon/", "ggml/src/ggml-cann/", "ggml/src/ggml-musa/", "ggml/src/ggml-metal/",
        "ggml/src/ggml-webgpu/", "ggml/src/ggml-zdnn/", "ggml/src/ggml-openvino/")
# Wheels for a Python 3.12 x86-64 machine (the device's), none of which needs a compiler.
WHEELS = ("scikit-build-core==0.11.6", "pathspec==0.12.1", "packaging==25.0", "gguf==0.19.0", "nvidia-ml-py==13.580.82",
          "diskcache==5.6.3")


def keep(name: str, top: str) -> bool:
    rel = name[len(top) + 1:] if name.startswith(top + "/") else name
    if rel.startswith(".git/"):  # git's objects (39 MB): only the submodule's HEAD, which names the commit
        return rel in (".git/", ".git/modules/", ".git/modules/vendor/", ".git/modules/vendor/llama.cpp/",
                       ".git/modules/vendor/llama.cpp/HEAD")
    inner = rel.removeprefix("vendor/llama.cpp/")
    return rel == inner or not inner.startswith(DROP)


def trim(sdist: Path, out: Path) -> int:
    """The sdist less DROP, gzipped: its size in bytes."""
    with tarfile.open(sdist) as src, tarfile.open(out, "w:gz", compresslevel=9) as dst:
        top = src.getnames()[0].split("/")[0]
        for member in src.getmembers():
            if keep(member.name, top):
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    return out.stat().st_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / ".gpu-check")
    ap.add_argument("--sdist", type=Path, help="a llama_cpp_python sdist already downloaded")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist
        if sdist is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q",
                            f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], check=True)
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        src = args.out / f"llama-cpp-python-{LLAMA_CPP_PYTHON}-cuda-src.tar.gz"
        size = trim(sdist, src)
    wheels = args.out / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "py", "--platform", "any", "-d", str(wheels),
                    *WHEELS], check=True)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"{src.name}: {size / 2**20:.1f} MiB; {args.out}: {total / 2**20:.1f} MiB in all", file=sys.stderr)
    if total > LIMIT:
        print(f"pack_gpu_check: {total / 2**20:.1f} MiB is over the device tool's 64 MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
