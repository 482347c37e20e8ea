"""fitter.workload: llama-bench's depth lists, workload files (shipped and the user's), how depths weigh, and the
config that serves a workload's streams."""

from __future__ import annotations

from pathlib import Path

import pytest

from fitter.flags import parse_launch_flags
from fitter.flags.pin import pin
from fitter.workload import (
    Workload,
    WorkloadError,
    combined_rate,
    context_choices,
    context_problem,
    load_workload,
    parse_depths,
    parse_workload,
    serving_config,
    shipped_workload_names,
)


@pytest.mark.parametrize(("text", "depths"), [
    ("0", (0,)),
    ("0,32768", (0, 32768)),
    ("0-32768+8192", (0, 8192, 16384, 24576, 32768)),
    ("512-8192*2", (512, 1024, 2048, 4096, 8192)),
    ("0,4096-8192+4096", (0, 4096, 8192)),
])
def test_depth_lists_read_as_llama_bench_reads_them(text: str, depths: tuple[int, ...]) -> None:
    assert parse_depths(text) == depths


@pytest.mark.parametrize(("text", "why"), [
    ("0,,4096", "'' is not N or first-last[+|*step]"),
    ("-1", "'-1' is not N"),
    ("0-8192*1", "the range '0-8192*1' does not grow"),
    ("0-4096*2", "the range '0-4096*2' does not grow"),  # 0 × 2 stays 0: llama-bench throws "invalid range"
    ("0,0", "a depth is given twice"),
])
def test_a_bad_depth_list_says_which_part(text: str, why: str) -> None:
    with pytest.raises(WorkloadError, match=r"^-d ") as e:
        parse_depths(text)
    assert why in str(e.value)


def test_a_workloads_speed_is_its_tokens_over_their_time() -> None:
    # 3 parts at 100 t/s and 1 part at 50 t/s: 4 parts of tokens in 3/100 + 1/50 = 0.05 of time
    assert combined_rate([100.0, 50.0], [3.0, 1.0]) == pytest.approx(80.0)
    assert combined_rate([100.0, 50.0], [1.0, 1.0]) == pytest.approx(200 / 3)


def test_the_shipped_workloads_load_by_name() -> None:
    assert shipped_workload_names() == ("long-chat", "team-server")
    chat = load_workload("long-chat")
    assert (chat.depths, chat.weights, chat.concurrency, chat.source) == (
        (0, 16384, 32768, 65536), (1.0, 2.0, 3.0, 2.0), 1, "shipped:long-chat")
    team = load_workload("team-server")
    assert (team.n_prompt, team.n_gen, team.depths, team.concurrency) == (512, 128, (0, 4096), 4)
    assert team.label() == "-p 512 -n 128 -d 0,4096 ×4 streams"


def test_a_users_file_with_a_depth_range_and_defaults(tmp_path: Path) -> None:
    f = tmp_path / "deep.toml"
    f.write_text('depths = "0-16384+8192"\nweights = [1, 1, 2]\n')
    w = load_workload(str(f))
    assert w == Workload(depths=(0, 8192, 16384), weights=(1.0, 1.0, 2.0), source=str(f))
    assert w.share(16384) == 0.5 and w.tokens_per_stream() == 16384 + 512


@pytest.mark.parametrize(("text", "message"), [
    ("depth = [0]\n", "unknown key 'depth' (a workload has concurrency, depths, description, gen, image_tokens, "
                     "images, min_ctx, prompt, prompts, weights)"),
    ("depths = [0, 4096]\nweights = [1]\n", "weights [1.0] must be one positive number per depth (2)"),
    ("weights = [0]\n", "weights [0.0] must be one positive number per depth (1)"),
    ("prompt = 0\ngen = 0\n", "prompt and gen are both 0: nothing to measure"),
    ("concurrency = 0\n", "concurrency 0 must be 1..256 streams"),
    ("prompt = 1.5\n", "prompt = 1.5 must be a whole number"),
    ("depths = [true]\n", "depths = [True] must be a list of whole numbers"),
    ("depths = [0, 0]\n", "depths [0, 0] must be distinct counts"),
    ("prompt = \n", "not TOML"),
])
def test_a_bad_workload_file_is_one_line_naming_the_file_and_the_rule(tmp_path: Path, text: str,
                                                                       message: str) -> None:
    f = tmp_path / "w.toml"
    f.write_text(text)
    with pytest.raises(WorkloadError) as e:
        load_workload(str(f))
    assert str(e.value).startswith(f"{f}: ") and message in str(e.value) and "\n" not in str(e.value)


