"""fitter.search.screen: the drift guard screens with the larger of fitter's estimate and the build's projection."""

from __future__ import annotations

from fitter.search.screen import Budgets, Screen
from fitter.units import MIB


def test_the_larger_of_the_two_decides_per_device() -> None:
    budgets = Budgets({"CUDA0": 100 * MIB, "CUDA1": 100 * MIB}, None, {"CUDA1": 10 * MIB})
    ours = Screen(None, {"vram:CUDA0": -20.0, "vram:CUDA1": -5.0})
    projection = {"CUDA0": {"model": 60 * MIB, "kv": 30 * MIB, "compute": 20 * MIB},  # 110: over by 10
                  "CUDA1": {"model": 50 * MIB, "kv": 10 * MIB, "compute": 10 * MIB},  # 70 + 10 margin: under
                  "CPU": {"model": 5 * MIB, "kv": 0, "compute": 1 * MIB}}
    guarded = ours.with_projection(projection, budgets)
    assert guarded.constraints == {"vram:CUDA0": 10.0, "vram:CUDA1": -5.0}
    assert not guarded.feasible and guarded.projection == projection
    assert guarded.reason() == "predicted over budget: vram:CUDA0 by 10.0 MiB"
