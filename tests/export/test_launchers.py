"""fitter.export.launchers: every format is parsed back the way its launcher reads it and gives the measured flags."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from fitter.errors import FitterError
from fitter.export.launchers import FORMATS, PYTHON_NOTE
from fitter.export.launchers import render as render_result
from fitter.flags import (
    LaunchConfig,
    ProcessFlags,
    TensorOverride,
    ncmoe_rules,
    parse_launch_flags,
    pin,
    resolve_context,
)
from fitter.results.pareto import POLICIES, ParetoDoc
from tests.export.readers import golib_posix_split, llama_cpp_ini, llama_swap_argv, sh_argv
from tests.hostile import HOSTILE_NAMES, HOSTILE_PATHS

MODEL = "/home/me/models/fitter-demo-gpt-oss.gguf"
SOURCE = "results/fitter-demo-gpt-oss/cpu-only-1a2b3c4d/0c1e570/pareto.json"
LAYER12_UP_GATE = TensorOverride(r"blk\.12\.ffn_(up|gate)_(ch|)exps", "CPU")  # what `fitter fit` adds after -ncmoe


def _flags(config: LaunchConfig, threads: int, threads_batch: int) -> list[str]:
    """As the tuner builds them: pinned with the model's resolved context, plus -t/-tb."""
    return pin(config, resolve_context(config, 131072), ProcessFlags(threads, threads_batch))


def render(result: dict[str, Any], policy: str, fmt: str, source: str) -> str:
    """An export of a pareto.json as the one loader reads it."""
    return render_result(ParetoDoc.from_json(result, source), policy, fmt)


def pinned_flags(config: LaunchConfig, threads: int, threads_batch: int) -> list[str]:
    """An export's pinning: the config's own values (no model context), -t/-tb as measured."""
    return pin(config, process=ProcessFlags(threads, threads_batch))


def _measurement(pp: float, tg: float) -> dict[str, Any]:
    return {"outcome": "ok", "reason": "", "emulated": False, "backend": "llama-cpp-python",
            "pp": {"n": 512, "avg_ts": pp, "stddev_ts": 1.5, "samples_ts": [pp] * 3},
            "tg": {"n": 128, "depth": 0, "avg_ts": tg, "stddev_ts": 0.4, "samples_ts": [tg] * 3},
            "peak_vram": {}, "llama_cpp": {"commit": "0c1e570", "source": "llama-cpp-python 0.3.36"}}


# Three Pareto entries of a MoE tune: decode-first (q8_0 KV, one slot), prefill-first (big batches, 4 slots with
# separate streams) and the smallest (q4_0 V, full SWA cache, no repacking, mlock).
CONFIGS = {
    3: (LaunchConfig(ctx_size=4096, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on", n_gpu_layers=-2,
                     overrides=(*ncmoe_rules(12), LAYER12_UP_GATE), parallel=1, kv_unified=True, fit=False), 2, 2),
    5: (LaunchConfig(ctx_size=16384, batch_size=4096, ubatch_size=2048, flash_attn="on", n_gpu_layers=-2,
                     overrides=ncmoe_rules(16), parallel=4, kv_unified=False, fit=False), 2, 4),
    7: (LaunchConfig(ctx_size=8192, cache_type_k="q8_0", cache_type_v="q4_0", flash_attn="on", n_gpu_layers=-2,
                     overrides=ncmoe_rules(24), parallel=2, kv_unified=True, swa_full=True, no_repack=True,
                     load_mode="mlock", fit=False), 1, 1),
}
PICKS = {"max-decode": 3, "max-prefill": 5, "balanced": 3, "min-vram": 7, "max-context": 5}


def _result() -> dict[str, Any]:
    speeds = {3: (812.0, 41.25), 5: (1630.5, 35.0), 7: (640.0, 40.0)}
    return {
        "model": {"path": MODEL, "name": "fitter-demo-gpt-oss", "arch": "gpt-oss", "shards": 1},
        "machine": {"cpu": "Example CPU", "gpus": [], "fingerprint": "1a2b3c4d5e6f7a8b"},
        "llama_cpp": {"commit": "0c1e570", "source": "llama-cpp-python 0.3.36"},
        "objectives": ["tg", "pp", "vram"], "fit_target_mib": [1024],
        "baseline": {"name": "llama.cpp --fit", "flags": ["-fit", "on"], "measurement": _measurement(700.0, 30.0)},
        "pareto": [{"trial": n, "flags": _flags(c, t, tb), "measurement": _measurement(*speeds[n]),
                    "vram_bytes": 1000 * n} for n, (c, t, tb) in CONFIGS.items()],
        "picks": dict(PICKS),
    }


