"""Simulated machines: physical profiles (`profile`), a performance model of llama.cpp driven by the estimator's
memory plan (`physics`), a `TrialRunner` on them (`runner`), for tuning without the hardware; recorded real
landscapes (`landscape`, `fitter grid`) and their replay (`replay`)."""

from __future__ import annotations

from fitter.sim.landscape import Landscape, best_within_noise, load_landscape, param_key, write_landscape
from fitter.sim.physics import out_of_memory, speeds
from fitter.sim.profile import MACHINES_DIR, Machine, load_machine, machines_table, shipped_machines
from fitter.sim.replay import NotRecorded, ReplayRunner
from fitter.sim.runner import SimRunner

__all__ = ["MACHINES_DIR", "Landscape", "Machine", "NotRecorded", "ReplayRunner", "SimRunner", "best_within_noise",
           "load_landscape", "load_machine", "machines_table", "out_of_memory", "param_key", "shipped_machines",
           "speeds", "write_landscape"]
