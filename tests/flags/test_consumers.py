"""fitter.flags.consumers: each program's defaults and memory rules (`--for`), as llama.cpp 0c1e570 and
llama-cpp-python 0.3.36 have them."""

from __future__ import annotations

import dataclasses

import pytest

from fitter.errors import LaunchConfigError
from fitter.flags import parse_launch_flags, pin, resolve_context
from fitter.flags.consumers import consumer, retarget, server_flags, with_bench_context


def _fields(c: object, *names: str) -> tuple[object, ...]:
    return tuple(getattr(c, n) for n in names)


FIELDS = ("ctx_size", "batch_size", "ubatch_size", "flash_attn", "n_gpu_layers", "n_seq_max", "unified", "swa_full",
          "fit", "consumer")


def test_each_program_fills_in_its_own_defaults() -> None:
    assert _fields(parse_launch_flags([]), *FIELDS) == (0, 2048, 512, "auto", -1, 4, True, False, True,
                                                        "llama-server")
    assert _fields(parse_launch_flags([], "llama-cli"), *FIELDS) == (0, 2048, 512, "auto", -1, 1, False, False,
                                                                     True, "llama-cli")
    # Llama.__init__: n_ctx 512, n_batch 512, n_ubatch 512, flash_attn False, n_gpu_layers 0; C API swa_full true
    assert _fields(parse_launch_flags([], "llama-cpp-python"), *FIELDS) == (
        512, 512, 512, "off", 0, 1, False, True, False, "llama-cpp-python")
    # llama-bench: n_ctx = p + n + d (512 + 128 + 0), -ngl -1 = every layer, swa_full forced off
    assert _fields(parse_launch_flags([], "llama-bench"), *FIELDS) == (640, 2048, 512, "auto", -1, 1, False, False,
                                                                       False, "llama-bench")


def test_given_flags_win_over_a_programs_defaults() -> None:
    c = parse_launch_flags(["-c", "4096", "-fa", "on", "-ngl", "all", "-np", "2", "--no-kv-unified", "-b", "1024"],
                           "llama-cpp-python")
    assert _fields(c, "ctx_size", "flash_attn", "n_gpu_layers", "n_seq_max", "unified", "batch_size") == (
        4096, "on", -2, 2, False, 1024)
    assert parse_launch_flags(["--ctx-size=2048"], "llama-cpp-python").ctx_size == 2048


def test_outputs_reserved_per_slot_by_the_servers_and_per_ubatch_by_the_c_api() -> None:
    flags = ["-c", "8192", "-b", "4096", "-ub", "4096", "-np", "3"]
    assert resolve_context(parse_launch_flags(flags), 131072).n_outputs_max == 3
    assert resolve_context(parse_launch_flags(flags, "llama-cli"), 131072).n_outputs_max == 3
    assert resolve_context(parse_launch_flags(flags, "llama-cpp-python"), 131072).n_outputs_max == 4096
    bench = parse_launch_flags(["-c", "8192", "-b", "4096", "-ub", "4096"], "llama-bench")
    assert resolve_context(bench, 131072).n_outputs_max == 4096
    # llama_context clamps n_batch to n_ctx before n_outputs_max = n_batch
    assert resolve_context(parse_launch_flags(["-c", "1024", "-b", "4096"], "llama-cpp-python"), 131072) \
        .n_outputs_max == 1024


@pytest.mark.parametrize(("flags", "message"), [
    (["-np", "2"], "--for llama-bench: -np 2 cannot be given to llama-bench, which always uses 1"),
    (["--swa-full"], "--for llama-bench: --swa-full True cannot be given to llama-bench, which always uses False"),
])
def test_llama_bench_refuses_what_it_cannot_do(flags: list[str], message: str) -> None:
    with pytest.raises(LaunchConfigError, match="^" + message.replace("(", r"\(")):
        parse_launch_flags(flags, "llama-bench")


def test_kv_unification_of_one_sequence_is_no_conflict() -> None:
    # a pinned config says -np 1 --kv-unified; with one sequence there is one stream either way
    assert parse_launch_flags(["-np", "1", "-kvu"], "llama-bench").kv_unified is False


