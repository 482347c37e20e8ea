"""`fitter bench` as a library call: one configuration measured once by a runner, beside fitter's estimate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fitter.errors import LaunchConfigError
from fitter.flags import LaunchConfig
from fitter.flags.consumers import server_flags
from fitter.flags.draft import measuring_problem
from fitter.gguf.model_spec import ModelSpec
from fitter.measure.bench_table import bench_json
from fitter.measure.runners import TrialRunner, with_rpc
from fitter.measure.types import BenchSpec
from fitter.memory.backends.devices import CpuProfile, Device
from fitter.memory.plan.estimator import estimate
from fitter.workload import measure_problem

# the build's projector for a model fitter guesses a kind for, given the runner's RPC endpoints and devices (None where
# fitter guesses nothing or the user takes the guess): fitter.cli.common.build_projector
ProjectorFor = Callable[[tuple[str, ...], tuple[Device, ...]], Any]


def bench(model: str, spec: ModelSpec, config: LaunchConfig, bench_spec: BenchSpec, runner: TrialRunner,
          cpu: CpuProfile, devices: tuple[Device, ...] = (), timeout: float | None = None,
          projector_for: ProjectorFor | None = None) -> dict[str, Any]:
    """Measure `config` with `runner` (started and stopped here) in the `fitter bench --json` shape: the measurement,
    every buffer llama.cpp logged beside its estimate, the devices' peaks, the estimate's warnings. The estimate plans
    for the runner's own devices (an emulated or simulated GPU), else for `devices` (the config's --rpc servers, this
    machine's GPUs); what fitter guesses for the model comes from the build's projection of those devices once the
    runner has started them (`projector_for`), as `fitter estimate` takes it; a config llama.cpp would refuse stops
    here (LaunchConfigError) before anything is measured."""
    if runner.backend == "llama-server":
        server_flags(config)  # a program llama-server cannot stand in for stops here, before anything starts
    workload = getattr(runner, "workload", None)  # a WorkloadRunner's: its prompts are sent as text
    problem = (measure_problem(workload, config, runner.backend) if workload is not None
               else measuring_problem(config, runner.backend))
    if problem is not None:
        raise LaunchConfigError(problem)
    with runner:
        config = with_rpc(config, runner.rpc)
        plan = estimate(spec, config, runner.devices() or devices, runner.cpu_profile() or cpu)
        projector = projector_for(runner.rpc, plan.devices) if projector_for is not None else None
        if projector is not None:  # the emulated GPU runs now: the build can see it
            plan = projector.plan(plan)
        result = runner.run(model, config, bench_spec, timeout, plan)
    out = bench_json(result.measurement, runner.backend, plan if runner.deployed_context else None,
                     emulated=runner.emulated, peak_vram=result.peak_vram)
    out["warnings"] = list(plan.warnings)
    if projector is not None:
        out["projection"] = {"source": projector.source, "summary": projector.summary()}
    kind = getattr(runner, "emulated_kind", "rpc")
    if runner.emulated and kind != "rpc":
        out["emulated_gpu"] = kind  # the CUDA-shaped or the Vulkan emulated GPU
    return {"for": config.consumer, **out}
