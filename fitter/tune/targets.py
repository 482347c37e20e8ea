"""What a tune runs on: this machine (its GPUs, `--rpc` devices, or fitter's emulated GPU), a simulated one, or a
recorded landscape replayed (`--backend replay`).

A `Target` says everything the study needs before anything starts: the runner to make, the devices the estimator
plans for (placeholders for an emulated GPU whose port is not chosen yet: same size, so the same verdicts), the
machine record that keys the results, cores and thread defaults, host RAM, the CPU's repack rules.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitter.errors import FitterError
from fitter.flags import LaunchConfig, ProcessFlags
from fitter.gguf.model_spec import ModelSpec
from fitter.machine.gpu_order import GpuOrderError
from fitter.machine.snapshot import MachineSnapshot, gpus_now
from fitter.measure.emulated_gpu import emulated_device
from fitter.measure.runner import CUDA_SHAPED_NEEDS_WORKER, ServerRunner, TrialRunner, WorkerRunner, emulated_caps
from fitter.memory.devices import CpuProfile, Device, rpc_device_name, rpc_devices
from fitter.tune.storage import machine_dir_name
from fitter.units import GIB, MIB

# The README's first command tunes the demo model; without a GPU it runs on an emulated one this big, with a fit
# target that leaves 80 MiB for the model (all of it on the device would need ~127 MiB: experts must be split).
DEMO_EMULATED_GPU_MIB = 96
DEMO_FIT_TARGET_MIB = 16
HOST_RESERVE = 512 * MIB  # RAM left to the OS and fitter itself when judging host memory
PLACEHOLDER_ENDPOINT = "127.0.0.1:50052"  # an emulated GPU's name before its server has chosen a port


def placeholder_endpoints(n: int) -> tuple[str, ...]:
    """The names of n emulated GPUs before their servers have chosen ports."""
    host, port = PLACEHOLDER_ENDPOINT.rsplit(":", 1)
    return tuple(f"{host}:{int(port) + i}" for i in range(n))


@dataclass
class Target:
    make_runner: Callable[[], TrialRunner]  # a fresh runner (started by the caller's `with`)
    devices: Callable[[TrialRunner], tuple[Device, ...]]  # the devices the estimator plans for, given the runner
    planned_devices: tuple[Device, ...]  # the same before anything starts (--dry-run, the checks before a study)
    planned_rpc: tuple[str, ...]
    machine: dict[str, Any]
    machine_dir: str
    physical_cores: int
    performance_cores: int
    default_threads: int
    host_budget: int
    cpu_profile: CpuProfile
    has_gpu: bool
    emulated_mib: int | tuple[int, ...] | None = None  # several: one emulated GPU per value
    default_fit_target: tuple[int, ...] | None = None
    sim: Any = None  # the simulated Machine
    notes: tuple[str, ...] = ()  # what the target decided on its own (the demo's emulated GPU, a reserved core)
    replay: Any = None  # the replayed Landscape (fitter.sim.landscape)
    # the resolved search space and its source when the target fixes them (a replay: the recorded space)
    distributions: dict[str, Any] | None = None
    space_source: str | None = None


def local_target(snapshot: MachineSnapshot, base: LaunchConfig, process: ProcessFlags,
                 emulated_mib: int | tuple[int, ...] | None,
                 demo: bool, fit_targets: tuple[int, ...] | None, emulated_cuda: bool = False,
                 llama_cpp: str | None = None) -> Target:
    """This machine: its NVIDIA GPUs (free memory from the snapshot), the config's `--rpc` servers, or an emulated
    GPU (`--emulated-gpu [cuda:]MiB`, or by itself for the demo model on a machine without a GPU)."""
    cpu = snapshot.cpu
    try:
        gpus = tuple(c.gpu for c in snapshot.gpu_order())  # those llama.cpp sees (CUDA_VISIBLE_DEVICES)
    except GpuOrderError:
        if emulated_mib is None and not base.rpc:
            raise
        gpus = ()  # CUDA's order of these GPUs is unknown, and the trials run on emulated GPUs or --rpc: left alone
    notes: list[str] = []
    default_fit_target = None
    no_emulator = None
    if llama_cpp is not None and emulated_mib is None and not gpus and not base.rpc and demo:
        from fitter.measure.capdev import emulated_gpu_problem
        from fitter.measure.llama_build import find_build

        # the build's own shared ggml serves the emulated GPU when it has RPC; a static build needs llama-cpp-python's
        no_emulator = emulated_gpu_problem(find_build(llama_cpp).llama_server)
        if no_emulator is not None:
            notes.append(f"no GPU found, and no emulated GPU ({no_emulator}): tuning the demo model on the CPU with "
                         "your build")
    if emulated_mib is None and not gpus and not base.rpc and demo and no_emulator is None:
        emulated_mib = DEMO_EMULATED_GPU_MIB
        default_fit_target = (DEMO_FIT_TARGET_MIB,)
        shown = ",".join(map(str, fit_targets or default_fit_target))
        notes.append(f"no GPU found: tuning the demo model on fitter's emulated GPU ({emulated_mib} MiB, fit target "
                     f"{shown} MiB; its speed is CPU speed)")
    # each emulated GPU's RPC server computes on the CPU too: its core is not the trials' to use
    servers = len(emulated_caps(emulated_mib))
    reserved = min(servers, cpu.physical_cores - 1) if servers else 0
    if reserved and process.threads is None:
        whose = "the emulated GPU's server" if servers == 1 else f"the {servers} emulated GPUs' servers"
        cores = "one core" if reserved == 1 else f"{reserved} cores"
        notes.append(f"{cores} left to {whose}: trials use up to {cpu.physical_cores - reserved} threads")
    machine = snapshot.record()
    own = rpc_devices(list(base.rpc)) if base.rpc else snapshot.devices() if gpus else ()

    def started(runner: TrialRunner) -> tuple[Device, ...]:
        """With the worker started, the GPUs' free memory is read again: what the worker holds is not the trials'."""
        return runner.devices() or (own if base.rpc or not gpus else gpus_now(snapshot) or own)

    placeholders: tuple[str, ...] = ()
    if emulated_mib is not None:
        caps = emulated_caps(emulated_mib)
        machine["emulated_gpu_mib"] = emulated_mib if isinstance(emulated_mib, int) else list(emulated_mib)
        if emulated_cuda:
            machine["emulated_gpu_kind"] = "cuda"  # `fitter check` starts the same kind
        placeholders = placeholder_endpoints(len(caps))
        planned: tuple[Device, ...] = tuple(emulated_device(rpc_device_name(e), cap * MIB, emulated_cuda)
                                            for e, cap in zip(placeholders, caps, strict=True))
    else:
        planned = own
    cpus, nvml, build = process.cpus, bool(gpus), snapshot.llama_cpp or None
    order = tuple(g.index for g in gpus) if gpus else None  # NVML's index of CUDA0, CUDA1, … for the peak sampler

    def make_runner() -> TrialRunner:
        if llama_cpp is not None:  # the user's build: its llama-server runs every trial
            from fitter.measure.llama_build import find_build

            if emulated_cuda:
                raise FitterError(CUDA_SHAPED_NEEDS_WORKER)
            return ServerRunner(str(find_build(llama_cpp).llama_server), emulated_mib, process, nvml=nvml,
                                gpu_order=order)
        return WorkerRunner(emulated_gpu_mib=emulated_mib, cpus=cpus, nvml=nvml, build=build,
                            emulated_cuda=emulated_cuda, gpu_order=order)

    return Target(
        make_runner=make_runner,
        devices=started, planned_devices=planned,
        planned_rpc=placeholders,
        machine=machine, machine_dir=machine_dir_name(machine, emulated_mib),
        physical_cores=cpu.physical_cores - reserved, performance_cores=max(1, cpu.performance_cores - reserved),
        default_threads=max(1, cpu.recommended_threads - reserved),
        host_budget=snapshot.ram.available - HOST_RESERVE, cpu_profile=snapshot.cpu_profile,
        has_gpu=bool(gpus or base.rpc or emulated_mib is not None), emulated_mib=emulated_mib,
        default_fit_target=default_fit_target, notes=tuple(notes))


def sim_target(machine_name: str | None, emulated_mib: int | tuple[int, ...] | None, spec: ModelSpec,
               seed: int) -> Target:
    """A simulated machine (fitter.sim): its GPUs, cores and RAM stand in for this machine's."""
    from fitter.sim import SimRunner, load_machine

    if not machine_name:
        raise FitterError("--backend sim: give --machine NAME|FILE (fitter machines lists the shipped ones)")
    if emulated_mib is not None:
        raise FitterError("--backend sim and --emulated-gpu: the simulated machine has its own GPUs")
    m = load_machine(machine_name)
    fingerprint = hashlib.sha256(Path(m.path).read_bytes() if m.path else m.name.encode()).hexdigest()[:16]
    machine = {"sim": m.name, "description": m.description, "profile": m.path, "fingerprint": fingerprint,
               "physical_cores": m.cpu.p_cores + m.cpu.e_cores, "performance_cores": m.cpu.p_cores,
               "ram_bytes": int(m.ram.gib * GIB),
               "gpus": [f"sim GPU {g.name + ' ' if g.name else ''}{g.memory_gib:g} GiB" for g in m.gpus]}
    probe_runner = SimRunner(m, spec, seed=seed)
    return Target(
        make_runner=lambda: SimRunner(m, spec, seed=seed), devices=lambda r: r.devices(),
        planned_devices=probe_runner.devices(), planned_rpc=(), machine=machine,
        machine_dir=f"sim-{m.name}-{fingerprint[:8]}", physical_cores=m.cpu.p_cores + m.cpu.e_cores,
        performance_cores=m.cpu.p_cores, default_threads=m.cpu.p_cores,
        host_budget=int(m.ram.gib * GIB) - HOST_RESERVE, cpu_profile=probe_runner.cpu_profile(),
        has_gpu=bool(m.gpus), sim=m)


