"""`fitter grid` and what it records: every config of a search space measured K times into a landscape file
(`landscape`), recorded by `record` (the points: `points`), and played back as a trial runner (`replay`,
`--backend replay`)."""

from __future__ import annotations

from fitter.grid.landscape import Landscape, best_within_noise, load_landscape, param_key, write_landscape
from fitter.grid.replay import NotRecorded, ReplayRunner

__all__ = ["Landscape", "NotRecorded", "ReplayRunner", "best_within_noise", "load_landscape", "param_key",
           "write_landscape"]
