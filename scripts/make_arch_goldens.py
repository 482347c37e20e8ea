#!/usr/bin/env python
"""Write tests/golden/archs.json and tests/golden/llama-archs.tar.xz: llama.cpp's buffers for a tiny model of every
architecture it can build, from llama.cpp's own tests/test-llama-archs.cpp.

That test builds, for each architecture llama.cpp lists (llm_arch_all), a GGUF with valid hyperparameters and a
valid tensor table (a dense and a MoE variant where the architecture has them) and saves it with `-o DIR`. This
script compiles it from the pinned llama-cpp-python sdist against fitter's built tools (their libllama exports the
saver), saves the models, loads each with the flags of CONFIGS through fitter.measure.loader (llama.cpp's own load,
its buffer lines captured), and keeps the models' GGUF headers (a few KiB each; fitter's estimate reads nothing
else) with the files' sizes, so the test rebuilds them as sparse files. Every case is CPU-only.

    python scripts/make_arch_goldens.py [--jobs 2] [--arch qwen3next,gemma3]

Deterministic for one llama.cpp build: cases sorted by id, buffers in log order.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from fitter.flags import parse_launch_flags
from fitter.gguf.archs import ARCHS, Memory, SwaWhen
from fitter.measure.llamacpp.tools import LLAMA_CPP_COMMIT, fetch_source, tools_dir
from fitter.measure.loader import load_and_capture

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden" / "archs.json"
HEADERS = REPO / "tests" / "golden" / "llama-archs.tar.xz"
# The test models' context is 256 (n_ctx_train); quantized caches need flash attention and heads of 32s
CONFIGS = (
    ("c256", ["-c", "256", "-ngl", "0"]),
    ("np2-q8", ["-c", "256", "-ngl", "0", "-np", "2", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"]),
    ("ub64-nofa", ["-c", "256", "-ngl", "0", "-ub", "64", "-b", "128", "-fa", "off"]),
    ("nommap", ["-c", "256", "-ngl", "0", "--no-mmap"]),  # plain CPU buffers: a tied output is not duplicated
)
# the variants' context runs past the window (32 in the test models), so the sliding-window cache is smaller
VARIANT_CONFIGS = (*CONFIGS, ("c1024", ["-c", "1024", "-ngl", "0", "-np", "1"]))


def variants(arch: str) -> list[tuple[str, list[str], dict[str, int]]]:
    """Copies of an architecture's test model that exercise the rules its file does not: the saver writes every
    key, so the defaults llama.cpp falls back to (a sliding-window period, the recurrent layers' interval) are only
    seen with keys taken out or set. (suffix, keys dropped, keys set)"""
    rules, out = ARCHS.get(arch), []
    if rules is None:
        return []
    if rules.swa is not None and rules.swa.when is not SwaWhen.ARRAY:
        out.append(("swa-default", [f"{arch}.attention.sliding_window_pattern"], {}))
    if rules.memory is Memory.HYBRID:
        out.append(("interval2", [f"{arch}.attention.recurrent_layers"], {f"{arch}.full_attention_interval": 2}))
    # no NextN variant: a test model's last block is no NextN block (its tensors differ), so llama.cpp refuses it
    return out


def write_variant(src: Path, dst: Path, drop: list[str], values: dict[str, int]) -> None:
    """gguf's own gguf_new_metadata copy, with keys dropped or set (u32, as llama.cpp's keys are)."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), arch=architecture(src), endianess=reader.endianess)
    new = {k: MetadataDetails(gguf.GGUFValueType.UINT32, v) for k, v in values.items()}
    # gguf's writer refuses empty arrays (the saver writes classifier.output_labels = []); llama.cpp reads none
    empty = [f.name for f in reader.fields.values() if f.types and f.types[0] == gguf.GGUFValueType.ARRAY
             and not f.data]
    copy_with_new_metadata(reader, writer, new, [*drop, *empty])


def build_saver(work: Path) -> Path:
    """tests/test-llama-archs.cpp compiled against the tools' libraries (its internal headers from the source)."""
    src, _ = fetch_source(work, work / "fetch.log")
    lib = tools_dir()
    exe = work / "test-llama-archs"
    includes = [f"-I{src / d}" for d in ("include", "ggml/include", "common", "src", "vendor")]
    cmd = ["g++", "-std=c++17", "-O1", *includes, str(src / "tests" / "test-llama-archs.cpp"), "-o", str(exe),
           f"-L{lib}", f"-Wl,-rpath,{lib}", "-lllama", "-lllama-common", "-lggml", "-lggml-base"]
    subprocess.run(cmd, check=True)
    return exe


def header_bytes(path: Path) -> bytes:
    return path.read_bytes()[: gguf.GGUFReader(str(path)).data_offset]


def architecture(path: Path) -> str:
    field = gguf.GGUFReader(str(path)).get_field("general.architecture")
    assert field is not None, path
    return str(field.contents())


def capture(model: Path, case_id: str, flags: list[str]) -> dict[str, Any]:
    res = load_and_capture(model, parse_launch_flags(flags), timeout=300)
    case: dict[str, Any] = {"id": f"{model.stem}:{case_id}", "model": model.stem, "flags": flags}
    if not res.ok:
        return {**case, "outcome": "error", "error": (res.error or "").splitlines()[-1][:300]}
    return {**case, "outcome": "ok", "buffers": [{"buft": b.buft, "kind": b.kind, "mib": b.mib} for b in res.buffers]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--arch", default="", help="comma-separated architectures (default: every one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fitter-archs-") as tmp:
        work = Path(tmp)
        exe = build_saver(work)
        out = work / "models"
        out.mkdir()
        cmd = [str(exe), "-o", str(out)] + (["-a", args.arch] if args.arch else [])
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        jobs = [(m, i, f) for m in sorted(out.glob("*.gguf")) for i, f in CONFIGS]
        for m in sorted(out.glob("*.gguf")):
            for suffix, drop, values in variants(architecture(m)):
                dst = out / f"{m.stem}+{suffix}.gguf"
                write_variant(m, dst, drop, values)
                jobs += [(dst, i, f) for i, f in VARIANT_CONFIGS]
        models = sorted(out.glob("*.gguf"))
        with ThreadPoolExecutor(args.jobs) as pool:
            cases = list(pool.map(lambda a: capture(*a), jobs))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as tar:
            for m in models:
                data = header_bytes(m)
                info = tarfile.TarInfo(m.name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        HEADERS.write_bytes(buf.getvalue())
        doc = {
            "llama_cpp_commit": LLAMA_CPP_COMMIT,
            "source": "tests/test-llama-archs.cpp -o (llama.cpp's own model of every architecture)",
            "headers": HEADERS.name,
            "models": {m.stem: {"arch": architecture(m), "size": m.stat().st_size} for m in models},
            "cases": sorted(cases, key=lambda c: c["id"]),
        }
        GOLDEN.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{GOLDEN}: {len(cases)} cases of {len(models)} models; {HEADERS} {HEADERS.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
