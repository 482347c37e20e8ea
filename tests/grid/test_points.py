"""fitter.grid.points: the exhaustive grid of a space on a simulated machine, serial and split between processes."""

from __future__ import annotations

import multiprocessing
import threading
from dataclasses import replace
from typing import Any

import pytest

from fitter.gguf.model_spec import load_model_spec
from fitter.grid.points import grid, sim_request
from fitter.sim import load_machine
from tests.models import model_file


def test_the_grid_split_between_processes_starts_them_fresh_even_with_threads_running(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A forked child inherits the parent's locks in whatever state its other threads held them (a heartbeat, the
    # NVML sampler, a logging handler), and one full-suite run hung in grid(processes=2): the pool must not fork.
    asked: list[str | None] = []
    real = multiprocessing.get_context

    def get_context(method: str | None = None) -> Any:
        asked.append(method)
        return real(method)

    monkeypatch.setattr(multiprocessing, "get_context", get_context)
    machine = load_machine("gpu-8gb")
    path = str(model_file("gpt-oss-20b", sparse=True))
    req = sim_request(machine, load_model_spec(path), path, fixed_flags=("-fa", "on", "-c", "8192"))
    small = {k: d for k, d in req.distributions.items() if k in ("n-cpu-moe", "ubatch-size")}
    req = replace(req, distributions=small)  # 25 × 3 configs: seconds, not minutes
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait, daemon=True)  # a thread alive while the pool starts
    busy.start()
    try:
        split = grid(req, machine, processes=2)
    finally:
        stop.set()
    assert asked and all(m in ("spawn", "forkserver") for m in asked), asked
    assert split == grid(req, machine, processes=1)  # the same points, in the same order, with the same speeds