def replay_target(path: str | None, seed: int) -> Target:
    """A recorded landscape (`fitter grid`) replayed: its devices, budgets, cores, CPU rules, space and fixed flags
    stand in for this machine's, so the study searches exactly the recorded space (fitter.sim.replay)."""
    from optuna.distributions import CategoricalDistribution, json_to_distribution

    from fitter.sim import ReplayRunner, load_landscape

    if not path:
        raise FitterError("--backend replay: give --landscape FILE (fitter grid records one)")
    land = load_landscape(path)
    fingerprint = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    name = land.model.get("name") or "landscape"
    machine = {"replay": str(path), "fingerprint": fingerprint, "recorded": land.machine,
               "physical_cores": land.target["physical_cores"], "performance_cores": land.target["performance_cores"],
               "gpus": [d.name for d in land.devices]}
    probe = ReplayRunner(land, seed)
    t = land.target
    return Target(
        make_runner=lambda: ReplayRunner(land, seed), devices=lambda r: r.devices(),
        planned_devices=probe.devices(), planned_rpc=land.rpc, machine=machine,
        machine_dir=f"replay-{name}-{fingerprint[:8]}", physical_cores=t["physical_cores"],
        performance_cores=t["performance_cores"], default_threads=t["default_threads"], host_budget=t["host_budget"],
        cpu_profile=land.cpu_profile, has_gpu=bool(land.devices), default_fit_target=land.fit_target_mib,
        replay=land, space_source=land.space,
        # the study's own distributions as recorded (an int range stays one), else the recorded choices
        distributions={k: json_to_distribution(land.optuna[k]) if k in land.optuna else CategoricalDistribution(
            tuple(v)) for k, v in land.distributions.items()})
