"""Search-space files: shipped spaces, strict validation with file/key/value messages, resolution, flags."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from fitter.errors import FitterError, SearchSpaceError
from fitter.search.space import (
    Dimension,
    default_space_name,
    for_target,
    is_valid_combination,
    load_space,
    params_to_flags,
    resolve,
    shipped_space,
    shipped_space_names,
)

ALLOWED_KEYS = (
    "n-cpu-moe, n-gpu-layers, expert-order, batch-size, ubatch-size, cache-type-k, cache-type-v, flash-attn, "
    "load-mode, kv-offload, split-mode, threads, threads-batch"
)
NEEDS_FA = "needs flash-attn on/auto"
KV_TYPES = "f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1"
# The MoE shape the shipped spaces are resolved for: gpt-oss-20b / Qwen3-30B-A3B-like, 36 (or 48) layers.
MOE_SHAPE: dict[str, int] = {"n_layer": 36, "physical_cores": 16, "performance_cores": 8}

_COMMON: dict[str, BaseDistribution] = {
    "ubatch-size": CategoricalDistribution((256, 512, 1024, 2048, 4096)),
    "batch-size": CategoricalDistribution((2048, 4096)),
    "cache-type-k": CategoricalDistribution(("f16", "q8_0")),
    "cache-type-v": CategoricalDistribution(("f16", "q8_0")),
    "threads": CategoricalDistribution((8, 16)),  # performance-cores 8, physical 16: sorted
    "load-mode": CategoricalDistribution(("auto", "none")),
    "kv-offload": CategoricalDistribution((True, False)),
    "split-mode": CategoricalDistribution(("layer", "tensor")),
    "flash-attn": CategoricalDistribution(("on",)),
}
EXPECTED: dict[str, dict[str, BaseDistribution]] = {
    "moe": {"n-cpu-moe": IntDistribution(0, 36), **_COMMON,
            "expert-order": CategoricalDistribution(("first", "last"))},
    "dense": {"n-gpu-layers": IntDistribution(0, 37), **_COMMON},  # + the output layer
    "cpu": {
        "ubatch-size": CategoricalDistribution((256, 512, 1024, 2048)),
        "batch-size": CategoricalDistribution((2048,)),
        "cache-type-k": CategoricalDistribution(("f16", "q8_0")),
        "cache-type-v": CategoricalDistribution(("f16", "q8_0")),
        "threads": CategoricalDistribution((8, 16)),
        "flash-attn": CategoricalDistribution(("on", "off")),
    },
}


def _write(tmp_path: Path, body: str, name: str = "my.toml") -> Path:
    path = tmp_path / name
    path.write_text(body, encoding="utf-8")
    return path


def _error(tmp_path: Path, body: str) -> str:
    path = _write(tmp_path, body)
    with pytest.raises(SearchSpaceError) as info:
        load_space(path)
    return str(info.value)


def test_shipped_names() -> None:
    assert shipped_space_names() == ("moe", "dense", "cpu")


@pytest.mark.parametrize("name", ["moe", "dense", "cpu"])
def test_shipped_space_resolves_for_a_moe_shape(name: str) -> None:
    space = shipped_space(name)
    assert space.source == f"shipped:{name}"
    assert space.description
    dists = resolve(space, **MOE_SHAPE)
    assert list(dists) == list(space.keys()) == list(EXPECTED[name])  # file order
    assert dists == EXPECTED[name]


def test_shipped_moe_dimensions_as_written() -> None:
    space = shipped_space("moe")
    assert space.dims[0] == Dimension("n-cpu-moe", None, auto=True)
    assert space.dims[5] == Dimension("threads", ("performance-cores", "physical"))


def test_what_cannot_differ_on_a_target_is_left_out() -> None:
    dists = resolve(shipped_space("moe"), **MOE_SHAPE)
    on_cuda = for_target(dists, has_gpu=True, pinned_host=True, tensor_split=True)
    assert on_cuda == dists
    # an RPC device has no pinned host buffer type: -lm none would read the weights into the same memory
    on_rpc = for_target(dists, has_gpu=True, pinned_host=False)
    assert (on_rpc["load-mode"], on_rpc["kv-offload"]) == (CategoricalDistribution(("auto",)), dists["kv-offload"])
    cpu_only = for_target(dists, has_gpu=False, pinned_host=False)
    assert cpu_only["kv-offload"] == CategoricalDistribution((True,))
    assert params_to_flags({"load-mode": "none", "kv-offload": False}) == ["-lm", "none", "-nkvo"]
    assert params_to_flags({"kv-offload": True}) == ["-kvo"]


def test_split_mode_is_searched_only_where_tensor_mode_can_run() -> None:
    dists = resolve(shipped_space("moe"), **MOE_SHAPE)
    assert for_target(dists, has_gpu=True, pinned_host=True, tensor_split=True) == dists
    # one GPU, an architecture llama.cpp does not split, -fa off: layer alone, llama.cpp's default, is not searched
    assert "split-mode" not in for_target(dists, has_gpu=True, pinned_host=True)
    off = {**dists, "flash-attn": CategoricalDistribution(("off",))}
    assert "split-mode" not in for_target(off, has_gpu=True, pinned_host=True, tensor_split=True)
    layer = {**dists, "split-mode": CategoricalDistribution(("layer",))}
    assert "split-mode" not in for_target(layer, has_gpu=True, pinned_host=True, tensor_split=True)
    # a trial of tensor mode without flash attention is llama.cpp's refusal, skipped
    assert is_valid_combination({"split-mode": "tensor", "flash-attn": "off"}) == \
        "split-mode=tensor needs flash-attn on/auto"
    assert is_valid_combination({"split-mode": "tensor", "flash-attn": "auto"}) is None


def test_shipped_file_is_the_repository_file() -> None:
    # Editable install: the package reads the repository's search_spaces/ (a wheel has it as fitter/search_spaces).
    repo = Path(__file__).resolve().parents[2] / "search_spaces" / "moe.toml"
    assert load_space(repo).dims == shipped_space("moe").dims


def test_unknown_shipped_name() -> None:
    with pytest.raises(SearchSpaceError, match=re.escape("no shipped search space 'gpu'; shipped: moe, dense, cpu")):
        shipped_space("gpu")


@pytest.mark.parametrize(
    ("n_expert", "has_gpu", "name"),
    [(32, True, "moe"), (0, True, "dense"), (32, False, "cpu"), (0, False, "cpu")],
)
def test_default_space_name(n_expert: int, has_gpu: bool, name: str) -> None:
    assert default_space_name(n_expert, has_gpu) == name


def test_user_space_with_range_and_symbols(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        'description = "mine"\n[params]\nn-gpu-layers = {low = 20, high = 37}\n'
        'threads = [8, "physical", "performance-cores"]\nthreads-batch = {low = 4, high = 8}\n',
    )
    space = load_space(path)
    assert space.source == str(path)
    assert space.description == "mine"
    assert space.dims == (
        Dimension("n-gpu-layers", None, low=20, high=37),
        Dimension("threads", (8, "physical", "performance-cores")),
        Dimension("threads-batch", None, low=4, high=8),
    )
    # 8 written, physical 8, performance-cores 8 (no E-cores): one choice.
    assert resolve(space, n_layer=36, physical_cores=8, performance_cores=8) == {
        "n-gpu-layers": IntDistribution(20, 37),
        "threads": CategoricalDistribution((8,)),
        "threads-batch": IntDistribution(4, 8),
    }
    assert resolve(space, n_layer=36, physical_cores=24, performance_cores=8)["threads"] == CategoricalDistribution(
        (8, 24)
    )


def test_explicit_layer_list(tmp_path: Path) -> None:
    space = load_space(_write(tmp_path, "[params]\nn-cpu-moe = [28, 20, 24]\n"))
    assert resolve(space, **MOE_SHAPE) == {"n-cpu-moe": CategoricalDistribution((28, 20, 24))}


def test_an_expert_order_is_a_list_of_first_and_last(tmp_path: Path) -> None:
    space = load_space(_write(tmp_path, '[params]\nn-cpu-moe = "auto"\nexpert-order = ["last", "first"]\n'))
    assert resolve(space, **MOE_SHAPE)["expert-order"] == CategoricalDistribution(("last", "first"))
    bad = _write(tmp_path, '[params]\nexpert-order = ["middle"]\n', "bad.toml")
    with pytest.raises(SearchSpaceError, match=re.escape(
            f'{bad}: expert-order = ["middle"]: values must be one of last, first (got "middle")')):
        load_space(bad)
    with pytest.raises(SearchSpaceError, match=re.escape(
            f'{bad}: expert-order = "last": must be a list of choices (e.g. expert-order = ["last"])')):
        load_space(_write(tmp_path, '[params]\nexpert-order = "last"\n', "bad.toml"))


def test_an_expert_order_has_no_flag_of_its_own() -> None:
    with pytest.raises(ValueError, match=re.escape("expert-order: no flag of its own (fitter.search.split writes")):
        params_to_flags({"n-cpu-moe": 3, "expert-order": "last"})


def test_errors_are_fitter_errors() -> None:
    assert issubclass(SearchSpaceError, FitterError)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[params]\nubatch = [512]\n", f"my.toml: unknown key 'ubatch' in [params] (did you mean ubatch-size?); "
                                       f"allowed: {ALLOWED_KEYS}"),
        ("[params]\nub = [512]\n", "my.toml: unknown key 'ub' in [params] (keys are long flag names: -ub is "
                                   f"ubatch-size); allowed: {ALLOWED_KEYS}"),
        ("[params]\nmlock = [true]\n", f"my.toml: unknown key 'mlock' in [params]; allowed: {ALLOWED_KEYS}"),
        ("[params]\nctx-size = [4096, 8192]\n", "my.toml: ctx-size = [4096, 8192]: ctx-size is fixed on the command "
                                                "line (-c), not in a search space"),
        ("[params]\nparallel = [1]\n", "my.toml: parallel = [1]: parallel is fixed on the command line (-np), not in a "
                                       "search space"),
        ('[params]\ncache-type-k = ["f16", "q9_0"]\n', 'my.toml: cache-type-k = ["f16", "q9_0"]: values must be one '
                                                       f'of {KV_TYPES} (got "q9_0")'),
        ("[params]\nubatch-size = [0, 512]\n", "my.toml: ubatch-size = [0, 512]: values must be integers >= 1 (got 0)"),
        ("[params]\nubatch-size = [512.0]\n", "my.toml: ubatch-size = [512.0]: values must be integers >= 1 "
                                              "(got 512.0)"),
        ("[params]\nbatch-size = [true]\n", "my.toml: batch-size = [true]: values must be integers >= 1 (got true)"),
        ("[params]\nubatch-size = []\n", "my.toml: ubatch-size = []: the list is empty; give at least one value"),
        ("[params]\nubatch-size = [512, 1024, 512]\n", "my.toml: ubatch-size = [512, 1024, 512]: 512 is listed twice"),
        ("[params]\nubatch-size = 512\n", "my.toml: ubatch-size = 512: must be a list of choices "
                                          "(e.g. ubatch-size = [512])"),
        ('[params]\nubatch-size = "auto"\n', 'my.toml: ubatch-size = "auto": must be a list of choices '
                                             '(e.g. ubatch-size = ["auto"])'),
        ('[params]\nflash-attn = ["yes"]\n', 'my.toml: flash-attn = ["yes"]: values must be one of on, off, auto '
                                             '(got "yes")'),
        ('[params]\nthreads = ["logical"]\n', 'my.toml: threads = ["logical"]: values must be integers >= 1, '
                                              '"physical" or "performance-cores" (got "logical")'),
        ('[params]\nn-cpu-moe = "all"\n', 'my.toml: n-cpu-moe = "all": must be a list of choices, a range '
                                          '{low = A, high = B} or "auto" (e.g. n-cpu-moe = ["all"])'),
        ("[params]\nn-cpu-moe = {low = 5, high = 2}\n", "my.toml: n-cpu-moe = {low = 5, high = 2}: `low <= high` "
                                                        "must hold, but got (low=5, high=2)."),
        ("[params]\nn-cpu-moe = {low = -1, high = 2}\n", "my.toml: n-cpu-moe = {low = -1, high = 2}: low and high "
                                                         "must be integers >= 0"),
        ("[params]\nn-cpu-moe = {low = 0}\n", "my.toml: n-cpu-moe = {low = 0}: a range has exactly the keys low and "
                                              "high"),
        ("[params]\nubatch-size = {low = 256, high = 4096}\n", "my.toml: ubatch-size = {low = 256, high = 4096}: "
                                                               "must be a list of choices"),
        ("ubatch-size = [512]\n", "my.toml: unknown top-level key 'ubatch-size' (searched flags go under [params]); "
                                  "allowed: description, [params]"),
        ('description = "x"\n', f"my.toml: needs a [params] table with at least one of: {ALLOWED_KEYS}"),
        ("description = 3\n[params]\nthreads = [4]\n", "my.toml: description = 3: must be a string"),
    ],
)
def test_invalid_space(tmp_path: Path, body: str, message: str) -> None:
    assert _error(tmp_path, body) == f"{tmp_path}/{message}"


# Found by tests/search/test_space_properties.py: each was a traceback (RecursionError, ValueError, TypeError) or a
# message over two lines.
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[params]\nthreads = " + "[" * 1000 + "]" * 1000 + "\n", "my.toml: arrays or inline tables nested too deeply"),
        ("[params]\nbatch-size = [" + "9" * 4301 + "]\n", "my.toml: an integer of more than 4300 digits"),
        ("[params]\ncache-type-k = [[1]]\n",
         f"my.toml: cache-type-k = [[1]]: values must be one of {KV_TYPES} (got [1])"),
        ("description = " + "[" * 300 + "]" * 300 + "\n[params]\nthreads = [4]\n",
         "my.toml: description = [[[[[[...]]]]]]: must be a string"),
        ('[params]\nthreads = {"a\\nb" = 4}\n',
         'my.toml: threads = {"a\\nb" = 4}: a range has exactly the keys low and high'),
    ],
    ids=["nested-1000", "4301-digits", "list-in-cache-types", "description-nested-300", "newline-in-a-key"],
)
def test_hostile_space_is_one_line_naming_the_file(tmp_path: Path, body: str, message: str) -> None:
    assert _error(tmp_path, body) == f"{tmp_path}/{message}"


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    body = '[params]\nubatch-size = [256, 512]\ncache-type-k = ["f16", q8_0]\n'
    assert _error(tmp_path, body) == f"{tmp_path}/my.toml: not valid TOML: Invalid value (at line 3, column 24)"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SearchSpaceError, match=re.escape(f"{tmp_path}/none.toml: cannot read the search space: ")):
        load_space(tmp_path / "none.toml")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("n-cpu-moe = {low = 0, high = 40}", "n-cpu-moe = {low = 0, high = 40}: values must be <= 36 (the model has 36 "
                                             "layers), got 40"),
        ("n-cpu-moe = [30, 37]", "n-cpu-moe = [30, 37]: values must be <= 36 (the model has 36 layers), got 37"),
        ("n-gpu-layers = {low = 0, high = 38}", "n-gpu-layers = {low = 0, high = 38}: values must be <= 37 (the "
                                                "model's 36 layers + the output layer), got 38"),
    ],
)
def test_layer_limits_at_resolve_time(tmp_path: Path, body: str, message: str) -> None:
    path = _write(tmp_path, f"[params]\n{body}\n")
    space = load_space(path)  # valid as a file: the limit is the model's
    with pytest.raises(SearchSpaceError) as info:
        resolve(space, **MOE_SHAPE)
    assert str(info.value) == f"{path}: {message}"


def test_layer_limits_inclusive(tmp_path: Path) -> None:
    space = load_space(_write(tmp_path, "[params]\nn-cpu-moe = {low = 0, high = 36}\nn-gpu-layers = [37]\n"))
    assert resolve(space, **MOE_SHAPE) == {
        "n-cpu-moe": IntDistribution(0, 36),
        "n-gpu-layers": CategoricalDistribution((37,)),
    }


def test_params_to_flags_fixed_order() -> None:
    assert params_to_flags({"ubatch-size": 512, "n-cpu-moe": 3}) == ["-ncmoe", "3", "-ub", "512"]
    params: dict[str, Any] = {
        "threads-batch": 16, "threads": 8, "flash-attn": "on", "cache-type-v": "q8_0", "cache-type-k": "f16",
        "ubatch-size": 1024, "batch-size": 4096, "n-gpu-layers": 37, "n-cpu-moe": 20,
    }
    assert params_to_flags(params) == [
        "-ncmoe", "20", "-ngl", "37", "-b", "4096", "-ub", "1024", "-ctk", "f16", "-ctv", "q8_0", "-fa", "on",
        "-t", "8", "-tb", "16",
    ]
    assert params_to_flags({}) == []


def test_params_to_flags_rejects_unresolved_or_unknown() -> None:
    with pytest.raises(ValueError, match=re.escape("threads='physical' is not a concrete llama.cpp value")):
        params_to_flags({"threads": "physical"})
    with pytest.raises(ValueError, match=re.escape("not search-space parameters: ctx-size; known: n-cpu-moe, ")):
        params_to_flags({"ctx-size": 4096})


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"cache-type-v": "q8_0", "flash-attn": "off"}, f"quantized V cache (cache-type-v=q8_0) {NEEDS_FA}"),
        ({"cache-type-v": "q4_0", "flash-attn": "off"}, f"quantized V cache (cache-type-v=q4_0) {NEEDS_FA}"),
        ({"cache-type-v": "q8_0", "flash-attn": "on"}, None),
        ({"cache-type-v": "q8_0", "flash-attn": "auto"}, None),  # llama.cpp turns auto on for a quantized V
        ({"cache-type-v": "q8_0"}, None),  # -fa defaults to auto
        ({"cache-type-v": "bf16", "flash-attn": "off"}, None),  # not quantized
        ({"cache-type-k": "q8_0", "flash-attn": "off"}, None),  # only V needs flash attention
        (
            {"batch-size": 2048, "ubatch-size": 4096},
            "batch-size=2048 < ubatch-size=4096: llama.cpp clamps -ub to -b, a duplicate of "
            "batch-size=ubatch-size=2048",
        ),
        ({"batch-size": 4096, "ubatch-size": 4096}, None),
        ({"ubatch-size": 4096}, None),  # absent keys are not checked
        ({}, None),
    ],
)
def test_is_valid_combination(params: dict[str, Any], reason: str | None) -> None:
    assert is_valid_combination(params) == reason


def test_auto_n_cpu_moe_spans_the_expert_layers_only(tmp_path: Path) -> None:
    # DeepSeek-V3: layers 0-2 are dense, so -ncmoe 0..3 are one placement; -ncmoe 61 puts every expert on the CPU
    space = load_space(_write(tmp_path, '[params]\nn-cpu-moe = "auto"\n'))
    assert resolve(space, n_layer=61, physical_cores=8, performance_cores=8, expert_layers=range(3, 61)) == {
        "n-cpu-moe": IntDistribution(3, 61)}
    # a NextN block (block 61 of 62) has no experts the trunk loads: -ncmoe 62 would repeat 61
    assert resolve(space, n_layer=62, physical_cores=8, performance_cores=8, expert_layers=range(3, 61)) == {
        "n-cpu-moe": IntDistribution(3, 61)}
    assert resolve(space, n_layer=61, physical_cores=8, performance_cores=8) == {"n-cpu-moe": IntDistribution(0, 61)}
