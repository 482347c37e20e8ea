"""fitter.measure.llamacpp.projection: a build's own projection (`llama-fit-params --fit-print on`) beside fitter's
estimate; on the build fitter's rules were matched against, the two agree to the build's floored MiB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.errors import FitterError
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.llamacpp.projection import (
    Projector,
    compare,
    parse_fit_print,
    project,
    projector_for,
    tool_estimate,
)
from fitter.memory.backends.devices import CPU_AVX2, rpc_devices
from fitter.memory.graph.graphs import GRAPH_ARCHS
from fitter.memory.plan.estimator import estimate
from fitter.memory.plan.projected import guess_warning, guessed_kinds
from fitter.units import MIB
from tests.conftest import BUILT_TOOLS
from tests.memory.plan.test_arch_goldens import GOLDEN, models  # noqa: F401 (the fixture)
from tests.models import model_file, unknown_arch_model


def test_the_tools_lines() -> None:
    out = "llama_fit_params: printing ...\nRPC0 12 28 10 \nRPC1 3 4 5\nHost 2 0 12 \n"
    assert parse_fit_print(out, ("127.0.0.1:5", "127.0.0.1:6")) == {
        "RPC0[127.0.0.1:5]": {"model": 12 * MIB, "kv": 28 * MIB, "compute": 10 * MIB},
        "RPC0[127.0.0.1:6]": {"model": 3 * MIB, "kv": 4 * MIB, "compute": 5 * MIB},  # each server's device 0
        "CPU": {"model": 2 * MIB, "kv": 0, "compute": 12 * MIB},
    }
    lines = compare({"CPU": {"model": 3 * MIB, "kv": MIB, "compute": MIB}}, {"CPU": {"model": 2 * MIB}})
    assert lines[1] == f"{'CPU':<28}{'model':<9}{3.0:10.2f}{2.0:10.2f}{1.0:+10.2f}"
    assert lines[2].endswith(f"{'-':>10}{'-':>10}")


def both_sides(model: Path, flags: list[str], gpu_mib: int) -> tuple[dict[str, dict[str, int]], ...]:
    """fitter's estimate and the pinned build's projection of `flags` for `model`, on an emulated GPU of `gpu_mib`
    when the flags offload (-ngl)."""
    from fitter.measure.emulator.emulated_gpu import EmulatedGpu

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
                                   "qwen3-next-80b-a3b", "minimax-m2"])
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
    # Qwen3-Next-80B-A3B: a KV cache for every 4th layer, conv + SSM state per sequence for the other 36;
    # MiniMax-M2: 62 layers of 256 experts, full-width QK norms. Compute is
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


def _first_case_of_each_guessed_architecture() -> list[dict[str, object]]:
    """One loaded case (the default flags) per model of the arch goldens that fitter guesses a kind for."""
    from fitter.gguf.archs import ARCHS

    seen, out = set(), []
    for case in GOLDEN["cases"]:
        model = str(case["model"])
        if case["outcome"] == "ok" and model not in seen:
            seen.add(model)
            out.append(case)
    return [c for c in out if GOLDEN["models"][c["model"]]["arch"] not in ARCHS or
            GOLDEN["models"][c["model"]]["arch"] not in GRAPH_ARCHS]


@pytest.mark.tools("llama-fit-params")
@pytest.mark.parametrize("case", _first_case_of_each_guessed_architecture(), ids=lambda c: str(c["id"]))
def test_what_fitter_guesses_comes_from_the_build_never_below_what_llama_cpp_allocates(
        llama_tools: dict[str, Path], models: Path, case: dict[str, object]) -> None:  # noqa: F811
    # the arch goldens' real loads (llama.cpp's logged buffers); the projection reads the flags as llama-fit-params
    # does (-np streams never unified, each padded to 256 cells; logits for a whole ubatch) and prints floored MiB,
    # which fitter rounds up: on these tiny models a few MiB above, never below
    spec = load_model_spec(str(models / f"{case['model']}.gguf"))
    projector = Projector(llama_tools["llama-fit-params"], spec)
    plan = projector.plan(estimate(spec, parse_launch_flags(list(case["flags"])), (), CPU_AVX2))  # type: ignore[arg-type]
    assert plan.projected == guessed_kinds(spec) and guess_warning(spec) not in plan.warnings
    for kind in plan.projected:
        ours = sum(b.bytes for b in plan.buffers if b.kind == kind) / MIB
        logged = sum(b["mib"] for b in case["buffers"] if b["kind"] == kind)  # type: ignore[attr-defined]
        assert 0 <= round(ours - logged, 2) < 4, (kind, ours, logged)


@pytest.mark.tools("llama-fit-params")
def test_a_projection_is_kept_per_config_and_a_damaged_one_is_projected_again(
        llama_tools: dict[str, Path], models: Path) -> None:  # noqa: F811
    spec = load_model_spec(str(models / "qwen4exp-moe.gguf"))  # an architecture llama.cpp loads, fitter has no row for
    config = parse_launch_flags(["-c", "512", "-np", "1"])
    first = Projector(llama_tools["llama-fit-params"], spec)
    devices = first(config)
    assert first(config) is devices and (first.runs, first.cached) == (1, 0)  # once per config in a process
    again = Projector(llama_tools["llama-fit-params"], spec)
    assert again(config) == devices and (again.runs, again.cached) == (0, 1)  # then from fitter's home
    (kept,) = (Path(os.environ["FITTER_HOME"]) / "projections").iterdir()
    kept.write_text("{not json")
    third = Projector(llama_tools["llama-fit-params"], spec)
    assert third(config) == devices and (third.runs, third.cached) == (1, 0)
    assert third.summary().startswith("1 config(s) projected by llama-fit-params --fit-print on of ")


def test_without_a_build_fitter_refuses_to_guess_and_names_the_ways_out(tmp_path: Path) -> None:
    spec = load_model_spec(str(unknown_arch_model(tmp_path)))  # the test's own fitter home: no tools built there
    with pytest.raises(FitterError) as e:
        projector_for(spec)
    assert str(e.value) == (
        f"{spec.path}: fitter has no rules for the kv and compute memory of architecture 'llamb' and will not guess "
        "it; llama.cpp's own projection needs its llama-fit-params, and none is in the pinned tools or on PATH: "
        "build the pinned tools (python -m fitter.measure.llamacpp.tools, a few minutes once), give --llama-cpp DIR, "
        "or take fitter's guess with --projection never")
    assert projector_for(spec, never=True) is None
    assert projector_for(load_model_spec(str(model_file("llama-tiny")))) is None  # nothing guessed: no build asked


def _with_the_pinned_tools() -> None:
    """The built tools in the test's own fitter home, where the commands look for them."""
    from fitter.measure.llamacpp.tools import tools_dir

    tools_dir().parent.mkdir(parents=True)
    tools_dir().symlink_to(BUILT_TOOLS, target_is_directory=True)


