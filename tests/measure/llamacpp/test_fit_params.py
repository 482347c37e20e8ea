"""llama.cpp's own --fit (llama-fit-params) as fitter runs it: argv, output parsing, baseline flags, real runs.

The real runs use the capped emulated GPU and must reproduce tests/golden/fit_reference.json (written by
scripts/llama_fit_reference.py from the same tool) for the same model, cap, target and flags.
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from fitter.flags import parse_launch_flags, pin
from fitter.flags.overrides import FFN_EXPS_REGEX
from fitter.measure.llamacpp.fit_params import (
    LlamaFit,
    LlamaFitError,
    baseline_config,
    find_llama_fit_params,
    fit_env,
    fit_flags,
    llama_fit_argv,
    parse_llama_fit,
    parse_projected_mib,
    run_llama_fit,
)
from fitter.measure.llamacpp.tools import tools_dir
from tests.conftest import BUILT_TOOLS
from tests.models import model_files

REFERENCE = json.loads((Path(__file__).resolve().parents[2] / "golden" / "fit_reference.json").read_text())
CASES = {c["id"]: c for c in REFERENCE["cases"]}
LLAMA_FIT_PARAMS = BUILT_TOOLS / "llama-fit-params"  # the tests that run it carry the `tools` marker
needs_tool = pytest.mark.tools("llama-fit-params")

CAP48 = CASES["demo/cap48/fitt0/c4096"]["llama_fit"]
CAP48_OT = (
    r"blk\.5\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU,blk\.6\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU,"
    r"blk\.7\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU,blk\.8\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU"
)
LOG_FLAGS = ["-lv", "4", "--no-log-prefix", "--no-log-timestamps", "--log-colors", "off"]

# ---------------------------------------------------------------------------------------------------------------
# Pure: the command line


def test_llama_fit_argv_translates_server_flags_the_tool_rejects() -> None:
    argv = llama_fit_argv(
        "/opt/llama-fit-params", "/m/model.gguf",
        ["-c", "0", "--kv-unified", "-ngl", "-1", "--no-mmap", "-fit", "off", "-ub", "256"],
        ("127.0.0.1:50052", "127.0.0.1:50053"), (8, 16), 2, fit_ctx_min=2048,
    )  # fmt: skip
    assert argv == [
        "/opt/llama-fit-params", "--model", "/m/model.gguf", "--rpc", "127.0.0.1:50052,127.0.0.1:50053",
        "-fitt", "8,16", "-c", "0", "-ngl", "-1", "-lm", "none", "-ub", "256", "-np", "4", "-fitc", "2048",
        "-t", "2", *LOG_FLAGS,
    ]  # fmt: skip


def test_llama_fit_argv_without_rpc_is_the_reference_scripts_command() -> None:
    # tests/golden/fit_reference.json "fit_command", minus the devices: the flags pass through unchanged.
    argv = llama_fit_argv(Path("/t/llama-fit-params"), Path("/m.gguf"), ["-c", "4096", "-np", "1"], (), (1024,), 1)
    assert argv == ["/t/llama-fit-params", "--model", "/m.gguf", "-fitt", "1024", "-c", "4096", "-np", "1", "-t", "1",
                    *LOG_FLAGS]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        # llama-server's -np default is auto (4 slots, server.cpp); the tool's is 1 and it has no "auto".
        ([], ["-np", "4"]),
        (["-np", "-1"], ["-np", "4"]),
        (["--parallel", "2"], ["--parallel", "2"]),
        (["--parallel=-1"], ["--parallel", "4"]),
        # -kvu/-no-kvu are server-only ("error: invalid argument"); the tool never unifies the KV cache.
        (["-np", "4", "-kvu"], ["-np", "4"]),
        (["-no-kvu", "-np", "2", "--no-kv-unified", "--kv-unified"], ["-np", "2"]),
        # --no-mmap is gone from this llama.cpp; -fit is ignored by the tool (it always fits).
        (["--no-mmap", "-np", "1", "--fit", "on"], ["-lm", "none", "-np", "1"]),
        # a value that looks like a flag stays a value; -cmoe takes none.
        (["-ngl", "-1", "-cmoe", "-ot", "x=CPU", "-np", "1"], ["-ngl", "-1", "-cmoe", "-ot", "x=CPU", "-np", "1"]),
    ],
)
def test_fit_flags(flags: list[str], expected: list[str]) -> None:
    assert fit_flags(flags) == expected


def test_llama_fit_argv_needs_a_target() -> None:
    with pytest.raises(LlamaFitError) as e:
        llama_fit_argv("t", "m", [], (), (), 1)
    assert str(e.value) == "fit_target_mib: at least one value (MiB to leave free per device) is needed, got ()"


def test_fit_env_drops_llama_arg_settings() -> None:
    env = fit_env({"PATH": "/bin", "LLAMA_ARG_CTX_SIZE": "8", "LLAMA_ARG_FIT": "off", "GGML_NO_BACKTRACE": "0"})
    assert env == {"PATH": "/bin", "GGML_NO_BACKTRACE": "1"}


# ---------------------------------------------------------------------------------------------------------------
# Pure: reading what the tool printed (captured output of the golden cases)


def _stdout(args: list[str]) -> str:
    """What tools/fit-params prints: `-c N -ngl N [-ts A,B] [-ot "…"]` (the -ot value in double quotes)."""
    head = " ".join(f'"{a}"' if i and args[i - 1] == "-ot" else a for i, a in enumerate(args))
    return head + "\n"


def _stderr(log: list[str]) -> str:
    """The fit's lines among the other -lv 4 output of the tool (model loading, memory tables)."""
    noise = [
        "build: 0 (unknown) with GNU 13.3.0 for Linux x86_64",
        "llama_model_loader: loaded meta data with 36 key-value pairs and 105 tensors",
        "common_memory_breakdown_print: | memory breakdown [MiB]     | total   free    self   model   context |",
        "",
    ]
    return "\n".join([*noise, *(x for line in log for x in (line, noise[2]))]) + "\n"