def test_auto_slots_and_fit_are_the_servers_own() -> None:
    with pytest.raises(LaunchConfigError, match="-np auto is llama-server's"):
        parse_launch_flags(["-np", "-1"], "llama-cpp-python")
    with pytest.raises(LaunchConfigError, match="-fit True cannot be given to llama-cpp-python"):
        parse_launch_flags(["-fit", "on"], "llama-cpp-python")
    assert parse_launch_flags(["-fit", "off"], "llama-cpp-python").fit is False
    with pytest.raises(LaunchConfigError, match="unknown program"):
        consumer("llama-swap")


def test_a_tuned_config_run_by_another_program_keeps_what_it_can_take() -> None:
    tuned = parse_launch_flags(["-c", "4096", "-np", "4", "--kv-unified", "--swa-full", "-fit", "off"])
    python = retarget(tuned, "llama-cpp-python")
    # the C API takes every one of them; llama-server's prompt cache (--cache-ram) is not the C API's
    assert python.cache_ram_mib == 0
    assert dataclasses.replace(python, consumer="llama-server", cache_ram_mib=8192) == tuned
    bench = retarget(tuned, "llama-bench")
    assert _fields(bench, "n_seq_max", "unified", "swa_full", "consumer") == (1, False, False, "llama-bench")
    assert (bench.parallel, bench.kv_unified) == (1, False)


def test_llama_bench_context_is_its_run_unless_given() -> None:
    assert with_bench_context(parse_launch_flags([], "llama-bench"), 704).ctx_size == 704
    assert with_bench_context(parse_launch_flags(["-c", "4096"], "llama-bench"), 704).ctx_size == 4096
    assert with_bench_context(parse_launch_flags([]), 704).ctx_size == 0  # only llama-bench's


def test_llama_server_stands_in_for_llama_cli_but_not_for_the_c_api() -> None:
    assert server_flags(parse_launch_flags(["-c", "4096"], "llama-cli")) == ["-c", "4096", "-np", "1"]
    assert server_flags(parse_launch_flags(["-c", "4096", "-np", "2"], "llama-cli")) == ["-c", "4096", "-np", "2"]
    assert server_flags(parse_launch_flags(["-c", "4096"])) == ["-c", "4096"]
    with pytest.raises(LaunchConfigError, match="llama-server cannot run the C API's memory rules"):
        server_flags(parse_launch_flags([], "llama-cpp-python"))


def test_a_pinned_config_reads_back_for_every_program() -> None:
    for program in ("llama-server", "llama-cli", "llama-cpp-python", "llama-bench"):
        config = parse_launch_flags(["-c", "1024", "-ngl", "all"], program)
        pinned = pin(config, resolve_context(config, 131072))
        back = parse_launch_flags(pinned, program)
        fields = ("n_ctx", "n_ctx_seq", "n_seq_max", "n_stream", "n_batch", "n_ubatch", "n_outputs_max", "flash_attn",
                  "swa_full")
        assert [getattr(resolve_context(back, 131072), f) for f in fields] == [
            getattr(resolve_context(config, 131072), f) for f in fields], program


def test_fitters_own_options_written_with_an_equals_sign_are_not_llama_cpp_flags() -> None:
    from fitter.cli.app import build_parser
    from fitter.cli.common import launch_args

    argv = ["estimate", "m.gguf", "--for=llama-cli", "-c", "4096", "--json"]
    config, _ = launch_args(build_parser(argv).parse_args(argv))
    assert (config.consumer, config.ctx_size, config.given) == ("llama-cli", 4096, {"ctx_size"})
    assert pin(config, given=True) == ["-c", "4096"]


def test_joined_spellings_count_as_given() -> None:
    assert parse_launch_flags(["-c=4096"], "llama-cpp-python").ctx_size == 4096
    assert parse_launch_flags(["-c4096"], "llama-cpp-python").ctx_size == 4096
    assert parse_launch_flags(["-np=3"], "llama-cli").n_seq_max == 3
