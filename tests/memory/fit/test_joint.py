"""Several models loaded together: the set within every device's budget (each model's process with its own
overhead), each model at the same share of its room, the router's --models-max taken as the worst case."""

from __future__ import annotations

from typing import Any

import pytest

from fitter.errors import FitterError
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import RPC, Device
from fitter.memory.backends.overhead import measured_overhead
from fitter.memory.fit.fit import fit
from fitter.memory.fit.joint import SetModel, joint_fit, together
from tests.models import model_file

MIB = 1024 * 1024
BASE = parse_launch_flags(["-c", "4096", "-np", "1"])


@pytest.fixture(scope="module")
def spec() -> Any:
    return load_model_spec(str(model_file("demo")))


def _device(mib: int, overhead_mib: int = 0) -> Device:
    over = measured_overhead(overhead_mib * MIB, "test") if overhead_mib else None
    return Device("RPC0[127.0.0.1:50052]", RPC, mib * MIB, mib * MIB, over)


def _total(result: Any, device: str) -> int:
    return int(result.plan.totals()[device].total)


def test_two_models_share_the_device_and_each_gets_the_same_share(spec: Any) -> None:
    dev = _device(96)
    alone = fit(spec, BASE, (dev,), (4,))
    assert alone.fits
    set_ = [SetModel("a", "a.gguf", spec, BASE), SetModel("b", "b.gguf", spec, BASE)]
    joint = joint_fit(set_, (dev,), (4,))
    assert joint.fits and 0.0 < joint.share < 1.0  # both alone would not fit together
    a, b = (_total(r, dev.name) for r in joint.results)
    assert a == b  # the same model at the same share: the same placement
    assert joint.worst[dev.name] == a + b <= joint.budgets[dev.name] == (96 - 4) * MIB
    assert a < _total(alone, dev.name)
    assert joint.results[0].expert_layers_on_device <= alone.expert_layers_on_device


def test_models_max_one_lets_each_model_have_the_device_as_if_alone(spec: Any) -> None:
    dev = _device(96)
    alone = fit(spec, BASE, (dev,), (4,))
    joint = joint_fit([SetModel("a", "a.gguf", spec, BASE), SetModel("b", "b.gguf", spec, BASE)], (dev,), (4,),
                      models_max=1)
    assert joint.fits and joint.share == 1.0
    assert [_total(r, dev.name) for r in joint.results] == [_total(alone, dev.name)] * 2
    assert joint.worst[dev.name] == _total(alone, dev.name)


def test_each_models_process_brings_its_own_overhead() -> None:
    dev = _device(1000, overhead_mib=300)
    assert together([{dev.name: 10 * MIB}, {dev.name: 20 * MIB}, {dev.name: 5 * MIB}], (dev,), 2) == {
        dev.name: (20 + 300 + 10 + 300) * MIB}  # the two largest, each with its context


def test_a_set_that_cannot_fit_even_at_its_lightest_says_by_how_much(spec: Any) -> None:
    dev = _device(24, overhead_mib=10)  # three processes' contexts alone are 30 MiB of the 20 MiB budget
    joint = joint_fit([SetModel(n, f"{n}.gguf", spec, BASE) for n in "abc"], (dev,), (4,))
    assert not joint.fits and joint.shortfall == 10 * MIB
    assert joint.worst[dev.name] == 30 * MIB and joint.budgets[dev.name] == 20 * MIB
    with pytest.raises(FitterError, match=r"^--models-max -1: give 0 \(every model at once\) or more$"):
        joint_fit([SetModel("a", "a.gguf", spec, BASE)], (dev,), (4,), models_max=-1)
