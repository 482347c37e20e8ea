from __future__ import annotations

from dataclasses import replace

import pytest

from fitter.errors import GGUFError, LaunchConfigError
from fitter.flags import parse_launch_flags, resolve_context
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import CPU_AVX2, CPU_NO_REPACK
from fitter.memory.backends.registry import parse_devices
from fitter.memory.plan.estimator import alloc_size, estimate, kv_cache_sizes
from tests.models import model_file, model_files
from tests.properties import bounded

MIB = 1024 * 1024


def _plan(shape, flags, devices="none", sparse=False, cpu=CPU_AVX2):  # type: ignore[no-untyped-def]
    spec = load_model_spec(str(model_file(shape, sparse)))
    return spec, estimate(spec, parse_launch_flags(flags), parse_devices(devices), cpu)


def test_ncmoe_keeps_the_first_n_layers_experts_on_cpu() -> None:
    _spec, plan = _plan("gpt-oss-120b", ["-ncmoe", "30", "-c", "4096"], devices="cuda:24576", sparse=True)
    on_cpu = {p.tensor.layer for p in plan.placements if p.tensor.role.value == "expert" and p.buft == "CPU"}
    assert on_cpu == set(range(30))
    assert {p.buft for p in plan.placements if p.tensor.name.startswith("blk.30.ffn_up_exps")} == {"CUDA0"}
    assert {p.buft for p in plan.placements if p.tensor.name.startswith("blk.0.attn_q")} == {"CUDA0"}
    assert next(p.buft for p in plan.placements if p.tensor.name == "token_embd.weight") == "CPU"


def test_first_matching_override_wins() -> None:
    _, plan = _plan("gpt-oss-120b", ["-ot", r"blk\.5\.ffn_up_exps=CUDA0", "-cmoe", "-c", "4096"],
                    devices="cuda:24576", sparse=True)
    bufts = {p.tensor.name: p.buft for p in plan.placements}
    assert bufts["blk.5.ffn_up_exps.weight"] == "CUDA0"
    assert bufts["blk.5.ffn_gate_exps.weight"] == "CPU"


def test_ngl_counts_from_the_last_layer_and_output_is_a_layer() -> None:
    _spec, plan = _plan("gpt-oss-tiny", ["-ngl", "2", "-c", "512"], devices="cuda:1024")
    assert plan.layer_devices == ("CPU", "CUDA0", "CUDA0")  # layer 1 and the output layer


def test_unknown_override_buffer_type_is_rejected() -> None:
    with pytest.raises(LaunchConfigError, match=r"unknown buffer type 'CUDA1'; available: CPU, CUDA0"):
        _plan("gpt-oss-tiny", ["-ot", "exps=CUDA1"], devices="cuda:1024")


def test_mapped_cpu_buffer_spans_device_tensors_in_between() -> None:
    _spec, plan = _plan("gpt-oss-120b", ["-ncmoe", "36", "-c", "4096"], devices="cuda:24576", sparse=True)
    cpu = [p.tensor for p in plan.placements if p.buft == "CPU"]
    mapped = [b.bytes for b in plan.buffers if b.buft == "CPU_Mapped"]
    assert mapped == [max(t.offset + t.n_bytes for t in cpu) - min(t.offset for t in cpu)]
    assert mapped[0] > sum(t.n_bytes for t in cpu)  # attention weights of layers 0..35 lie in between


def test_repack_follows_the_cpu_and_no_repack() -> None:
    _, plan = _plan("gpt-oss-tiny", ["-c", "512"])
    repacked = {p.tensor.name for p in plan.placements if p.buft == "CPU_REPACK"}
    assert repacked == {f"blk.{i}.ffn_{w}_exps.weight" for i in (0, 1) for w in ("up", "gate", "down")}
    _, plan = _plan("gpt-oss-tiny", ["-c", "512", "-nr"])
    assert not any(p.buft == "CPU_REPACK" for p in plan.placements)
    _, plan = _plan("gpt-oss-tiny", ["-c", "512"], cpu=CPU_NO_REPACK)
    assert not any(p.buft == "CPU_REPACK" for p in plan.placements)


