"""fitter.flags.pin: the llama-server line `fitter fit` prints reads back as the same words in a POSIX shell; a
config written as given reads back as the same config, through every reader (parse, the worker's request, the
llama-server runner, a trial's recorded flags)."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

import pytest

from fitter.flags import parse_launch_flags, pin, server_command
from fitter.flags.consumers import server_flags
from fitter.flags.draft import without_draft
from fitter.measure.capi import config_from_json, config_to_json
from tests.hostile import HOSTILE_PATHS


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_the_server_command_quotes_any_model_path(path: str) -> None:
    flags = ["-c", "4096", "-ot", r"blk\.(0|1)\.ffn_.*_exps=CPU", "-fit", "off"]
    assert shlex.split(server_command(path, flags)) == ["llama-server", "-m", path, *flags]


# -- one writer: a config's flags as given read back as the same config, through every reader ---------------------

GIVEN_CASES = [
    # (flags as a user types them, --for, what fitter writes back: llama-server's spellings and order)
    ([], "llama-server", []),
    (["--ctx-size=8192", "-ngl", "auto", "-np", "2"], "llama-server", ["-c", "8192", "-np", "2", "-ngl", "auto"]),
    (["-ot", "exps=CPU", "-ncmoe", "2", "--n-gpu-layers=all", "-fit", "on"], "llama-server",
     ["-ngl", "all", "-ot", "exps=CPU", "-ncmoe", "2", "-fit", "on"]),
    (["-ncmoe", "0", "-no-kvu", "--swa-full", "--no-mmap"], "llama-cli",
     ["--no-kv-unified", "-ncmoe", "0", "--swa-full", "-lm", "none"]),
    (["-c", "2048", "-fa", "enabled", "-ts", "0.5/0.25", "-sm", "row", "-mg", "1"], "llama-cpp-python",
     ["-c", "2048", "-fa", "on", "-ts", "0.5,0.25", "-sm", "row", "-mg", "1"]),
    (["-md", "/m/d.gguf", "--spec-draft-ngl", "3", "-cmoed", "--spec-type", "draft-simple",
      "--spec-draft-n-max", "6"], "llama-server",
     ["-md", "/m/d.gguf", "-ngld", "3", "-otd", r"\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU", "--spec-type",
      "draft-simple", "--spec-draft-n-max", "6"]),
]


@pytest.mark.parametrize(("flags", "program", "written"), GIVEN_CASES)
def test_a_config_is_written_as_given_and_reads_back_unchanged(flags: list[str], program: str,
                                                               written: list[str]) -> None:
    config = parse_launch_flags(flags, program)
    assert pin(config, given=True) == written
    again = parse_launch_flags(written, program)
    assert (again, again.given) == (config, config.given)


@pytest.mark.parametrize(("flags", "program", "written"), GIVEN_CASES)
def test_the_worker_request_carries_the_config_and_what_was_given(flags: list[str], program: str,
                                                                 written: list[str]) -> None:
    config = parse_launch_flags(flags, program)
    again = config_from_json(json.loads(json.dumps(config_to_json(config))))
    assert (again, again.given) == (config, config.given)


def test_llama_server_runs_the_flags_as_given_and_llama_cli_its_one_slot() -> None:
    config = parse_launch_flags(["-c", "4096", "-ngl", "auto"], "llama-cli")
    assert server_flags(config) == ["-c", "4096", "-ngl", "auto", "-np", "1"]
    assert parse_launch_flags(server_flags(config)) == replace(config, consumer="llama-server")


def test_a_change_made_as_a_flag_is_written_and_a_derived_one_is_not() -> None:
    config = parse_launch_flags(["-c", "4096"]).with_given(parallel=3, rpc=("h:1",))
    assert pin(config, given=True) == ["-c", "4096", "-np", "3", "--rpc", "h:1"]
    assert pin(without_draft(parse_launch_flags(["-md", "d.gguf", "-ngld", "2", "-c", "512"])), given=True) == [
        "-c", "512"]


def test_a_candidate_records_the_flags_its_config_reads_back_from() -> None:
    from fitter.flags import parse_flags
    from fitter.gguf.model_spec import load_model_spec
    from fitter.grid.points import sim_request
    from fitter.search.request import candidate
    from fitter.sim import load_machine
    from tests.models import model_file

    spec = load_model_spec(str(model_file("gpt-oss-20b", sparse=True)))
    req = sim_request(load_machine("gpu-8gb"), spec, spec.path)
    req = replace(req, base=parse_launch_flags(["--ctx-size=8192", "-ot", "attn=CPU"]))
    cand = candidate(req, {"n-cpu-moe": 5, "ubatch-size": 1024, "threads": 4})
    assert cand.flags == ("-c", "8192", "-ub", "1024", "-ngl", "all", "-ot", "attn=CPU", "-ncmoe", "5", "-t", "4",
                          "-tb", "4")
    config, process = parse_flags(cand.flags)
    assert (config, config.given, process.threads) == (cand.config, cand.config.given, 4)


@pytest.mark.parametrize(("flags", "program", "written"), GIVEN_CASES)
def test_pinned_flags_read_back_as_the_config_they_pin(flags: list[str], program: str, written: list[str]) -> None:
    # pinned, every setting is written: read back, the config resolves to the same context, and pinning it again
    # writes the same list (an export's flags are a fixed point of the one writer)
    from fitter.flags import resolve_context

    config = parse_launch_flags(flags, program)
    pinned = pin(config)
    again = parse_launch_flags(pinned, program)
    assert resolve_context(again, 4096) == resolve_context(config, 4096)
    assert pin(again) == pinned
