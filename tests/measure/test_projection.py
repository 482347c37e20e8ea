"""fitter.measure.projection: a build's own projection (`llama-fit-params --fit-print on`) beside fitter's estimate;
on the build fitter's rules were matched against, the two agree to the build's floored MiB."""

from __future__ import annotations

from pathlib import Path

import pytest

from fitter.gguf.model_spec import load_model_spec
from fitter.measure.projection import compare, parse_fit_print, project, tool_estimate
from fitter.memory.devices import CPU_AVX2, rpc_devices
from fitter.memory.graphs import GRAPH_ARCHS
from fitter.units import MIB
from tests.conftest import BUILT_TOOLS
from tests.models import model_file


def test_the_tools_lines() -> None:
    out = "llama_fit_params: printing ...\nRPC0 12 28 10 \nRPC1 3 4 5\nHost 2 0 12 \n"
    assert parse_fit_print(out, ("127.0.0.1:5", "127.0.0.1:6")) == {
        "RPC0[127.0.0.1:5]": {"model": 12 * MIB, "kv": 28 * MIB, "compute": 10 * MIB},
        "RPC1[127.0.0.1:6]": {"model": 3 * MIB, "kv": 4 * MIB, "compute": 5 * MIB},
        "CPU": {"model": 2 * MIB, "kv": 0, "compute": 12 * MIB},
    }
    lines = compare({"CPU": {"model": 3 * MIB, "kv": MIB, "compute": MIB}}, {"CPU": {"model": 2 * MIB}})
    assert lines[1] == f"{'CPU':<28}{'model':<9}{3.0:10.2f}{2.0:10.2f}{1.0:+10.2f}"
    assert lines[2].endswith(f"{'-':>10}{'-':>10}")


def both_sides(model: Path, flags: list[str], gpu_mib: int) -> tuple[dict[str, dict[str, int]], ...]:
    """fitter's estimate and the pinned build's projection of `flags` for `model`, on an emulated GPU of `gpu_mib`
    when the flags offload (-ngl)."""
    from fitter.measure.emulated_gpu import EmulatedGpu

    spec = load_model_spec(str(model))
    with EmulatedGpu(gpu_mib) as gpu:
        on_gpu = "-ngl" in flags
        flags = [*flags, "--rpc", gpu.endpoint] if on_gpu else flags
        theirs = project(BUILT_TOOLS / "llama-fit-params", model, flags).devices
        ours = tool_estimate(spec, flags, rpc_devices([gpu.endpoint]) if on_gpu else (), CPU_AVX2)
    return ours, theirs


@pytest.mark.llama
@pytest.mark.tools("llama-fit-params")
@pytest.mark.parametrize("flags", [["-c", "4096", "-nr"], ["-c", "4096", "-ub", "2048", "-b", "2048", "-nr"],
                                   ["-c", "8192", "-np", "2", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-nr"],
                                   ["-c", "4096", "-ngl", "all", "-cmoe"], ["-c", "4096", "-ngl", "3"]])
def test_the_pinned_build_projects_what_fitter_estimates(llama_tools: dict[str, Path], flags: list[str]) -> None:
    model = model_file("demo")
    ours, theirs = both_sides(model, flags, 4000)
    assert ours.keys() == theirs.keys()
    for name, kinds in theirs.items():
        for kind, built in kinds.items():
            if name == "CPU" and kind == "model" and "-nr" not in flags:
                continue  # the dry run allocates no CPU_REPACK buffer and leaves those weights out
            assert 0 <= ours[name][kind] - built < MIB, (name, kind, ours[name][kind] / MIB, built / MIB)


@pytest.mark.llama
@pytest.mark.tools("llama-fit-params")
def test_the_builds_context_is_the_kv_cache_without_the_output_buffer() -> None:
    # gpt-oss-20b's output buffer for llama-fit-params' full ubatch of logits is 201088 × 512 × 4 B ≈ 393 MiB: counted
    # in the context, fitter's figure would be that much above the build's
    model = model_file("gpt-oss-20b", sparse=True)
    spec = load_model_spec(str(model))
    flags = ["-c", "4096", "-nr"]
    theirs = project(BUILT_TOOLS / "llama-fit-params", model, flags).devices
    ours = tool_estimate(spec, flags, (), CPU_AVX2)
    assert 0 <= ours["CPU"]["kv"] - theirs["CPU"]["kv"] < MIB, (ours["CPU"]["kv"] / MIB, theirs["CPU"]["kv"] / MIB)


@pytest.mark.llama
@pytest.mark.tools("llama-fit-params")
@pytest.mark.parametrize("shape", ["deepseek-v3-nextn", "glm-4.5-air", "gemma-3-27b", "llama-4-scout",
                                   "qwen3-next-80b-a3b"])
@pytest.mark.parametrize("flags", [["-c", "4096", "-nr"],
                                   ["-c", "8192", "-np", "2", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-nr"],
                                   ["-c", "4096", "-ngl", "all", "-cmoe", "-nr"],
                                   ["-c", "4096", "-ngl", "all", "-ncmoe", "3", "-nr"],
                                   ["-c", "16384", "-ngl", "all", "-ncmoe", "40", "-nr"]])
def test_this_years_shapes_as_the_build_projects_them(shape: str, flags: list[str]) -> None:
    # DeepSeek-V3: 61 MLA layers (3 dense, 256 experts); GLM-4.5-Air: 46 layers (1 dense, 128 experts + 1 shared,
    # sigmoid routing); each with the NextN block a server never loads: neither its weights nor a KV cache for it.
    # -ncmoe 3 moves nothing on DeepSeek-V3 (its first layers have no experts). Gemma-3-27B: 52 of 62 layers slide
    # over 1024 tokens by gemma3's default period; Llama-4-Scout: chunks of 8192 in 3 of each 4 layers;
    # Qwen3-Next-80B-A3B: a KV cache for every 4th layer, conv + SSM state per sequence for the other 36. Compute is
    # checked where fitter rebuilds the graph; the others' come from the phase model, which says so. Like with like
    # on the host: the dry run maps nothing, so its host model is the CPU tensors' sizes, not the mapped range a real
    # load logs (which spans the skipped block: +7333 MiB on DeepSeek-V3)
    model = model_file(shape, sparse=True)
    spec = load_model_spec(str(model))
    ours, theirs = both_sides(model, flags, 400_000)
    assert ours.keys() == theirs.keys()
    for name, kinds in theirs.items():
        for kind, built in kinds.items():
            if kind == "compute" and spec.arch not in GRAPH_ARCHS:
                continue
            assert 0 <= ours[name][kind] - built < MIB, (name, kind, ours[name][kind] / MIB, built / MIB)