def test_cuda_pads_quantized_rows_and_aligns_to_128() -> None:
    cuda = parse_devices("cuda:1024")[0]
    # Q8_0 rows of 2880: 2880 % 512 = 320, so 192 elements (6 blocks of 34 bytes) are added once, then the
    # size is aligned to 128: 12533760 + 204 -> 12534016.
    assert alloc_size(cuda, "Q8_0", (2880, 4096), 2880 // 32 * 34 * 4096) == 12534016
    assert alloc_size(cuda, "F32", (2880,), 11520) == 11520
    assert alloc_size(None, "F32", (3,), 12) == 32


def test_swa_cache_size_follows_llama_kv_cache_iswa() -> None:
    spec = load_model_spec(str(model_files("gpt-oss-120b", sparse=True)[0]))
    ctx = resolve_context(parse_launch_flags(["-c", "32768"]), spec.n_ctx_train)  # 4 slots, unified
    assert kv_cache_sizes(spec, ctx) == (32768, 1024)  # pad256(min(32768, 128 * 4 + 512))
    ctx = resolve_context(parse_launch_flags(["-c", "32768", "-np", "1", "-ub", "2048"]), spec.n_ctx_train)
    assert kv_cache_sizes(spec, ctx) == (32768, 2304)
    ctx = resolve_context(parse_launch_flags(["-c", "32768", "--swa-full"]), spec.n_ctx_train)
    assert kv_cache_sizes(spec, ctx) == (32768, 32768)


def test_kv_bytes_of_gpt_oss_120b_q8_0() -> None:
    _, plan = _plan("gpt-oss-120b", ["-c", "32768", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-np", "1"],
                    sparse=True)
    kv = [b.bytes for b in plan.buffers if b.kind == "kv"]
    row = 8 * 64 // 32 * 34  # 8 KV heads x 64 dims in q8_0 blocks
    assert kv == [18 * 2 * row * 32768, 18 * 2 * row * 768]  # full, then SWA: pad256(128 + 512)


def test_mla_needs_equal_kv_types() -> None:
    with pytest.raises(LaunchConfigError, match=r"-ctk q8_0 -ctv f16: deepseek2 uses MLA.*same K and V cache type"):
        _plan("deepseek2-tiny", ["-ctk", "q8_0", "-fa", "on", "-c", "512"])
    _, plan = _plan("deepseek2-tiny", ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-c", "512", "-np", "1"])
    # K-only cache of 3 layers x (kv_lora 64 + rope 32) wide rows, no V
    assert [b.bytes for b in plan.buffers if b.kind == "kv"] == [3 * (96 // 32 * 34) * 512]


def test_quantized_cache_must_tile_the_heads() -> None:
    spec = replace(load_model_spec(str(model_file("qwen3-tiny"))), head_dim_k=48)  # a 48-wide head
    flags = ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-c", "512"]
    with pytest.raises(LaunchConfigError, match=r"-ctk q8_0: its block of 32 does not divide the model's head size 48"):
        estimate(spec, parse_launch_flags(flags))
    estimate(spec, parse_launch_flags(["-c", "512"]))  # f16 caches have no blocks to tile


def test_a_tensor_the_graph_needs_missing_is_one_error_naming_file_and_tensor() -> None:
    # found by tests/gguf/test_header_properties.py (issue 15): was `KeyError: 'blk.1.attn_k.weight'`
    spec = load_model_spec(str(model_file("gpt-oss-tiny")))
    spec = replace(spec, tensors=tuple(t for t in spec.tensors if t.name != "blk.1.attn_k.weight"))
    with pytest.raises(GGUFError) as info:
        estimate(spec, parse_launch_flags(["-c", "512"]), parse_devices("none"))
    assert str(info.value) == (f"{spec.path}: missing tensor 'blk.1.attn_k.weight', which llama.cpp's gpt-oss graph "
                               "needs (llama_model_loader: missing tensor)")


def test_a_head_size_of_0_with_a_quantized_k_cache_ends() -> None:
    # found by tests/gguf/test_header_properties.py: the K rotation's size loop never ended (0 % 2^n == 0)
    spec = replace(load_model_spec(str(model_file("gpt-oss-tiny"))), head_dim_k=0)
    with bounded(5):
        plan = estimate(spec, parse_launch_flags(["-c", "512", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]),
                        parse_devices("cuda:4096"))
    # V only, K has no width: per layer 64 × 512 cells in q8_0 (34816 bytes), CUDA's row padding, aligned to 128
    assert plan.totals()["CUDA0"].kv == 2 * 35328


# -- several devices ---------------------------------------------------------------------------------------------


def test_the_default_split_follows_free_memory_and_the_output_goes_with_the_last_layers() -> None:
    spec, plan = _plan("gpt-oss-120b", ["-c", "4096", "-ngl", "all"], devices="cuda:24576,12288", sparse=True)
    layers = plan.layer_devices
    # 37 layers (36 blocks and the output) split 2:1 by free memory: upper_bound(splits, il / 37)
    assert layers.count("CUDA0") == 25 and layers.count("CUDA1") == 12
    assert layers[:25] == ("CUDA0",) * 25 and layers[spec.n_layer] == "CUDA1"


def test_ts_counts_layers_per_device() -> None:
    _, plan = _plan("gpt-oss-120b", ["-c", "4096", "-ngl", "all", "-ts", "30,7"], devices="cuda:24576,12288",
                    sparse=True)
    assert plan.layer_devices.count("CUDA0") == 30 and plan.layer_devices.count("CUDA1") == 7


def test_pipeline_parallelism_needs_every_layer_offloaded_and_no_override() -> None:
    from fitter.memory.plan.estimator import pipeline_parallel

    spec = load_model_spec(str(model_file("gpt-oss-120b", True)))
    two = parse_devices("cuda:24576,12288")
    assert pipeline_parallel(spec, parse_launch_flags(["-ngl", "all"]), two)
    assert pipeline_parallel(spec, parse_launch_flags(["-ngl", "37"]), two)
    for flags in (["-ngl", "36"], ["-ngl", "all", "-ncmoe", "1"], ["-ngl", "all", "-nkvo"],
                  ["-ngl", "all", "-sm", "none"]):
        assert not pipeline_parallel(spec, parse_launch_flags(flags), two), flags
    assert not pipeline_parallel(spec, parse_launch_flags(["-ngl", "all"]), two[:1])


def test_sm_none_puts_everything_on_the_main_gpu() -> None:
    _, plan = _plan("gpt-oss-120b", ["-c", "4096", "-ngl", "all", "-sm", "none", "-mg", "1", "-cmoe"],
                    devices="cuda:24576,12288", sparse=True)
    totals = plan.totals()
    assert totals["CUDA0"].total == 0 and totals["CUDA1"].model > 0
    assert set(plan.layer_devices) == {"CUDA1"}


@pytest.mark.parametrize(("flags", "message"), [
    (["-ts", "1,1,1"], "-ts 1,1,1: 3 values for 2 device(s) (CUDA0, CUDA1); give one value per device"),
    (["-sm", "none", "-mg", "2"],
     "-mg 2: invalid value for main_gpu with -sm none: 2 device(s) (CUDA0, CUDA1), numbered from 0"),
    (["-sm", "row"], "-sm row: fitter's estimator models -sm layer, tensor and none only (llama.cpp's row split "
                     "spreads each matrix over CUDA's split buffer type); use -sm layer or tensor"),
    (["-sm", "tensor", "-fa", "off"],
     "-fa off: llama.cpp's -sm tensor requires flash attention (SPLIT_MODE_TENSOR requires flash_attn to be enabled, "
     "the context is not made); use -fa on or auto"),
    (["-ot", r"blk\.0\.=CUDA2"], "-ot blk\\.0\\.=CUDA2: unknown buffer type 'CUDA2'; available: CPU, CUDA0, CUDA1"),
])
def test_placement_flags_that_name_missing_devices_are_one_line_errors(flags: list[str], message: str) -> None:
    with pytest.raises(LaunchConfigError) as e:
        _plan("demo", ["-c", "512", *flags], devices="cuda:4096,2048")
    assert str(e.value) == message


def test_every_rpc_server_serves_its_own_device_0() -> None:
    from fitter.memory.backends.devices import rpc_devices

    assert [d.name for d in rpc_devices(["127.0.0.1:1", "127.0.0.1:2"])] == ["RPC0[127.0.0.1:1]", "RPC0[127.0.0.1:2]"]
    with pytest.raises(LaunchConfigError, match="named twice"):
        rpc_devices(["127.0.0.1:1", "127.0.0.1:1"])


def test_fewer_logits_than_sequences_is_refused_as_llama_cpp_aborts() -> None:
    # llama-server -np 5 -b 4: GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) in output_reserve; -np 4 starts
    spec = load_model_spec(str(model_file("qwen3-tiny")))
    assert estimate(spec, parse_launch_flags(["-c", "2048", "-np", "4", "-b", "4", "-ub", "4"])).context.n_seq_max == 4
    with pytest.raises(LaunchConfigError, match=r"^-b 4 with 5 sequences \(-np\): llama\.cpp aborts making the "
                                                r"context"):
        estimate(spec, parse_launch_flags(["-c", "2048", "-np", "5", "-b", "4", "-ub", "4"]))
