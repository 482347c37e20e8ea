"""Measuring a configuration: what a measurement is (`types`), every llama.cpp log parser (`logs`), the trial
runners (fitter's worker over llama-cpp-python, the user's llama-server and llama-bench) behind one protocol, the
emulated GPU, llama.cpp's own fit and tools, and the child processes they run in."""

from __future__ import annotations

from fitter.measure.runners import LlamaBenchRunner, ServerRunner, TrialRunner, WorkerRunner, with_rpc
from fitter.measure.types import BenchSpec, LoggedBuffer, Measurement, OomInfo, SpeedStats, TrialResult, WorkerError

__all__ = ["BenchSpec", "LlamaBenchRunner", "LoggedBuffer", "Measurement", "OomInfo", "ServerRunner", "SpeedStats",
           "TrialResult", "TrialRunner", "WorkerError", "WorkerRunner", "with_rpc"]