def test_parse_llama_fit_reads_the_args_and_the_projection() -> None:
    fit = parse_llama_fit("/t/llama-fit-params", 0, _stdout(CAP48["args"]), _stderr(CAP48["log"]))
    assert fit == LlamaFit(("-c", "4096", "-ngl", "5", "-ot", CAP48_OT), "/t/llama-fit-params", (44,),
                           tuple(CAP48["log"]))
    assert fit.log[-3:] == (
        "common_fit_params: successfully fit params to free device memory",
        "common_fit_params: fitting params to free memory took <t> seconds",
        "llama_fit_params: printing fitted CLI arguments to stdout...",
    )


@pytest.mark.parametrize(
    ("case_id", "projected"),
    [
        ("demo/cap48/fitt0/c4096", (44,)),  # "- RPC0 (…):  5 layers,     44 MiB used,      3 MiB free"
        ("demo/cap128/fitt0/c4096", (126,)),  # no changes needed: only "projected to use 126 MiB of device memory"
        ("demo/cap32+32/fitt4/c4096", (25, 7)),  # filled back to front: RPC1's line comes first
        ("demo/cap48+32/fitt4/c4096", (41, 22)),  # a partial layer overflowing into RPC1
    ],
)
def test_parse_projected_mib(case_id: str, projected: tuple[int, ...]) -> None:
    log = CASES[case_id]["llama_fit"]["log"]
    assert parse_projected_mib(log) == projected
    assert list(projected) == CASES[case_id]["llama_fit"]["projected_device_mib"]


def test_every_golden_projection_parses_as_the_reference_script_recorded_it() -> None:
    for case in REFERENCE["cases"]:
        fit = case["llama_fit"]
        assert list(parse_projected_mib(fit["log"]) or []) == fit["projected_device_mib"], case["id"]


def test_parse_llama_fit_failure_has_the_exit_status_and_the_reason() -> None:
    stderr = (
        "common_params_fit_impl: context size set by user to 4096 -> no change\n"
        "common_fit_params: failed to fit params to free device memory: n_gpu_layers already set by user to -2, "
        "abort\n"
        "llama_fit_params: failed to fit CLI arguments to free memory, exiting...\n"
    )
    with pytest.raises(LlamaFitError) as e:
        parse_llama_fit("/t/llama-fit-params", 1, "", stderr)
    assert str(e.value) == (
        "llama.cpp's fit (llama-fit-params) failed with exit status 1: n_gpu_layers already set by user to -2, abort "
        "(the fit only chooses the placement flags left unset: -ngl, -ot/-ncmoe/-cmoe, -ts)\n" + stderr.rstrip()
    )
    assert e.value.exit_status == 1
    assert e.value.log == tuple(stderr.splitlines())


