"""fitter.flags: one table of llama.cpp's flags, every lookup derived from it, one writer back to flags."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fitter.errors import LaunchConfigError
from fitter.flags import LaunchConfig, ProcessFlags, TensorOverride, ncmoe_rules, parse_launch_flags, pin
from fitter.flags.overrides import experts_rules, override_flags, split_ncmoe
from fitter.flags.parse import flag_value, has_flag, parse_flags, split_process_flags, with_params, without
from fitter.flags.vocabulary import (
    BARE,
    FLAGS,
    MODEL_LEVEL,
    SEARCHED,
    SEARCHED_SWITCHES,
    fixing,
    launch_flags,
    short_flag,
)


def test_the_tables_derived_from_the_one_table() -> None:
    # what llama-bench's equal_mparams compares (plus --rpc: RPC devices stay registered for a process's life)
    assert MODEL_LEVEL == ("n_gpu_layers", "overrides", "no_repack", "load_mode", "tensor_split", "main_gpu",
                           "split_mode", "rpc", "device_names", "draft_model", "draft_n_gpu_layers",
                           "draft_overrides", "mmproj", "mmproj_device")
    assert fixing("n-cpu-moe") == ("-cmoe", "--cpu-moe", "-ncmoe", "--n-cpu-moe")
    assert fixing("ubatch-size") == ("-ub", "--ubatch-size")
    assert short_flag("cache-type-k") == "-ctk" and short_flag("threads-batch") == "-tb"
    assert {"-b", "-ub", "-ctk", "-ctv", "-fa", "-ngl", "-ncmoe", "-ot", "-t", "-tb", "-ts", "-sm", "-mg",
            "-lm"} == SEARCHED
    assert {"-nkvo", "-kvo"} == SEARCHED_SWITCHES
    assert {"--kv-unified", "--no-kv-unified", "-nkvo", "--swa-full", "-cmoe", "--no-mmap"} <= BARE
    names = [n for f in FLAGS for n in f.names]
    assert len(names) == len(set(names))  # one row per spelling


@pytest.mark.parametrize("row", launch_flags(), ids=lambda f: f.canonical)
def test_every_spelling_of_a_flag_parses_alike(row: object) -> None:
    values = {"ctx_size": "4096", "batch_size": "1024", "ubatch_size": "256", "cache_type_k": "q8_0",
              "cache_type_v": "q8_0", "flash_attn": "on", "n_gpu_layers": "all", "parallel": "2",
              "load_mode": "none", "fit": "off", "cache_ram_mib": "0", "tensor_split": "3,1", "main_gpu": "1",
              "split_mode": "none",
              "rpc": "h:1", "device_names": "Vulkan0,Vulkan1", "draft_model": "d.gguf", "draft_n_gpu_layers": "3",
              "draft_cache_type_k": "q8_0",
              "draft_cache_type_v": "q4_0", "spec_type": "draft-simple", "spec_draft_n_max": "8",
              "spec_draft_n_min": "1", "mmproj": "m.gguf", "mmproj_device": "Vulkan1",
              "draft_overrides": "3" if "-ncmoed" in row.names else r"exps=CPU",  # type: ignore[attr-defined]
              "overrides": "3" if "-ncmoe" in row.names else r"exps=CPU"}  # type: ignore[attr-defined]
    # a draft's setting comes with the draft (fitter.flags.draft)
    field = str(row.field)  # type: ignore[attr-defined]
    draft = ["-md", "d.gguf"] if field.startswith(("draft_", "spec_")) and field != "draft_model" else []
    configs = []
    for name in row.names:  # type: ignore[attr-defined]
        flags = [name] if name in BARE else [name, values[row.field]]  # type: ignore[attr-defined]
        configs.append(parse_launch_flags([*draft, *flags]))
    unset = parse_launch_flags(draft) if draft else LaunchConfig()
    assert all(c == configs[0] for c in configs)
    # a flag sets its field away from the default, or says the default aloud (-kvo): recorded as given either way;
    # --mmproj-offload alone leaves -mmdev's choice to llama.cpp, the empty value no writer repeats
    assert configs[0] != unset or (field in configs[0].given and field not in unset.given) or \
        row.canonical == "--mmproj-offload"  # type: ignore[attr-defined]


def test_pinned_flags_parse_back_to_the_config() -> None:
    config = LaunchConfig(ctx_size=8192, batch_size=1024, ubatch_size=256, cache_type_k="q8_0", cache_type_v="q8_0",
                          flash_attn="on", n_gpu_layers=-2, overrides=(*ncmoe_rules(3), TensorOverride("x", "CPU")),
                          parallel=2, kv_unified=True, no_repack=True, load_mode="mlock", fit=False, rpc=("h:1",))
    flags = pin(config, process=ProcessFlags(4, 2, "0xf"))
    assert flags == ["-c", "8192", "-b", "1024", "-ub", "256", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-np",
                     "2", "--kv-unified", "-ngl", "all", "-ncmoe", "3", "-ot", "x=CPU", "-nr", "-lm", "mlock",
                     "--rpc", "h:1", "-fit", "off", "-t", "4", "-tb", "2", "-C", "0xf"]
    parsed, process = parse_flags(flags)
    assert parsed == config and process == ProcessFlags(4, 2, "0xf")


def test_search_parameters_apply_as_their_flags_would() -> None:
    base = parse_launch_flags(["-c", "4096", "-ot", r"blk\.9\.=CPU"])
    params = {"n-cpu-moe": 2, "ubatch-size": 256, "flash-attn": "on", "cache-type-v": "q8_0", "n-gpu-layers": 30}
    by_flags = parse_launch_flags(["-c", "4096", "-ot", r"blk\.9\.=CPU", "-ncmoe", "2", "-ub", "256", "-fa", "on",
                                   "-ctv", "q8_0", "-ngl", "30"])
    assert with_params(base, params) == by_flags
    with pytest.raises(LaunchConfigError, match="-ctv q8_0 with -fa off: a quantized V cache requires flash"):
        with_params(base, {"cache-type-v": "q8_0", "flash-attn": "off"})
    with pytest.raises(LaunchConfigError, match=r"threads=4: not a llama\.cpp launch parameter"):
        with_params(base, {"threads": 4})


def test_override_rules_write_back_as_ncmoe_then_ot() -> None:
    rules = (*ncmoe_rules(2), *experts_rules([5], 6, ("up", "gate")))
    assert override_flags(rules) == ["-ncmoe", "2", "-ot", r"blk\.5\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU,"
                                     r"blk\.6\.ffn_(up|gate)_(ch|)exps=CPU"]
    assert override_flags(rules, separator=";")[3].count(";") == 1  # llama-bench: `,` separates its configs
    assert split_ncmoe(ncmoe_rules(3)[1:]) == (0, list(ncmoe_rules(3)[1:]))  # not layers 0…N-1: stays -ot


def test_flag_lists_are_read_by_field() -> None:
    flags = ["-c", "4096", "--rpc", "h:1", "-t", "2", "--swa-full", "-ngl", "all"]
    assert flag_value(flags, "rpc") == "h:1" and flag_value(flags, "n_gpu_layers") == "all"
    assert without(flags, "ctx_size") == ["--rpc", "h:1", "-t", "2", "--swa-full", "-ngl", "all"]
    assert has_flag(flags, "rpc") and not has_flag(flags, "tensor_split")
    assert split_process_flags(flags, "x") == (["-c", "4096", "--rpc", "h:1", "--swa-full", "-ngl", "all"],
                                               {"-t": "2"})
    with pytest.raises(LaunchConfigError, match="-t '0': expected a thread count >= 1"):
        parse_flags(["-t", "0"])
    assert replace(parse_flags(["-tb", "3"])[1], threads=1) == ProcessFlags(1, 3)
