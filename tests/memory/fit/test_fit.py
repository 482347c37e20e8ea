from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from fitter.flags import TensorOverride, parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import CUDA, RPC, Device
from fitter.memory.fit.fit import fit, ncmoe_rules
from fitter.memory.plan.estimator import estimate
from tests.models import model_file

MIB = 1024 * 1024


def _device(mib: int, profile=CUDA, name="CUDA0") -> Device:  # type: ignore[no-untyped-def]
    return Device(name, profile, mib * MIB, mib * MIB)


def _used(plan, name: str) -> int:  # type: ignore[no-untyped-def]
    return plan.totals()[name].total


def test_moe_fit_has_no_room_left_for_another_expert_tensor() -> None:
    spec = load_model_spec(str(model_file("demo")))
    base = parse_launch_flags(["-c", "4096"])
    dev = _device(80, RPC, "RPC0[127.0.0.1:50052]")
    result = fit(spec, base, (dev,), (4,))
    budget = 76 * MIB
    assert result.fits and _used(result.plan, dev.name) <= budget
    on_cpu = [p.tensor for p in result.plan.placements if p.tensor.role.value == "expert"
              and p.tensor.name.endswith(".weight") and p.buft != dev.name]
    assert on_cpu  # 80 MiB cannot hold every expert
    for t in on_cpu:  # any one more expert tensor (with its bias) on the device would break the budget
        pattern = t.name.removesuffix(".weight").replace(".", r"\.")
        more = replace(result.config, overrides=(TensorOverride(pattern, dev.name), *result.config.overrides))
        assert _used(estimate(spec, more, (dev,)), dev.name) > budget, t.name


def test_dense_model_gets_the_most_layers_that_fit() -> None:
    spec = load_model_spec(str(model_file("qwen3-tiny")))
    base = parse_launch_flags(["-c", "2048", "-np", "1"])
    full = estimate(spec, replace(base, n_gpu_layers=-2), (_device(1024),))
    need = full.totals()["CUDA0"].total
    dev = Device("CUDA0", CUDA, need - 1, need - 1)  # one byte short of everything
    result = fit(spec, base, (dev,), (0,))
    assert result.fits and result.config.n_gpu_layers == spec.n_layer  # the output layer went back to the CPU
    assert _used(result.plan, "CUDA0") <= need - 1


def test_c0_grows_the_context_to_the_largest_that_fits() -> None:
    spec = load_model_spec(str(model_file("gpt-oss-tiny")))
    dev = _device(3)
    result = fit(spec, parse_launch_flags(["-c", "0", "-np", "1"]), (dev,), (0,), fit_ctx=512)
    assert result.fits
    n_ctx = result.plan.context.n_ctx
    assert 512 <= n_ctx <= spec.n_ctx_train
    if n_ctx < spec.n_ctx_train:
        bigger = estimate(spec, replace(result.config, ctx_size=n_ctx + 256), (dev,))
        assert _used(bigger, "CUDA0") > 3 * MIB


def test_nothing_fits_says_by_how_much_and_what_would() -> None:
    spec = load_model_spec(str(model_file("demo")))
    # 1000 MiB free but 1024 MiB to leave: even an empty GPU is 24 MiB over, plus the 27.54 MiB compute buffer CUDA
    # keeps for the prompt's ops it takes over from the CPU (op offload; tests/golden/cuda-emulated.json demo/ngl-0)
    result = fit(spec, parse_launch_flags(["-c", "8192"]), (_device(1000),), (1024,))
    assert not result.fits and result.config.n_gpu_layers == 0
    assert result.shortfall == 24 * MIB + 28874752
    assert result.suggestions == ("--fit-target 972: fits (CUDA0 needs 28 MiB with nothing offloaded, of its 1000 MiB "
                                  "free)",)
    # each device's target less what it is over by; -ngl as given, with every expert on the CPU
    two = fit(spec, parse_launch_flags(["-c", "8192"]), (_device(1000), _device(20, name="CUDA1")), (1024, 30))
    assert two.suggestions == ("--fit-target 972,20: fits (CUDA0 needs 28 MiB with nothing offloaded, of its 1000 MiB "
                               "free; CUDA1 needs 0 MiB with nothing offloaded, of its 20 MiB free)",)
    small = fit(spec, parse_launch_flags(["-c", "8192", "-ub", "128", "-ngl", "2"]), (_device(4),), (0,))
    assert small.suggestions == ("a device with more room: CUDA0 needs 22 MiB at -ngl 2 with every expert on the CPU, "
                                 "more than the 4 MiB it has free after its backend's own overhead",)