def _fitter(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fitter.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


@pytest.mark.tools("llama-fit-params")
def test_estimate_and_tune_take_what_fitter_guesses_from_the_pinned_build(
        llama_tools: dict[str, Path], models: Path, tmp_path: Path) -> None:  # noqa: F811
    _with_the_pinned_tools()
    model = models / "qwen4exp-moe.gguf"
    theirs = project(llama_tools["llama-fit-params"], model, ["-c", "512", "-np", "1"]).devices["CPU"]
    out = _fitter("estimate", str(model), "--devices", "none", "-c", "512", "-np", "1", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["projected"] == ["kv", "compute"]
    assert {(b["kind"], b["bytes"]) for b in doc["buffers"] if b["kind"] in ("kv", "compute")} == {
        ("kv", theirs["kv"] + MIB - 1), ("compute", theirs["compute"] + MIB - 1)}
    assert "fitter: 1 config(s) projected by llama-fit-params --fit-print on of " in out.stderr
    dry = _fitter("tune", str(model), "--backend", "sim", "--machine", "cpu-16c", "--dry-run", "-c", "512",
                  cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert ("fitter: qwen4exp: fitter has no rules for its kv and compute memory: every config is screened by "
            "llama-fit-params --fit-print on of ") in dry.stderr
    guessed = _fitter("estimate", str(model), "--devices", "cuda:8192", "-c", "512", cwd=tmp_path)
    assert guessed.returncode == 2 and "has no CUDA0 (it sees CPU)" in guessed.stderr  # a CPU build sees no CUDA