def _entry(result: dict[str, Any], policy: str) -> dict[str, Any]:
    return next(e for e in result["pareto"] if e["trial"] == result["picks"][policy])


def _split_threads(flags: list[str]) -> tuple[list[str], dict[str, str]]:
    """(llama.cpp flags, {"--threads": N, "--threads-batch": N}) with long or short spellings."""
    names = {"-t": "--threads", "--threads": "--threads",
             "-tb": "--threads-batch", "--threads-batch": "--threads-batch"}
    rest: list[str] = []
    threads: dict[str, str] = {}
    it = iter(flags)
    for f in it:
        if f in names:
            threads[names[f]] = next(it)
        else:
            rest.append(f)
    return rest, threads


def _expected(policy: str) -> tuple[LaunchConfig, dict[str, str]]:
    config, t, tb = CONFIGS[PICKS[policy]]
    return config, {"--threads": str(t), "--threads-batch": str(tb)}


# -- server ------------------------------------------------------------------------------------------------------


def test_server_line_of_the_decode_pick() -> None:
    assert render(_result(), "max-decode", "server", SOURCE) == (
        f"llama-server -m {MODEL} -c 4096 -b 2048 -ub 512 -ctk q8_0 -ctv q8_0 -fa on -np 1 --kv-unified -ngl all "
        r"-ncmoe 12 -ot 'blk\.12\.ffn_(up|gate)_(ch|)exps=CPU' -fit off -t 2 -tb 2" "\n"
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_server_line_parses_back_to_the_entry(policy: str) -> None:
    result = _result()
    out = render(result, policy, "server", SOURCE)
    assert out.count("\n") == 1
    argv = shlex.split(out)
    assert argv[:3] == ["llama-server", "-m", MODEL]
    assert argv[3:] == _entry(result, policy)["flags"]
    launch, threads = _split_threads(argv[3:])
    assert (parse_launch_flags(launch), threads) == _expected(policy)


def test_server_line_quotes_a_path_with_blanks() -> None:
    result = _result()
    result["model"]["path"] = "/home/me/my models/demo.gguf"
    argv = shlex.split(render(result, "max-decode", "server", SOURCE))
    assert argv[:3] == ["llama-server", "-m", "/home/me/my models/demo.gguf"]


# -- preset-ini --------------------------------------------------------------------------------------------------

PRESET_BOOL_KEYS = {"kv-unified", "swa-full", "kv-offload", "op-offload", "repack", "cpu-moe", "mmproj-offload"}


def _preset_argv(section: dict[str, str]) -> list[str]:
    """What llama-server's common_preset::to_args makes of a section: `--key value`, bools as --key / --no-key."""
    argv: list[str] = []
    for key, value in section.items():
        if key in PRESET_BOOL_KEYS:
            assert value in ("true", "false")
            argv.append(f"--{key}" if value == "true" else f"--no-{key}")
        else:
            argv += [f"--{key}", value]
    return argv


def test_preset_ini_of_the_decode_pick() -> None:
    assert render(_result(), "max-decode", "preset-ini", SOURCE) == (
        f"; fitter export --policy max-decode: trial 3 of {SOURCE}\n"
        "; measured tg 41.2 t/s, pp 812.0 t/s with llama.cpp 0c1e570\n"
        "; q8_0/q8_0 KV: its cost in quality was not measured (--objectives ...,quality measures it with "
        "llama-perplexity)\n"
        "[fitter-demo-gpt-oss]\n"
        f"model = {MODEL}\n"
        "ctx-size = 4096\nbatch-size = 2048\nubatch-size = 512\ncache-type-k = q8_0\ncache-type-v = q8_0\n"
        "flash-attn = on\nparallel = 1\nkv-unified = true\nn-gpu-layers = all\nn-cpu-moe = 12\n"
        "override-tensor = blk\\.12\\.ffn_(up|gate)_(ch|)exps=CPU\nfit = off\nthreads = 2\nthreads-batch = 2\n"
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_preset_ini_reads_back_as_the_entry(policy: str) -> None:
    ini = llama_cpp_ini(render(_result(), policy, "preset-ini", SOURCE))
    assert list(ini) == ["fitter-demo-gpt-oss"]
    argv = _preset_argv(ini["fitter-demo-gpt-oss"])
    assert argv[:2] == ["--model", MODEL]
    launch, threads = _split_threads(argv[2:])
    assert (parse_launch_flags(launch), threads) == _expected(policy)


def test_preset_ini_writes_negative_flags_as_false() -> None:
    ini = llama_cpp_ini(render(_result(), "max-prefill", "preset-ini", SOURCE))
    assert ini["fitter-demo-gpt-oss"]["kv-unified"] == "false"
    section = llama_cpp_ini(render(_result(), "min-vram", "preset-ini", SOURCE))["fitter-demo-gpt-oss"]
    assert (section["swa-full"], section["repack"], section["load-mode"]) == ("true", "false", "mlock")


def test_preset_ini_refuses_a_value_llama_server_would_cut() -> None:
    result = _result()
    result["model"]["path"] = "/models/a;b.gguf"
    with pytest.raises(FitterError) as e:
        render(result, "max-decode", "preset-ini", SOURCE)
    assert str(e.value) == ("preset-ini: model = '/models/a;b.gguf': llama-server's preset parser ends a value at ';', "
                            "'#' or a line break and drops the blanks around it; launch with --format server instead")


def test_preset_ini_section_name_avoids_a_tag() -> None:
    result = _result()
    result["model"]["name"] = "gpt-oss-20b:mxfp4"  # llama-server would re-case a `:tag` section name
    assert "\n[gpt-oss-20b-mxfp4]\n" in render(result, "max-decode", "preset-ini", SOURCE)


# -- llama-swap --------------------------------------------------------------------------------------------------


def _swap_argv(cmd: str) -> list[str]:
    return llama_swap_argv(cmd)


@pytest.mark.parametrize("policy", POLICIES)
def test_llama_swap_entry_reads_back_as_the_entry(policy: str) -> None:
    result = _result()
    doc = yaml.safe_load(render(result, policy, "llama-swap", SOURCE))
    assert list(doc) == ["models"] and list(doc["models"]) == ["fitter-demo-gpt-oss"]
    model = doc["models"]["fitter-demo-gpt-oss"]
    assert list(model) == ["cmd"]
    assert "--port ${PORT}" in model["cmd"]
    argv = _swap_argv(model["cmd"])
    assert argv[:5] == ["llama-server", "--port", "${PORT}", "-m", MODEL]
    assert argv[5:] == _entry(result, policy)["flags"]
    launch, threads = _split_threads(argv[5:])
    assert (parse_launch_flags(launch), threads) == _expected(policy)


def test_llama_swap_entry_of_the_decode_pick() -> None:
    assert render(_result(), "max-decode", "llama-swap", SOURCE) == (
        f"# fitter export --policy max-decode: trial 3 of {SOURCE}\n"
        "# measured tg 41.2 t/s, pp 812.0 t/s with llama.cpp 0c1e570\n"
        "# q8_0/q8_0 KV: its cost in quality was not measured (--objectives ...,quality measures it with "
        "llama-perplexity)\n"
        "models:\n"
        '  "fitter-demo-gpt-oss":\n'
        "    cmd: |\n"
        "      llama-server\n      --port ${PORT}\n"
        f"      -m {MODEL}\n"
        "      -c 4096\n      -b 2048\n      -ub 512\n      -ctk q8_0\n      -ctv q8_0\n      -fa on\n      -np 1\n"
        "      --kv-unified\n      -ngl all\n      -ncmoe 12\n"
        "      -ot 'blk\\.12\\.ffn_(up|gate)_(ch|)exps=CPU'\n"
        "      -fit off\n      -t 2\n      -tb 2\n"
    )


def test_llama_swap_refuses_a_macro_in_a_value() -> None:
    result = _result()
    result["model"]["path"] = "${models_dir}/demo.gguf"
    with pytest.raises(FitterError) as e:
        render(result, "max-decode", "llama-swap", SOURCE)
    assert str(e.value) == "llama-swap: '${models_dir}/demo.gguf' contains '${', which llama-swap reads as a macro"


# -- python ------------------------------------------------------------------------------------------------------


def test_python_kwargs_and_overrides_of_the_decode_pick() -> None:
    doc = json.loads(render(_result(), "max-decode", "python", SOURCE))
    assert doc["kwargs"] == {
        "model_path": MODEL, "n_gpu_layers": -1, "main_gpu": 0, "split_mode": 1, "use_mmap": True, "use_mlock": False,
        "n_ctx": 4096, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2, "n_threads_batch": 2,
        "offload_kqv": True, "flash_attn": True, "op_offload": True, "swa_full": False,
        "type_k": 8, "type_v": 8,  # GGML_TYPE_Q8_0
    }
    assert doc["tensor_overrides"] == [{"pattern": r.pattern, "buft": "CPU"}
                                       for r in (*ncmoe_rules(12), LAYER12_UP_GATE)]
    assert doc["tensor_overrides"][0] == {"pattern": r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps", "buft": "CPU"}
    assert doc["note"] == PYTHON_NOTE
    assert "cannot express -ncmoe/-ot" in doc["note"] and "n_cpu_moe" in doc["note"]
    assert "tensor_buft_overrides" in doc["note"]
    assert (doc["llama_cpp_python"], doc["policy"], doc["trial"]) == ("0.3.36", "max-decode", 3)
    assert "not_in_kwargs" not in doc and "warning" not in doc


def test_python_says_what_kwargs_cannot_carry() -> None:
    prefill = json.loads(render(_result(), "max-prefill", "python", SOURCE))
    assert prefill["kwargs"]["type_k"] == 1 and prefill["kwargs"]["n_threads_batch"] == 4  # GGML_TYPE_F16
    assert prefill["tensor_overrides"] == [{"pattern": r.pattern, "buft": "CPU"} for r in ncmoe_rules(16)]
    assert prefill["not_in_kwargs"] == [
        "-np 4 --no-kv-unified: Llama decodes one sequence (n_seq_max 1); its KV cache holds the same n_ctx cells "
        "in one stream"]
    small = json.loads(render(_result(), "min-vram", "python", SOURCE))
    kw = small["kwargs"]
    assert (kw["type_v"], kw["swa_full"], kw["use_mmap"], kw["use_mlock"]) == (2, True, False, True)  # Q4_0
    assert small["not_in_kwargs"][1] == "-nr: llama_model_params.use_extra_bufts = False (no keyword)"


@pytest.mark.llama
def test_python_kwargs_are_llama_cpp_python_parameters() -> None:
    import inspect

    import llama_cpp

    params = inspect.signature(llama_cpp.Llama.__init__).parameters
    for policy in POLICIES:
        kwargs = json.loads(render(_result(), policy, "python", SOURCE))["kwargs"]
        assert set(kwargs) <= set(params) - {"kwargs"}
    kwargs = json.loads(render(_result(), "max-decode", "python", SOURCE))["kwargs"]
    assert kwargs["type_k"] == llama_cpp.GGML_TYPE_Q8_0 and kwargs["type_v"] == llama_cpp.GGML_TYPE_Q8_0


# -- json --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_json_is_the_entry(policy: str) -> None:
    result = _result()
    assert json.loads(render(result, policy, "json", SOURCE)) == _entry(result, policy)


# -- pinning -----------------------------------------------------------------------------------------------------


def test_unpinned_flags_are_pinned_in_every_format() -> None:
    result = _result()
    result["pareto"][0]["flags"] = ["-c", "4096", "-fa", "on", "-ngl", "all", "-ncmoe", "3", "-ub", "1024",
                                    "--threads", "4"]
    pinned = ["-c", "4096", "-b", "2048", "-ub", "1024", "-ctk", "f16", "-ctv", "f16", "-fa", "on", "-np", "4",
              "--kv-unified", "-ngl", "all", "-ncmoe", "3", "-fit", "off", "-t", "4", "-tb", "4"]
    assert shlex.split(render(result, "max-decode", "server", SOURCE))[3:] == pinned
    assert json.loads(render(result, "max-decode", "json", SOURCE))["flags"] == pinned
    assert _swap_argv(yaml.safe_load(render(result, "max-decode", "llama-swap", SOURCE))
                      ["models"]["fitter-demo-gpt-oss"]["cmd"])[5:] == pinned


def test_pinned_flags_match_fitters_server_flags() -> None:
    config, threads, threads_batch = CONFIGS[3]
    assert pinned_flags(config, threads, threads_batch) == _flags(config, threads, threads_batch)


def test_cpu_only_result_pins_no_offload() -> None:
    result = _result()
    result["pareto"][0]["flags"] = ["-c", "2048", "-fa", "off", "-np", "1", "-t", "8"]
    argv = shlex.split(render(result, "max-decode", "server", SOURCE))
    assert argv[argv.index("-ngl") + 1] == "0"
    assert json.loads(render(result, "max-decode", "python", SOURCE))["kwargs"]["n_gpu_layers"] == 0


def test_emulated_gpu_rpc_is_left_out_with_a_warning() -> None:
    result = _result()
    result["emulated"] = True
    entry = result["pareto"][0]
    entry["flags"] = [*entry["flags"][:-4], "--rpc", "127.0.0.1:34379", *entry["flags"][-4:]]
    warning = ("measured on fitter's emulated GPU (a capped llama.cpp RPC device on the tuning machine, CPU speed); "
               "its --rpc 127.0.0.1:34379 is left out: check the placement fits your GPU with `fitter fit`")
    server = render(result, "max-decode", "server", SOURCE).splitlines()
    assert server[0] == f"# {warning}"
    assert shlex.split(server[1])[3:] == _flags(*CONFIGS[3])
    assert f"; {warning}\n[fitter-demo-gpt-oss]\n" in render(result, "max-decode", "preset-ini", SOURCE)
    assert f"# {warning}\nmodels:\n" in render(result, "max-decode", "llama-swap", SOURCE)
    assert json.loads(render(result, "max-decode", "python", SOURCE))["warning"] == warning
    exported = json.loads(render(result, "max-decode", "json", SOURCE))
    assert exported == {**entry, "flags": _flags(*CONFIGS[3]), "warning": warning}


def test_several_emulated_gpus_stand_for_cuda0_cuda1_in_their_order() -> None:
    result = _result()
    result["emulated"] = True
    entry = result["pareto"][0]
    rule = r"blk\.2\.ffn_(gate|gate_up|down).*=RPC0[127.0.0.1:40845]"
    entry["flags"] = [*entry["flags"][:-4], "-ts", "6,1", "-ot", rule, "--rpc", "127.0.0.1:57881,127.0.0.1:40845",
                      *entry["flags"][-4:]]
    warning = ("measured on fitter's emulated GPUs (capped llama.cpp RPC devices on the tuning machine, CPU speed); "
               "its --rpc 127.0.0.1:57881,127.0.0.1:40845 is left out; -ot names RPC0[127.0.0.1:40845] as CUDA1: "
               "check the placement fits your GPUs with `fitter fit`")
    server = render(result, "max-decode", "server", SOURCE).splitlines()
    assert server[0] == f"# {warning}"
    argv = shlex.split(server[1])
    rules = argv[argv.index("-ot") + 1].split(",")
    assert rules[-1] == r"blk\.2\.ffn_(gate|gate_up|down).*=CUDA1"
    assert argv[argv.index("-ts") + 1] == "6,1" and "--rpc" not in argv
    python = json.loads(render(result, "max-decode", "python", SOURCE))
    assert python["kwargs"]["tensor_split"] == [6.0, 1.0]
    assert python["tensor_overrides"][-1] == {"pattern": r"blk\.2\.ffn_(gate|gate_up|down).*", "buft": "CUDA1"}


def test_a_tune_through_a_build_names_the_devices_its_trials_used_in_every_format() -> None:
    result = _result()
    result["machine"]["model_devices"] = ["Vulkan0"]  # fitter.tune.targets: llama.cpp's own choice on the listing
    argv = shlex.split(render(result, "max-decode", "server", SOURCE).splitlines()[-1])
    assert argv[argv.index("-dev") + 1] == "Vulkan0"
    assert parse_launch_flags(argv[3:-4]).device_names == ("Vulkan0",)
    assert "device = Vulkan0" in render(result, "max-decode", "preset-ini", SOURCE)
    python = json.loads(render(result, "max-decode", "python", SOURCE))
    assert python["not_in_kwargs"][-1] == ("-dev Vulkan0: llama_model_params.devices, a NULL-terminated array of the "
                                           "ggml devices by name (ggml_backend_dev_by_name; no keyword)")
    given = _result()  # the user's own -dev stays as tuned
    given["machine"]["model_devices"] = ["Vulkan0"]
    given["pareto"][0]["flags"] = ["-dev", "Vulkan1", *given["pareto"][0]["flags"]]
    argv = shlex.split(render(given, "max-decode", "server", SOURCE).splitlines()[-1])
    assert argv[argv.index("-dev") + 1] == "Vulkan1" and argv.count("-dev") == 1


# -- errors ------------------------------------------------------------------------------------------------------


def _error(result: dict[str, Any], policy: str = "max-decode", fmt: str = "server") -> str:
    with pytest.raises(FitterError) as e:
        render(result, policy, fmt, SOURCE)
    return str(e.value)


def test_unknown_policy() -> None:
    assert _error(_result(), policy="fastest") == (
        "--policy 'fastest': unknown policy; choose one of max-decode, max-prefill, balanced, min-vram, "
        "max-context")


def test_unknown_format() -> None:
    assert _error(_result(), fmt="toml") == (
        "--format 'toml': unknown format; choose one of server, preset-ini, llama-swap, python, json")
    assert FORMATS == ("server", "preset-ini", "llama-swap", "python", "json")


def test_missing_picks() -> None:
    result = _result()
    del result["picks"]
    assert _error(result) == f'{SOURCE}: no "picks" (the tune found no confirmed configuration?); nothing to export'


def test_policy_without_a_pick() -> None:
    result = _result()
    del result["picks"]["min-vram"]
    assert _error(result, policy="min-vram") == (
        f"{SOURCE}: no min-vram pick (picks: balanced=3, max-context=5, max-decode=3, max-prefill=5); choose another "
        "--policy")


def test_pick_missing_from_pareto() -> None:
    result = _result()
    result["picks"]["balanced"] = 9
    assert _error(result, policy="balanced") == (
        f'{SOURCE}: the balanced pick is trial 9, which is not in "pareto" (trials: 3, 5, 7)')


@pytest.mark.parametrize(
    ("flags", "machine_gpus", "message"),
    [
        (["-c", "4096", "-fa", "auto", "-ngl", "all", "-t", "2"], [],
         "-fa auto is resolved by llama-server per device at launch; an export pins -fa on or off: tune with "
         "flash-attn on/off"),
        (["-c", "4096", "-fa", "on", "-t", "2"], ["NVIDIA GeForce RTX 4070"],
         "-ngl auto leaves the placement to llama.cpp's --fit; an export pins it: tune with -ngl (or let `fitter "
         "fit` choose the placement)"),
        (["-c", "4096", "-fa", "on", "-ngl", "all"], [], "no -t (threads); an export pins -t and -tb as measured"),
        (["-c", "4096", "-fa", "on", "-ngl", "all", "-t", "0"], [], "-t '0': expected a thread count >= 1"),
        (["-c", "4096", "-ctv", "q8_0", "-fa", "off", "-t", "2"], [],
         "-ctv q8_0 with -fa off: a quantized V cache requires flash attention (src/llama-context.cpp); use -fa on "
         "or -ctv f16"),
    ],
)
def test_flags_an_export_cannot_pin(flags: list[str], machine_gpus: list[str], message: str) -> None:
    result = copy.deepcopy(_result())
    result["pareto"][0]["flags"] = flags
    result["machine"]["gpus"] = machine_gpus
    assert _error(result) == f"{SOURCE}: the max-decode pick (trial 3): {message}"


# -- hostile names: every format reads back as exactly what was measured -------------------------------------------

# what llama.cpp's preset parser cannot hold (common/preset.cpp): ';', '#', a line break, blanks around the value
INI_CANNOT = re.compile(r"[;#\r\n]|^[ \t]|[ \t]$")


def _hostile(path: str, name: str = "fitter-demo-gpt-oss") -> dict[str, Any]:
    result = _result()
    result["model"].update(path=path, name=name)
    return result


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_a_hostile_model_path_reads_back_exactly_from_the_server_line(path: str, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    out = render(_hostile(path), "max-decode", "server", SOURCE)
    expected = ["llama-server", "-m", path, *_entry(_result(), "max-decode")["flags"]]
    assert shlex.split(out) == expected
    monkeypatch.chdir(tmp_path)
    assert sh_argv(out.rstrip("\n")) == expected  # nothing ran: no word is a command, a variable or a substitution


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_a_hostile_model_path_reads_back_exactly_from_llama_swaps_cmd(path: str) -> None:
    doc = yaml.safe_load(render(_hostile(path), "max-decode", "llama-swap", SOURCE))
    argv = llama_swap_argv(doc["models"]["fitter-demo-gpt-oss"]["cmd"])
    assert argv == ["llama-server", "--port", "${PORT}", "-m", path, *_entry(_result(), "max-decode")["flags"]]


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_a_hostile_model_path_reads_back_exactly_from_the_preset_or_is_refused(path: str) -> None:
    if INI_CANNOT.search(path):
        with pytest.raises(FitterError) as e:
            render(_hostile(path), "max-decode", "preset-ini", SOURCE)
        assert str(e.value) == (f"preset-ini: model = {path!r}: llama-server's preset parser ends a value at ';', '#' "
                                "or a line break and drops the blanks around it; launch with --format server instead")
        return
    ini = llama_cpp_ini(render(_hostile(path), "max-decode", "preset-ini", SOURCE))
    assert list(ini) == ["fitter-demo-gpt-oss"] and ini["fitter-demo-gpt-oss"]["model"] == path


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_a_hostile_model_path_reads_back_exactly_from_python_and_json(path: str) -> None:
    assert json.loads(render(_hostile(path), "max-decode", "python", SOURCE))["kwargs"]["model_path"] == path
    assert json.loads(render(_hostile(path), "max-decode", "json", SOURCE)) == _entry(_result(), "max-decode")


def test_which_hostile_paths_the_preset_refuses() -> None:
    # the preset's refusals are the paths above with ';', '#', a line break or an outer blank, and no others
    assert [p for p in HOSTILE_PATHS if INI_CANNOT.search(p)] == [HOSTILE_PATHS[i] for i in (2, 3, 4, 9, 10)]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_hostile_model_name_is_llama_swaps_model_id_and_a_preset_section(name: str) -> None:
    doc = yaml.safe_load(render(_hostile(MODEL, name), "max-decode", "llama-swap", SOURCE))
    assert list(doc["models"]) == [name]
    ini = llama_cpp_ini(render(_hostile(MODEL, name), "max-decode", "preset-ini", SOURCE))
    (section,) = ini
    assert ini[section]["model"] == MODEL
    assert section not in ("*", "") and not re.search(r"[\[\]:\s]", section)  # not the global section, no tag


def test_a_model_name_the_preset_cannot_use_as_is() -> None:
    sections = [next(iter(llama_cpp_ini(render(_hostile(MODEL, n), "max-decode", "preset-ini", SOURCE))))
                for n in ("*", "[x]:q4_k_m", "two\nlines", "-", "a b")]
    assert sections == ["model", "x-q4_k_m", "two-lines", "model", "a-b"]


def test_a_hostile_results_path_stays_in_its_comment_lines() -> None:
    source = "results/x\nmodel = /evil.gguf\n[evil]\nrm -rf ~\r\x85\u2028models:/pareto.json"
    ini = llama_cpp_ini(render(_result(), "max-decode", "preset-ini", source))
    assert list(ini) == ["fitter-demo-gpt-oss"] and ini["fitter-demo-gpt-oss"]["model"] == MODEL
    doc = yaml.safe_load(render(_result(), "max-decode", "llama-swap", source))
    assert list(doc) == ["models"] and list(doc["models"]) == ["fitter-demo-gpt-oss"]
    for fmt in ("preset-ini", "llama-swap"):
        header = render(_result(), "max-decode", fmt, source).splitlines()[0]
        assert header.endswith(r"of results/x\nmodel = /evil.gguf\n[evil]\nrm -rf ~\r\x85\u2028models:/pareto.json")


def test_a_name_in_another_encoding_is_refused() -> None:
    path = b"/models/caf\xe9.gguf".decode("utf-8", "surrogateescape")  # a Latin-1 file name as Python holds it
    for fmt in FORMATS:
        with pytest.raises(FitterError) as e:
            render(_hostile(path), "max-decode", fmt, SOURCE)
        assert str(e.value) == (f"{SOURCE}: model.path '/models/caf\\udce9.gguf': not valid UTF-8 (a name in another "
                                "encoding); an export is UTF-8 text: rename it")


GOLIB_POSIX_CASES = [  # golib's own table (shlex/shlex_test.go TestPosix), for the port in tests/export/readers.py
    ("", []), ("foo", ["foo"]), (" foo", ["foo"]), ("foo bar", ["foo", "bar"]), ('foo"   "bar', ["foo   bar"]),
    ('foo"   ', ["foo   "]), ('foo "bar   baz', ["foo", "bar   baz"]), ('foo "bar   baz"bag', ["foo", "bar   bazbag"]),
    ('foo ""', ["foo", ""]), ('foo "" bar', ["foo", "", "bar"]), ("foo'   'bar", ["foo   bar"]),
    ("foo '' bar", ["foo", "", "bar"]), ("\\foo", ["foo"]), ("foo\\", ["foo"]), ('\\"foo', ['"foo']),
    ("f\\'oo", ["f'oo"]), ("foo\\\nbar", ["foobar"]), ('foo "b\\ar"', ["foo", "b\\ar"]),
    ('foo "b\\"ar"', ["foo", 'b"ar']), ("foo \"b'a'r\"", ["foo", "b'a'r"]), ('foo"\\', ["foo"]),
    ('foo"\\\nbar"', ["foobar"]), ("foo 'b\\ar'", ["foo", "b\\ar"]), ("foo 'b\\\"ar'", ["foo", 'b\\"ar']),
    ("foo'\\", ["foo\\"]), ("foo'\\\nbar'", ["foo\\\nbar"]),
]


@pytest.mark.parametrize(("line", "words"), GOLIB_POSIX_CASES)
def test_the_llama_swap_splitter_port_reads_golibs_own_cases(line: str, words: list[str]) -> None:
    assert golib_posix_split(line) == words


# -- a draft model -----------------------------------------------------------------------------------------------

DRAFT_FLAGS = ["-md", "/home/me/models/draft.gguf", "-ngld", "all", "-ncmoed", "2", "-ctkd", "q8_0", "-ctvd", "q8_0",
               "--spec-type", "draft-simple", "--spec-draft-n-max", "8"]


def _with_draft() -> tuple[dict[str, Any], LaunchConfig]:
    config = parse_launch_flags(["-c", "4096", "-fa", "on", "-ngl", "all", "-ncmoe", "12", "-np", "1", *DRAFT_FLAGS])
    result = _result()
    result["pareto"][0]["flags"] = _flags(config, 2, 2)
    return result, config


def test_every_format_pins_the_draft_model_and_reads_back_as_the_entry() -> None:
    result, config = _with_draft()
    argv = shlex.split(render(result, "max-decode", "server", SOURCE))
    assert argv[argv.index("-md"):] == [
        "-md", "/home/me/models/draft.gguf", "-ngld", "all", "-ncmoed", "2", "-ctkd", "q8_0", "-ctvd", "q8_0",
        "--spec-type", "draft-simple", "--spec-draft-n-max", "8", "--spec-draft-n-min", "0", "-fit", "off", "-t", "2",
        "-tb", "2"]
    launch, _ = _split_threads(argv[3:])
    section = llama_cpp_ini(render(result, "max-decode", "preset-ini", SOURCE))["fitter-demo-gpt-oss"]
    assert {k: section[k] for k in ("model-draft", "n-gpu-layers-draft", "n-cpu-moe-draft", "cache-type-k-draft",
                                    "spec-type", "spec-draft-n-max")} == {
        "model-draft": "/home/me/models/draft.gguf", "n-gpu-layers-draft": "all", "n-cpu-moe-draft": "2",
        "cache-type-k-draft": "q8_0", "spec-type": "draft-simple", "spec-draft-n-max": "8"}
    from_ini, _ = _split_threads(_preset_argv(section)[2:])
    swap = yaml.safe_load(render(result, "max-decode", "llama-swap", SOURCE))
    from_swap, _ = _split_threads(_swap_argv(next(iter(swap["models"].values()))["cmd"])[5:])
    for flags in (launch, from_ini, from_swap):
        again = parse_launch_flags(flags)
        assert (again.draft_model, again.draft_n_gpu_layers, again.draft_overrides, again.draft_cache_type_k,
                again.draft_cache_type_v, again.spec_type, again.spec_draft_n_max) == (
            config.draft_model, -2, ncmoe_rules(2), "q8_0", "q8_0", "draft-simple", 8)


def test_the_python_export_says_llama_cpp_python_loads_no_draft() -> None:
    result, _ = _with_draft()
    doc = json.loads(render(result, "max-decode", "python", SOURCE))
    assert doc["not_in_kwargs"][-1] == (
        "-md /home/me/models/draft.gguf: llama-cpp-python loads no draft model (its draft_model is a prompt-lookup "
        "object); the measured memory counted the draft's weights, KV cache and compute")


def test_every_format_pins_the_projector_and_the_python_export_says_where_it_goes() -> None:
    config = parse_launch_flags(["-c", "4096", "-fa", "on", "-ngl", "all", "-np", "1", "-mm",
                                 "/home/me/models/mmproj.gguf", "--no-mmproj-offload"])
    result = _result()
    result["pareto"][0]["flags"] = _flags(config, 2, 2)
    argv = shlex.split(render(result, "max-decode", "server", SOURCE))
    assert argv[argv.index("-mm"):argv.index("-mm") + 3] == ["-mm", "/home/me/models/mmproj.gguf",
                                                            "--no-mmproj-offload"]
    section = llama_cpp_ini(render(result, "max-decode", "preset-ini", SOURCE))["fitter-demo-gpt-oss"]
    assert (section["mmproj"], section["mmproj-offload"]) == ("/home/me/models/mmproj.gguf", "false")
    from_ini, _ = _split_threads(_preset_argv(section)[2:])
    again = parse_launch_flags(from_ini)
    assert (again.mmproj, again.mmproj_device) == ("/home/me/models/mmproj.gguf", "none")
    doc = json.loads(render(result, "max-decode", "python", SOURCE))
    assert doc["not_in_kwargs"][-1] == (
        "--mmproj /home/me/models/mmproj.gguf: a chat handler's clip_model_path in llama-cpp-python "
        "(llama_chat_format), not a Llama keyword; the measured memory counted the projector's weights and compute")