@pytest.mark.parametrize(
    ("returncode", "stdout", "stderr", "message"),
    [
        (1, "", "error: invalid argument: -kvu\n",
         "llama.cpp's fit (llama-fit-params) failed with exit status 1: invalid argument: -kvu\n"
         "error: invalid argument: -kvu"),
        (0, "\n", "", "llama.cpp's fit (llama-fit-params) failed with exit status 0: it printed no arguments"),
        (-6, "", "", "llama.cpp's fit (llama-fit-params) failed with exit status -6: it logged nothing"),
        # llama.cpp lost the reason (its logger is not flushed when the tool exits)
        (1, "", "common_params_fit_impl: context size set by user to 4096 -> no change\n",
         "llama.cpp's fit (llama-fit-params) failed with exit status 1: no reason logged (llama.cpp can lose its last "
         "log lines when it exits); its last line: common_params_fit_impl: context size set by user to 4096 -> no "
         "change\ncommon_params_fit_impl: context size set by user to 4096 -> no change"),
    ],
)  # fmt: skip
def test_parse_llama_fit_other_failures(returncode: int, stdout: str, stderr: str, message: str) -> None:
    with pytest.raises(LlamaFitError) as e:
        parse_llama_fit("llama-fit-params", returncode, stdout, stderr)
    assert str(e.value) == message
    assert e.value.exit_status == returncode


# ---------------------------------------------------------------------------------------------------------------
# Pure: the baseline trial's flags


def _fit(args: list[str]) -> LlamaFit:
    return LlamaFit(tuple(args), "llama-fit-params", None, ())


@pytest.mark.parametrize(
    ("user", "expected"),
    [
        # the fit fills in placement; -b/-ub/-ctk/-ctv/-fa/-np stay as the user left them
        (["-c", "4096", "-np", "1"], ["-c", "4096", "-np", "1", "-ngl", "5", "-ot", CAP48_OT, "-fit", "off"]),
        # no -c: the context the fit resolved; -c 0 is replaced in place; the fit's inputs are dropped
        ([], ["-c", "4096", "-ngl", "5", "-ot", CAP48_OT, "-fit", "off"]),
        (["-c", "0", "-b", "512", "-fit", "on"],
         ["-c", "4096", "-b", "512", "-ngl", "5", "-ot", CAP48_OT, "-fit", "off"]),
        # what the user fixed stays (the fit only echoes it), written in llama-server's order and spellings
        (["-c", "8192", "-ngl", "3", "-ncmoe", "2", "--kv-unified"],
         ["-c", "8192", "--kv-unified", "-ngl", "3", "-ncmoe", "2", "-fit", "off"]),
        (["--ctx-size", "4096", "-cmoe"], ["-c", "4096", "-ngl", "5", "-ot", f"{FFN_EXPS_REGEX}=CPU", "-fit", "off"]),
    ],
)  # fmt: skip
def test_baseline_config(user: list[str], expected: list[str]) -> None:
    config = baseline_config(_fit(CAP48["args"]), parse_launch_flags(user))
    assert pin(config, given=True) == expected
    assert parse_launch_flags(expected) == config  # what the trial records reads back as what it runs


def test_baseline_config_with_two_devices_keeps_the_split() -> None:
    args = CASES["demo/cap48+32/fitt4/c4096"]["llama_fit"]["args"]
    flags = pin(baseline_config(_fit(args), parse_launch_flags(["-c", "4096", "-np", "1"])), given=True)
    assert flags == ["-c", "4096", "-np", "1", "-ngl", "8", "-ot", args[-1], "-ts", "7,1", "-fit", "off"]
    config = parse_launch_flags([*flags, "--rpc", "127.0.0.1:50052,127.0.0.1:50053"])
    assert config.tensor_split == (7.0, 1.0) and config.overrides[0].buft == "RPC0[127.0.0.1:50053]"


def test_baseline_config_rejects_an_unexpected_fit_answer() -> None:
    with pytest.raises(LlamaFitError) as e:
        baseline_config(_fit(["-c", "4096", "-ngl"]), parse_launch_flags([]))
    assert str(e.value) == "llama.cpp's fit printed '-c 4096 -ngl': expected pairs of -c, -ngl, -ts, -ot"


# ---------------------------------------------------------------------------------------------------------------
# Finding the tool


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_llama_fit_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    on_path = _executable(tmp_path / "bin" / "llama-fit-params")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_llama_fit_params() is None
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_llama_fit_params() == on_path
    built = _executable(tools_dir() / "llama-fit-params")  # tools_dir() is under this test's FITTER_HOME
    assert find_llama_fit_params() == built
    assert find_llama_fit_params(str(on_path)) == on_path
    plain = tmp_path / "plain"
    plain.write_text("")
    for bad in (plain, tmp_path / "missing", tmp_path):
        with pytest.raises(LlamaFitError) as e:
            find_llama_fit_params(str(bad))
        assert str(e.value) == f"llama-fit-params {str(bad)!r}: not an executable file"


def test_run_llama_fit_reports_a_tool_that_cannot_start(tmp_path: Path) -> None:
    with pytest.raises(LlamaFitError) as e:
        run_llama_fit(tmp_path / "missing", "m.gguf", [])
    assert str(e.value).startswith(f"llama.cpp's fit ({tmp_path / 'missing'}) could not start: [Errno 2]")
    assert e.value.exit_status is None


