"""Loading generated models through the real llama.cpp (llama-cpp-python 0.3.36) in a child process."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.demo_models import SHAPES, write_model
from fitter.measure.loader import load_and_capture
from fitter.measure.logs import sum_by

pytestmark = pytest.mark.llama


@pytest.fixture(scope="module")
def gpt_oss_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(SHAPES["gpt-oss-tiny"], tmp_path_factory.mktemp("models") / "gpt-oss-tiny.gguf")[0]


def _load(model: Path, *flags: str) -> dict[tuple[str, str], float]:
    res = load_and_capture(model, parse_launch_flags(list(flags)))
    assert res.ok, res.error
    assert res.returncode == 0
    assert res.llama_cpp_version == "0.3.36"
    assert res.system_info and "CPU" in res.system_info
    assert "llama_context: constructing llama_context" in res.log
    return sum_by(res.buffers)


def test_kv_doubles_with_the_context_but_the_swa_cache_does_not(gpt_oss_tiny: Path) -> None:
    small = _load(gpt_oss_tiny, "-c", "2048", "-nr")
    big = _load(gpt_oss_tiny, "-c", "4096", "-nr")
    # The whole file is mapped; -nr keeps the MXFP4 experts out of CPU_REPACK.
    assert small[("CPU_Mapped", "model")] == big[("CPU_Mapped", "model")] == 0.45
    assert ("CPU_REPACK", "model") not in small
    # gpt-oss-tiny: 1 full + 1 SWA layer, 2 KV heads x 32, f16 K and V. Full: cells x 64 x 2 B x 2 = 0.5 / 1 MiB.
    # SWA (window 128, 4 unified slots, -ub 512): pad256(min(n_ctx, 128 x 4 + 512)) = 1024 cells = 0.25 MiB.
    assert small[("CPU", "kv")] == 0.5 + 0.25
    assert big[("CPU", "kv")] == 1.0 + 0.25
    assert small[("CPU", "output")] == big[("CPU", "output")] == 0.01


def test_repacking_and_quantized_kv(gpt_oss_tiny: Path) -> None:
    got = _load(gpt_oss_tiny, "-c", "4096", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on")
    assert got[("CPU_REPACK", "model")] == 0.20  # MXFP4 experts repacked (mxfp4_8x8) without -nr
    assert got[("CPU_Mapped", "model")] == 0.45  # the mapping still spans the whole file
    # q8_0: 34 bytes per 32 values. (4096 + 1024) cells x 64 x 34/32 x 2 = 0.6640625 MiB, logged per cache.
    assert got[("CPU", "kv")] == 0.66  # logged as 0.53 (full) + 0.13 (SWA)


def test_llama_cpp_errors_come_back_as_results(gpt_oss_tiny: Path) -> None:
    res = load_and_capture(gpt_oss_tiny, parse_launch_flags(["-c", "4096", "-ot", "exps=CUDA0"]))
    assert not res.ok
    assert res.error is not None and "unknown buffer type" in res.error and "CPU" in res.error


def test_an_abort_inside_llama_cpp_does_not_kill_the_caller(gpt_oss_tiny: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = load_and_capture(gpt_oss_tiny, parse_launch_flags(["-c", "512", "--rpc", f"127.0.0.1:{port}"]))
    assert not res.ok
    assert res.returncode is not None and res.returncode < 0
    assert res.error is not None and "Failed to connect" in res.error
