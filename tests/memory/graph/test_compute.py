"""fitter.memory.graph.compute: the worst-case graph's shape as sched_reserve and graph_reserve give it."""

from __future__ import annotations

from typing import Any

import pytest

from fitter.flags import parse_launch_flags
from fitter.flags.config import resolve_context
from fitter.memory.graph.compute import graph_shape
from tests.memory.plan.test_golden import GOLDENS, estimated, logged


def test_the_tokens_are_a_multiple_of_the_sequences() -> None:
    # graph_reserve rounds n_tokens up to a multiple of n_seqs (n_seq_max); the outputs are of the unrounded count
    def shape(*flags: str) -> tuple[int, int]:
        s = graph_shape(resolve_context(parse_launch_flags(list(flags)), 4096), (4096, 0))
        return s.n_tokens, s.n_outputs

    assert shape("-c", "4608", "-np", "3") == (513, 3)
    assert shape("-c", "4096", "-np", "2") == (512, 2)


_NP3 = [pytest.param(c, id=c["id"]) for c in GOLDENS["cpu"]["cases"]
        if c["outcome"] == "ok" and "-np 3" in " ".join(c["flags"])]


@pytest.mark.parametrize("case", _NP3)
def test_three_sequences_reserve_what_llama_cpp_reserves(case: dict[str, Any]) -> None:
    # 513 tokens of 3 sequences of 171: every graph fitter rebuilds is the logged compute buffer to the 0.01 MiB
    est, gold = estimated("cpu", case), logged(case)
    assert [round(x, 2) for x in est[("CPU", "compute")]] == gold[("CPU", "compute")]
