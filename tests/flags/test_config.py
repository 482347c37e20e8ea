from __future__ import annotations

import pytest

from fitter.errors import LaunchConfigError
from fitter.flags import (
    FFN_EXPS_REGEX,
    ProcessFlags,
    TensorOverride,
    ncmoe_rules,
    parse_launch_flags,
    pin,
    resolve_context,
)
from tests.properties import bounded


def test_server_defaults() -> None:
    c = parse_launch_flags([])
    assert (c.ctx_size, c.batch_size, c.ubatch_size, c.cache_type_k, c.flash_attn) == (0, 2048, 512, "f16", "auto")
    assert c.n_seq_max == 4 and c.unified  # -np auto: 4 slots sharing a unified KV
    assert not parse_launch_flags(["-np", "2"]).unified
    assert parse_launch_flags(["-np", "2", "--kv-unified"]).unified


def test_overrides_keep_command_line_order() -> None:
    c = parse_launch_flags(["-ot", r"blk\.1\.=CUDA0,exps=CPU", "-ncmoe", "2", "-cmoe"])
    assert c.overrides == (
        TensorOverride(r"blk\.1\.", "CUDA0"),
        TensorOverride("exps", "CPU"),
        TensorOverride(rf"blk\.0{FFN_EXPS_REGEX}", "CPU"),
        TensorOverride(rf"blk\.1{FFN_EXPS_REGEX}", "CPU"),
        TensorOverride(FFN_EXPS_REGEX, "CPU"),
    )
    assert c.overrides[2].matches("blk.0.ffn_up_exps.bias")  # no .weight anchor: biases move too
    assert not c.overrides[2].matches("blk.10.ffn_up_exps.weight")


def test_context_is_padded_and_batches_clamped_like_llama_context() -> None:
    ctx = resolve_context(parse_launch_flags(["-c", "1000", "-b", "256", "-ub", "512", "-np", "1"]), 4096)
    assert (ctx.n_ctx, ctx.n_ctx_seq, ctx.n_batch, ctx.n_ubatch) == (1024, 1024, 256, 256)
    assert ctx.warnings == ("-ub 512 exceeds -b 256; llama.cpp clamps it to 256",
                            "-c 1000 is padded to 1024 (a multiple of 256)")
    ctx = resolve_context(parse_launch_flags(["-c", "1000", "-np", "3"]), 4096)
    assert (ctx.n_ctx, ctx.n_ctx_seq, ctx.n_stream) == (1536, 512, 3)  # 1024 / 3 = 341, padded up to 512
    ctx = resolve_context(parse_launch_flags(["-c", "0"]), 131072)
    assert (ctx.n_ctx, ctx.n_ctx_seq, ctx.n_stream, ctx.n_seq_max) == (131072, 131072, 1, 4)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-ctv", "q8_0", "-fa", "off"], r"-ctv q8_0 with -fa off: a quantized V cache requires flash"),
        (["-ctk", "q3_k"], r"argument -ctk/--cache-type-k: unsupported cache type 'q3_k'; allowed: f32, f16"),
        (["--frobnicate"], r"unrecognized arguments: --frobnicate"),
        (["-ncmoe", "-1"], r"-ncmoe -1: must be >= 0"),
        (["-ot", "exps"], r"-ot 'exps': each rule must be PATTERN=BUFFER_TYPE"),
        (["-ot", "(=CPU"], r"-ot '\(=CPU': bad regular expression"),
        (["-np", "0"], r"-np 0: must be >= 1"),
        (["-fa", "maybe"], r"expected on, off or auto, got 'maybe'"),
    ],
)
def test_bad_flags_are_rejected_with_flag_rule_and_value(flags: list[str], message: str) -> None:
    with pytest.raises(LaunchConfigError, match=message):
        parse_launch_flags(flags)


# Found by tests/flags/test_parse_properties.py.


def test_ncmoe_past_llama_max_layers_adds_a_rule_per_possible_layer() -> None:
    with bounded():
        c = parse_launch_flags(["-ncmoe", "2147483648"])  # was 2^31 rules built: MemoryError
    assert c.overrides == ncmoe_rules(512)
    assert pin(c)[-4:] == ["-ncmoe", "512", "-fit", "off"]


def test_a_cpu_range_past_ggml_max_n_threads_is_refused() -> None:
    with pytest.raises(LaunchConfigError) as e, bounded():
        ProcessFlags(cpu_range="0-99999999999").cpus  # noqa: B018 (was a set of 10^11 CPUs)
    assert str(e.value) == ("--cpu-range '0-99999999999': CPUs go up to 511 (GGML_MAX_N_THREADS, common/common.cpp "
                            "parse_cpu_range)")


def test_a_value_starting_with_a_dash_reads_back() -> None:
    # llama.cpp takes the token after -ot whatever it is; argparse took "-x=CPU" for a flag, so the pinned flags of
    # `--override-tensor=-x=CPU` did not parse back
    c = parse_launch_flags(["--override-tensor=-x=CPU"])
    assert c.overrides == (TensorOverride("-x", "CPU"),)
    assert parse_launch_flags(pin(c)).overrides == parse_launch_flags(["-ot", "-x=CPU"]).overrides == c.overrides


def test_several_endpoints_move_pairwise_and_whole_ports_only() -> None:
    from fitter.flags.parse import with_endpoints

    flags = ["--rpc", "127.0.0.1:4084,127.0.0.1:40845", "-ot", "x=RPC0[127.0.0.1:40845]"]
    moved = with_endpoints(flags, ["127.0.0.1:4084", "127.0.0.1:40845"], ["127.0.0.1:40845", "127.0.0.1:50002"])
    assert moved == ["--rpc", "127.0.0.1:40845,127.0.0.1:50002", "-ot", "x=RPC0[127.0.0.1:50002]"]
