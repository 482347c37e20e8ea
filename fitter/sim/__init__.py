"""Simulated machines: physical profiles (`profile`), a performance model of llama.cpp driven by the estimator's
memory plan (`physics`), a `TrialRunner` on them (`runner`), for tuning without the hardware."""

from __future__ import annotations

from fitter.sim.physics import out_of_memory, speeds
from fitter.sim.profile import MACHINES_DIR, Machine, load_machine, machines_table, shipped_machines
from fitter.sim.runner import SimRunner

__all__ = ["MACHINES_DIR", "Machine", "SimRunner", "load_machine", "machines_table", "out_of_memory",
           "shipped_machines", "speeds"]