# ---------------------------------------------------------------------------------------------------------------
# The real tool on the capped emulated GPU


def _model(case: dict[str, Any]) -> Path:
    m = REFERENCE["models"][case["model"]]
    return model_files(m["shape"], m["sparse"], m["n_shards"])[0]


def _normalized(log: tuple[str, ...], endpoint: str) -> list[str]:
    # as scripts/llama_fit_reference.py writes it: canonical endpoint, no timing
    took = re.compile(r"took [0-9.]+ seconds")
    return [took.sub("took <t> seconds", line.replace(endpoint, "127.0.0.1:50052")) for line in log]


@pytest.mark.llama
@needs_tool
@pytest.mark.parametrize(
    "case_id", ["demo/cap48/fitt0/c4096", "demo/cap64/fitt8/c0-fitc2048", "gpt-oss-tiny/cap4/fitt0/c2048"]
)
def test_real_fit_matches_the_golden_case(case_id: str) -> None:
    from fitter.measure.emulator.emulated_gpu import EmulatedGpu

    case = CASES[case_id]
    assert LLAMA_FIT_PARAMS is not None
    with EmulatedGpu(cap_mib=case["cap_mib"]) as gpu:
        fit = run_llama_fit(LLAMA_FIT_PARAMS, _model(case), case["flags"], (gpu.endpoint,),
                            (case["fit_target_mib"],), fit_ctx_min=case["fit_ctx_min"])
    assert list(fit.flags) == case["llama_fit"]["args"]
    assert list(fit.projected_mib or ()) == case["llama_fit"]["projected_device_mib"]
    assert _normalized(fit.log, gpu.endpoint) == case["llama_fit"]["log"]
    assert fit.tool == str(LLAMA_FIT_PARAMS)


@pytest.mark.llama
@needs_tool
def test_real_fit_takes_server_flags_it_does_not_know() -> None:
    # -kvu, --no-mmap and -fit are translated or dropped, and no -np means llama-server's 4 slots: the same answer
    # as the golden case that gives the tool `-np 4` itself.
    from fitter.measure.emulator.emulated_gpu import EmulatedGpu

    case = CASES["demo/cap64/fitt8/c8192-np4"]
    assert LLAMA_FIT_PARAMS is not None and case["flags"] == ["-c", "8192", "-np", "4"]
    with EmulatedGpu(cap_mib=64) as gpu:
        fit = run_llama_fit(LLAMA_FIT_PARAMS, _model(case), ["-c", "8192", "--kv-unified", "--no-mmap", "-fit", "on"],
                            (gpu.endpoint,), (8,))
    assert list(fit.flags) == case["llama_fit"]["args"] and fit.projected_mib == (55,)


@pytest.mark.llama
@needs_tool
def test_real_fit_on_a_tiny_cap() -> None:
    # Far too small a device: the fit puts every layer on the CPU (-ngl 0), which always "fits"; only a placement
    # the user fixed makes it fail.
    from fitter.measure.emulator.emulated_gpu import EmulatedGpu

    assert LLAMA_FIT_PARAMS is not None
    model = _model(CASES["demo/cap48/fitt0/c4096"])
    with EmulatedGpu(cap_mib=1) as gpu:
        fit = run_llama_fit(LLAMA_FIT_PARAMS, model, ["-c", "4096", "-np", "1"], (gpu.endpoint,), (0,))
        assert fit.flags == ("-c", "4096", "-ngl", "0") and fit.projected_mib == (0,)
        with pytest.raises(LlamaFitError) as e:
            run_llama_fit(LLAMA_FIT_PARAMS, model, ["-c", "4096", "-np", "1", "-ngl", "all"], (gpu.endpoint,), (0,))
    assert e.value.exit_status == 1
    prefix = "llama.cpp's fit (llama-fit-params) failed with exit status 1: "
    why = "n_gpu_layers already set by user to -2, abort"
    if f"common_fit_params: failed to fit params to free device memory: {why}" in e.value.log:
        assert str(e.value).splitlines()[0] == prefix + why + (
            " (the fit only chooses the placement flags left unset: -ngl, -ot/-ncmoe/-cmoe, -ts)"
        )
    else:  # the tool exit(1)s without flushing llama.cpp's threaded logger: its last lines can be lost
        assert str(e.value).splitlines()[0] == prefix + (
            "no reason logged (llama.cpp can lose its last log lines when it exits); "
            f"its last line: {str(e.value).splitlines()[-1]}"
        )
    # logged before the fit loads the model's header: never among the lines lost at exit
    assert e.value.log[0] == "common_params_fit_impl: getting device memory data for initial parameters:"
