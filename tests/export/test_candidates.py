"""fitter.export.candidates: the policy's order, the choice against fake free memory (exact reasons), and the re-plans
of the pick on the demo model (the estimator's bytes, which tests/serve checks against what llama.cpp allocates)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fitter.export.candidates import LaunchLine, Room, choose, policy_order, rooms
from fitter.memory.backends.devices import RPC, Device
from fitter.results.pareto import ParetoDoc
from fitter.serve.choice import plan_serve
from fitter.units import MIB
from tests.models import model_file

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "demo-result" / "pareto.json"
DEV = "RPC0[127.0.0.1:50052]"


def demo_result(tmp_path: Path) -> ParetoDoc:
    """examples/demo-result (a real tune of the demo model on a 96 MiB emulated GPU, fit target 16 MiB), its model
    at this session's copy of the demo model (the same header identity)."""
    data = json.loads(EXAMPLE.read_text())
    data["model"]["path"] = str(model_file("demo"))
    return ParetoDoc.from_json(data, str(tmp_path / "pareto.json"))


def _c(trial: int, need_mib: float, tg: float = 10.0, pp: float = 100.0, change: str = "") -> LaunchLine:
    return LaunchLine(trial, ("-c", "4096"), {"CUDA0": int(need_mib * MIB)}, {"tg": tg, "pp": pp}, change)


ROOM_60 = {"CUDA0": Room(60 * MIB, 0, 16)}  # 60 MiB free, 16 MiB fit target: 44 MiB to plan with


def test_the_pick_is_served_when_it_fits() -> None:
    choice = choose("balanced", [_c(6, 40.0)], iter(()), ROOM_60)
    assert choice.candidate is not None and choice.candidate.trial == 6
    assert choice.reason == ("balanced pick (trial 6) needs 40.00 MiB on CUDA0, 60.00 MiB free less the 16 MiB fit "
                             "target: serving it")


def test_the_fastest_next_config_that_fits_is_served_with_its_cost() -> None:
    choice = choose("balanced", [_c(6, 50.0), _c(9, 45.0, tg=9.0), _c(3, 30.0, tg=7.0, pp=98.0)], iter(()), ROOM_60)
    assert choice.candidate is not None and choice.candidate.trial == 3
    assert choice.reason == ("balanced needs 50.00 MiB on CUDA0, 60.00 MiB free less the 16 MiB fit target: serving "
                             "trial 3 (30.00 MiB on CUDA0), decode 0.70× and prefill 0.98× of it")


def test_re_plans_are_read_only_until_one_fits() -> None:
    read: list[int] = []

    def replans() -> Iterator[LaunchLine]:
        for k, need in ((5, 50.0), (6, 43.0), (7, 30.0)):
            read.append(k)
            yield _c(6, need, change=f"-ncmoe 4 → {k}")

    choice = choose("max-decode", [_c(6, 70.0), _c(3, 45.0)], replans(), ROOM_60)
    assert read == [5, 6]
    assert choice.candidate is not None and choice.candidate.change == "-ncmoe 4 → 6"
    assert choice.reason == ("max-decode needs 70.00 MiB on CUDA0, 60.00 MiB free less the 16 MiB fit target; no "
                             "measured config fits: serving trial 6 with -ncmoe 4 → 6 (unmeasured: re-planned by the "
                             "estimator) (43.00 MiB on CUDA0); its speed is not known")


def test_nothing_that_fits_starts_nothing_and_says_what_would() -> None:
    choice = choose("balanced", [_c(6, 70.0), _c(3, 47.5)], iter([_c(6, 46.0, change="-ncmoe 4 → 8")]), ROOM_60,
                    "r/pareto.json")
    assert choice.candidate is None
    assert choice.reason == ("r/pareto.json: no config fits the memory free now: balanced needs 70.00 MiB on CUDA0, "
                             "60.00 MiB free less the 16 MiB fit target; the least any config or re-plan needs is "
                             "46.00 MiB on CUDA0 (trial 6 with -ncmoe 4 → 8 (unmeasured: re-planned by the "
                             "estimator)), 2.00 MiB more than that leaves: nothing started")


def test_a_device_of_unknown_free_memory_is_not_judged() -> None:
    assert choose("balanced", [_c(6, 900.0)], iter(()), {"CUDA0": Room(None, 0, 16)}).candidate is not None


def test_rooms_take_free_memory_overhead_and_each_devices_fit_target() -> None:
    devices = (Device("CUDA0", RPC, 100 * MIB, 80 * MIB), Device("CUDA1", RPC, 50 * MIB, None))
    assert rooms(devices, (16, 8)) == {"CUDA0": Room(80 * MIB, 0, 16), "CUDA1": Room(50 * MIB, 0, 8)}
    assert rooms(devices, (16, 8))["CUDA0"].budget == 64 * MIB


def test_the_policy_order_is_its_pick_then_the_fastest_by_its_measure(tmp_path: Path) -> None:
    doc = demo_result(tmp_path)
    assert [e.trial for e in policy_order(doc, "balanced")] == [6, 9, 8, 5, 0, 7, 3]
    assert [e.trial for e in policy_order(doc, "max-prefill")] == [0, 5, 9, 7, 8, 6, 3]


@pytest.mark.parametrize(("free_mib", "min_ctx", "trial", "change", "need"), [
    (96, 4096, 6, "", 77705728),  # as tuned: the pick
    (76, 4096, 3, "", 32285184),  # 20 MiB held elsewhere: the only measured config under 60 MiB
    # none measured fits: every expert on the CPU, half the context (tests/serve: what llama.cpp allocates for it)
    (46, 1024, 6, "-ncmoe 4 → 8, -c 4096 → 2048", 26849792),
])
def test_the_demo_result_on_less_free_memory(tmp_path: Path, free_mib: int, min_ctx: int, trial: int, change: str,
                                             need: int) -> None:
    doc = demo_result(tmp_path)
    from fitter.gguf.model_spec import load_model_spec

    device = Device(DEV, RPC, 96 * MIB, free_mib * MIB)
    plan = plan_serve(doc, "balanced", load_model_spec(str(model_file("demo"))), "llama-server", "m.gguf", (device,),
                      ("127.0.0.1:50052",), ("--port", "8080"), min_ctx=min_ctx)
    c = plan.choice.candidate
    assert c is not None and (c.trial, c.change, c.need) == (trial, change, {DEV: need})
    assert plan.argv[:3] == ("llama-server", "-m", "m.gguf") and plan.argv[-2:] == ("--port", "8080")
    assert plan.argv[plan.argv.index("--rpc"):plan.argv.index("--rpc") + 2] == ("--rpc", "127.0.0.1:50052")


def test_the_demo_result_with_no_room_starts_nothing(tmp_path: Path) -> None:
    from fitter.gguf.model_spec import load_model_spec

    device = Device(DEV, RPC, 96 * MIB, 36 * MIB)
    plan = plan_serve(demo_result(tmp_path), "balanced", load_model_spec(str(model_file("demo"))), "llama-server",
                      "m.gguf", (device,), ("127.0.0.1:50052",))
    assert plan.argv == ()
    assert plan.choice.reason == (
        f"{tmp_path / 'pareto.json'}: no config fits the memory free now: balanced needs 74.11 MiB on {DEV}, 36.00 MiB "
        "free less the 16 MiB fit target; the least any config or re-plan needs is 30.79 MiB on "
        f"{DEV} (trial 3), 10.79 MiB more than that leaves: nothing started")