def test_a_missing_workload_names_the_shipped_ones() -> None:
    with pytest.raises(WorkloadError, match=r"^--workload nope: no such file, and no shipped workload of that name "
                                            r"\(shipped: long-chat, team-server\)$"):
        load_workload("nope")


def test_a_workload_round_trips_through_its_record() -> None:
    w = load_workload("team-server")
    assert Workload.from_json(w.to_json(), "pareto.json") == w


def test_streams_get_a_slot_each() -> None:
    w = Workload(concurrency=3)
    served = serving_config(w, parse_launch_flags(["-c", "8192"]))
    assert pin(served, given=True) == ["-c", "8192", "-np", "3"] and served.n_seq_max == 3 and not served.unified
    given = parse_launch_flags(["-np", "4"])
    assert serving_config(w, given) is given  # as many slots or more: the user's
    with pytest.raises(WorkloadError, match=r"^flags: concurrency 3 needs a slot per stream, but -np 2 serves 2$"):
        serving_config(w, parse_launch_flags(["-np", "2"]))
    one = parse_launch_flags([])
    assert serving_config(Workload(), one) is one


def test_the_context_must_hold_the_deepest_test_in_every_stream() -> None:
    deep = Workload(depths=(0, 8192))
    assert context_problem(deep, parse_launch_flags(["-c", "8192"]), 131072) == (
        "flags: depth 8192 + max(prompt 512, gen 128) = 8704 cells, but a slot of -c 8192 holds 8192; give a larger -c")
    assert context_problem(deep, parse_launch_flags(["-c", "8960"]), 131072) is None
    # -np auto: 4 slots share one unified cache, so 2 streams need twice the cells
    two = Workload(depths=(0, 4096), concurrency=2)
    assert context_problem(two, parse_launch_flags(["-c", "8192"]), 131072) == (
        "flags: 2 streams of 4608 cells share the unified KV cache of 8192 cells; give a larger -c")
    # an explicit -np 2: two streams of 4096 cells each
    assert context_problem(two, parse_launch_flags(["-c", "8192", "-np", "2"]), 131072) == (
        "flags: depth 4096 + max(prompt 512, gen 128) = 4608 cells, but a slot of -c 8192 holds 4096; give a larger "
        "-c")


# -- the context as a trade (--min-ctx) ---------------------------------------------------------------------------


@pytest.mark.parametrize(("min_ctx", "train", "choices"), [
    (32768, 131072, (32768, 65536, 98304, 131072)),  # each extra 32k, as the table reads it
    (4096, 131072, (4096, 8192, 16384, 32768, 65536, 131072)),  # past 8 multiples: doublings
    (5000, 16384, (5000, 10000, 15000, 16384)),  # the training context last, a multiple or not
    (3000, 131072, (3000, 6000, 12000, 24000, 48000, 96000, 131072)),
    (8192, 8192, (8192,)),
])
def test_the_contexts_min_ctx_searches(min_ctx: int, train: int, choices: tuple[int, ...]) -> None:
    assert context_choices(min_ctx, train) == choices


def test_min_ctx_is_recorded_and_labelled_only_when_given() -> None:
    w = Workload(n_prompt=256, n_gen=32, min_ctx=32768)
    assert w.to_json()["min_ctx"] == 32768 and "min_ctx" not in Workload().to_json()
    assert w.label() == "-p 256 -n 32 -d 0, -c >= 32768"
    assert Workload.from_json(w.to_json(), "pareto.json") == w
    assert parse_workload({"min_ctx": 65536}, "w.toml").min_ctx == 65536
    with pytest.raises(WorkloadError, match=r"^w.toml: min_ctx = '64k' must be a whole number$"):
        parse_workload({"min_ctx": "64k"}, "w.toml")
    with pytest.raises(WorkloadError, match=r"^w.toml: min_ctx -1 must be a context of 1\.\.2147483647 cells \(or 0: "
                                            r"-c as given\)$"):
        parse_workload({"min_ctx": -1}, "w.toml")