def test_fit_cli_json_and_exit_codes() -> None:
    model = str(model_file("demo"))
    # a hypothetical GPU gives 485 MiB to the CUDA context and cuBLAS (fitter.memory.backends.overhead's default) first
    ok = subprocess.run([sys.executable, "-m", "fitter.cli", "fit", model, "--devices", "cuda:585", "--fit-target",
                         "4", "-c", "4096", "--json"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out["fits"] and out["flags"][-2:] == ["-fit", "off"]
    dev = out["devices"]["CUDA0"]
    assert dev["total"] <= dev["budget"] == (585 - 485 - 4) * MIB and dev["free_after"] == dev["free"] - dev["total"]
    assert dev["overhead"] == 485 * MIB
    bad = subprocess.run([sys.executable, "-m", "fitter.cli", "fit", model, "--devices", "cuda:1500", "-c", "4096"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "does not fit" in bad.stdout


@pytest.mark.llama
def test_fitted_placement_really_loads_on_the_emulated_gpu_using_what_was_estimated() -> None:
    model = str(model_file("demo"))
    proc = subprocess.run([sys.executable, "-m", "fitter.cli", "fit", model, "--emulated-gpu", "80", "--fit-target",
                           "4", "-c", "4096", "--verify", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    (dev,) = out["devices"].values()
    assert out["emulated"] and out["verify"]["loaded"]
    assert out["verify"]["device_peak_bytes"] == dev["total"]  # the estimate, to the byte


def test_a_given_ngl_is_kept_and_the_answer_says_what_would_fit() -> None:
    spec = load_model_spec(str(model_file("demo")))
    base = parse_launch_flags(["-c", "8192", "-ngl", "all", "-fa", "off"])
    lightest = estimate(spec, replace(base, overrides=ncmoe_rules(spec.n_layer)), (_device(1024),))
    need = lightest.totals()["CUDA0"].total  # every expert on the CPU, everything else on the GPU
    dev = Device("CUDA0", CUDA, need - MIB, need - MIB)
    result = fit(spec, base, (dev,), (0,))
    assert not result.fits and result.shortfall == MIB
    assert result.config.n_gpu_layers == -2  # kept
    # each suggestion was checked with the estimator: the q8_0 KV cache makes -ngl all fit
    assert any(s.startswith("-ctk q8_0 -ctv q8_0 -fa on: fits") for s in result.suggestions)


def test_expert_layers_to_the_cpu_count_only_layers_with_experts() -> None:
    from fitter.memory.fit.fit import _cpu_layers

    layers = [3, 4, 5, 6]  # a model whose first 3 layers are dense
    # the first n expert layers as -ncmoe writes them (the dense layers before them move nothing)
    assert _cpu_layers(layers, 0, False) == []
    assert _cpu_layers(layers, 1, False) == [0, 1, 2, 3]
    assert _cpu_layers(layers, 4, False) == [0, 1, 2, 3, 4, 5, 6]
    assert _cpu_layers(layers, 2, True) == [5, 6]  # --fit's order: the last ones


@pytest.mark.slow  # ~6 s: a fit of 62 MLA layers
def test_fit_on_deepseek_v3_with_its_nextn_block_counts_only_layers_with_experts() -> None:
    from fitter.memory.plan_render import fit_table

    spec = load_model_spec(str(model_file("deepseek-v3-nextn", sparse=True)))
    assert len(spec.skipped) == 22 and spec.n_layer_trunk == 61  # block 61 is the NextN block, never loaded
    result = fit(spec, parse_launch_flags(["-c", "8192"]), (_device(96 * 1024),), (1024,))
    assert result.fits and result.expert_layers_on_device == 13
    # layers 0-2 are dense: the rules for the first 48 layers leave 13 of the 58 expert layers on the GPU
    assert [r.pattern for r in result.config.overrides] == [
        rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_(ch|)exps" for i in range(48)]
    assert "fits: experts of 13/58 expert layers on the GPU, context 8192" in fit_table(result, "", False, None)


class _Build:
    """A build's projection, as fitter.measure.llamacpp.projection.Projector gives it: its GPU compute grows by 1 MiB
    per expert tensor kept on the GPU, which a hint (the projection of another placement of the same layers) cannot
    know; its KV cache is fixed."""

    source = "the fake build"

    def __init__(self, spec, devices) -> None:  # type: ignore[no-untyped-def]
        self.spec, self.devices, self.calls = spec, devices, 0

    def __call__(self, config) -> dict[str, dict[str, int]]:  # type: ignore[no-untyped-def]
        self.calls += 1
        plan = estimate(self.spec, config, self.devices)
        kept = sum(1 for p in plan.placements if p.tensor.role.value == "expert" and p.buft == "CUDA0")
        return {"CPU": {"model": 0, "kv": 5 * MIB, "compute": 7 * MIB},
                "CUDA0": {"model": 0, "kv": 9 * MIB, "compute": (20 + kept) * MIB}}


def test_where_fitter_guesses_the_fit_is_judged_by_the_builds_projection_of_the_placement_it_returns(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.models import renamed_in_header

    spec = load_model_spec(str(renamed_in_header("demo", tmp_path, b"gpt-oss", b"gpt-osz")))
    assert spec.arch == "gpt-osz"
    dev = _device(80)
    build = _Build(spec, (dev,))
    result = fit(spec, parse_launch_flags(["-c", "4096"]), (dev,), (4,), projects=build)
    assert result.fits and result.plan.projected == ("kv", "compute")
    theirs = build(result.config)["CUDA0"]
    gpu = [b for b in result.plan.buffers if b.device == "CUDA0"]
    assert [(b.kind, b.bytes) for b in gpu if b.kind in ("kv", "compute")] == [
        ("kv", theirs["kv"] + MIB - 1), ("compute", theirs["compute"] + MIB - 1)]
    assert _used(result.plan, "CUDA0") <= 76 * MIB
    # the hint let more experts in than their own projection allowed: searched again with less room, in a few
    # projections where the search judged dozens of placements
    assert 2 <= build.calls - 1 <= 8


def test_what_fit_returns_is_estimated_in_full() -> None:
    # the search judges placements by their prompt graph alone; with a small ubatch and eight slots the one-token
    # graph is the larger on the host, and the plan fit returns is the full estimate of its config
    from fitter.memory.plan.estimator import complete, place

    spec = load_model_spec(str(model_file("qwen3-30b-a3b", sparse=True)))
    dev = _device(12288)
    result = fit(spec, parse_launch_flags(["-c", "4096", "-np", "8", "-ub", "64", "-b", "64"]), (dev,), (1024,))
    full = estimate(spec, result.config, (dev,))
    judged = complete(spec, result.config, (dev,), place(spec, result.config, (dev,)), prompt_only=True)
    host = [b.bytes for b in judged.buffers if b.kind == "compute" and b.device == "CPU"]
    assert host < [b.bytes for b in full.buffers if b.kind == "compute" and b.device == "CPU"]
    assert result.fits and result.plan.buffers == full.buffers and result.plan.warnings == full.warnings


@pytest.mark.parametrize(("mib", "mode", "ngl"), [
    (8800, "layer", 39),  # neither holds the model: the layer split, whose op offload runs the CPU's prompt on a GPU
    (8900, "tensor", 41),  # the two halves of every layer hold it all where whole layers leave two on the CPU
    (9000, "layer", -2),  # both hold it: llama.cpp's default (which is faster is the link's to say: fitter tune)
])
def test_on_two_gpus_fit_answers_with_tensor_mode_where_only_it_holds_the_model(mib: int, mode: str,
                                                                                  ngl: int) -> None:
    spec = load_model_spec(str(model_file("qwen3-14b", sparse=True)))  # 40 layers
    devices = (_device(mib), _device(mib, name="CUDA1"))
    result = fit(spec, parse_launch_flags(["-c", "8192", "-fa", "on"]), devices)
    assert result.fits and (result.config.split_mode, result.config.n_gpu_layers) == (mode, ngl)
    assert all(_used(result.plan, d.name) <= result.budgets[d.name] for d in devices)
    # -sm given, or -fa off (llama.cpp refuses tensor mode without flash attention): the layer split only
    for flags in (["-sm", "layer"], ["-fa", "off"]):
        kept = fit(spec, parse_launch_flags(["-c", "8192", *flags]), devices)
        assert kept.config.split_mode == "layer"
