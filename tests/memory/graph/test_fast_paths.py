"""The planner's speed-ups change no answer: built graphs reused across placements, each -ot pattern's matches kept per
model, and fit's rejection of placements whose model and KV buffers alone exceed a budget, each checked against the
path without it."""

from __future__ import annotations

import random

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import ModelSpec, load_model_spec
from fitter.memory.backends.devices import CUDA, RPC, Device
from fitter.memory.fit.fit import FitResult, fit
from fitter.memory.graph import graph_replay as replay
from fitter.memory.graph.builder import GraphParams
from fitter.memory.plan import estimator
from fitter.memory.plan.estimator import MemoryPlan, estimate
from tests.models import model_file

MIB = 1024 * 1024
MODELS = ("gpt-oss-tiny", "qwen3moe-tiny", "qwen2moe-tiny", "mixtral-tiny", "qwen3-tiny", "deepseek2-tiny", "demo")
FLAGS = (
    ["-c", "4096"],
    ["-c", "4096", "-fa", "off"],
    ["-c", "2048", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"],
    ["-c", "4096", "-ngl", "1"],
    ["-c", "4096", "-ncmoe", "1"],
    ["-c", "4096", "-nkvo"],
    ["-c", "4096", "--no-op-offload"],
    ["-c", "4096", "-ub", "16", "-np", "1"],  # a batch under 32: norms pinned to their layer's device
    ["-c", "1024", "-np", "2"],
)
DEVICES = (
    (),
    (Device("CUDA0", CUDA, 8192 * MIB, 8192 * MIB),),
    (Device("CUDA0", CUDA, 8192 * MIB, 8192 * MIB), Device("CUDA1", CUDA, 4096 * MIB, 4096 * MIB)),
    (Device("RPC0[127.0.0.1:50052]", RPC, 64 * MIB, 64 * MIB),),
)


def _spec(shape: str) -> ModelSpec:
    return load_model_spec(str(model_file(shape)))


class _Forgetful(dict):  # type: ignore[type-arg]
    def __setitem__(self, key: object, value: object) -> None:
        pass


def _uncached(monkeypatch: pytest.MonkeyPatch) -> None:
    """No graph kept between replays, no override's matches remembered."""
    monkeypatch.setattr(replay, "_GRAPHS", _Forgetful())
    monkeypatch.setattr(estimator, "_RULE_HITS", _Forgetful())


def test_reused_graphs_give_the_plans_fresh_graphs_give(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = [(shape, flags, devices) for shape in MODELS for flags in FLAGS for devices in DEVICES]
    random.Random(14).shuffle(cases)  # so each cached graph was last bound to some other placement
    specs = {shape: _spec(shape) for shape in MODELS}

    def plans() -> list[MemoryPlan | str]:
        out: list[MemoryPlan | str] = []
        for shape, flags, devices in cases:
            try:
                out.append(estimate(specs[shape], parse_launch_flags(flags), devices))
            except Exception as e:  # the same error either way
                out.append(f"{type(e).__name__}: {e}")
        return out

    replay.clear_graph_cache()
    cached = plans()
    cached_again = plans()
    _uncached(monkeypatch)
    fresh = plans()
    assert cached == fresh and cached_again == fresh
    assert [repr(p) for p in cached] == [repr(p) for p in fresh]


def _fit_cases() -> list[tuple[str, list[str], tuple[Device, ...], int]]:
    def cuda(mib: int) -> tuple[Device, ...]:
        return (Device("CUDA0", CUDA, mib * MIB, mib * MIB),)

    def rpc(mib: int) -> tuple[Device, ...]:
        return (Device("RPC0[127.0.0.1:50052]", RPC, mib * MIB, mib * MIB),)

    return [
        ("demo", ["-c", "4096"], rpc(80), 4),
        ("demo", ["-c", "4096"], cuda(60), 4),
        ("demo", ["-c", "4096"], cuda(300), 4),
        ("gpt-oss-tiny", ["-c", "2048", "-np", "1"], cuda(3), 0),
        ("gpt-oss-tiny", ["-c", "0", "-np", "1"], cuda(5), 0),
        ("qwen3moe-tiny", ["-c", "4096"], cuda(6), 0),
        ("qwen3moe-tiny", ["-c", "4096", "-fa", "on"], (*cuda(4), Device("CUDA1", CUDA, 2 * MIB, 2 * MIB)), 0),
        ("deepseek2-tiny", ["-c", "2048"], cuda(2), 0),
        ("qwen3-tiny", ["-c", "2048", "-np", "1"], cuda(4), 0),
        ("mixtral-tiny", ["-c", "2048"], cuda(1), 0),  # nothing fits: suggestions
    ]


def _fits(monkeypatch: pytest.MonkeyPatch | None) -> list[FitResult]:
    if monkeypatch is not None:  # every candidate estimated in full: nothing rejected before its compute buffers
        monkeypatch.setattr(estimator.Placed, "device_bytes", lambda self: {})
    return [fit(_spec(shape), parse_launch_flags(flags), devices, (target,))
            for shape, flags, devices, target in _fit_cases()]


def test_fit_chooses_what_estimating_every_candidate_in_full_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _fits(None)
    _uncached(monkeypatch)
    full = _fits(monkeypatch)
    assert [repr(r) for r in fast] == [repr(r) for r in full]
    assert any(r.fits for r in fast) and any(not r.fits for r in fast)


def test_a_graph_in_use_is_not_handed_out_twice() -> None:
    """A cached graph is taken out of the cache while a replay uses it, so a nested or concurrent replay of the same
    shape builds its own instead of rebinding the one in use."""
    spec = _spec("gpt-oss-tiny")
    plan = estimate(spec, parse_launch_flags(["-c", "4096"]), DEVICES[1])
    params = GraphParams(512, 4, (4096, 256), 1, True, "f16", "f16")
    with replay._graph(spec, params) as outer, replay._graph(spec, params) as inner:
        assert inner is not outer
    assert estimate(spec, parse_launch_flags(["-c", "4096"]), DEVICES[1]) == plan


def test_the_cpu_profile_from_proc_cpuinfo_alone_is_the_snapshots() -> None:
    from fitter.machine.cpu import cpu_profile_here
    from fitter.machine.snapshot import take_snapshot

    assert cpu_profile_here() == take_snapshot().cpu_profile
