"""What a tune runs on: this machine (its GPUs, `--rpc` devices, or fitter's emulated GPU) or a simulated one; a
recorded landscape replayed (`--backend replay`) is a target fitter.grid.replay_tune makes.

A `Target` says everything the study needs before anything starts: the runner to make, the devices the estimator
plans for (placeholders for an emulated GPU whose port is not chosen yet: same size, so the same verdicts), the
machine record that keys the results, cores and thread defaults, host RAM, the CPU's repack rules; and, where the
target fixes them, the options, the search space and the baseline (a replay: the recorded ones). `plan_request`
turns the options into the search's request for the target's devices.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution

from fitter.errors import FitterError
from fitter.flags import KV_CACHE_TYPES, LaunchConfig, ProcessFlags
from fitter.flags.parse import fixed_space_keys
from fitter.gguf.model_spec import ModelSpec
from fitter.machine.gpu_order import GpuOrderError
from fitter.machine.snapshot import MachineSnapshot, gpus_now, with_build_devices
from fitter.measure.emulator.emulated_gpu import emulated_device
from fitter.measure.runners import CUDA_SHAPED_NEEDS_WORKER, ServerRunner, TrialRunner, WorkerRunner, emulated_caps
from fitter.measure.types import BenchSpec
from fitter.memory.backends.devices import CpuProfile, Device, rpc_device_name, rpc_devices
from fitter.memory.fit.budgets import DEFAULT_FIT_TARGET_MIB, device_budgets
from fitter.memory.fit.fit_devices import expert_layers
from fitter.memory.plan.device_choice import default_devices, model_devices
from fitter.memory.plan.tensor_split import tensor_mode_runs
from fitter.results.quality_record import QUALITY
from fitter.search import split
from fitter.search.request import CTX_KEY, TuneRequest
from fitter.search.screen import Budgets
from fitter.search.space import default_space_name, for_target, load_space, resolve, shipped_space
from fitter.search.split import TENSOR
from fitter.storage.studies import machine_dir_name
from fitter.tune.options import TuneOptions
from fitter.tune.quality_objective import widened_kv_types
from fitter.units import GIB, MIB
from fitter.workload import context_choices

# The README's first command tunes the demo model; without a GPU it runs on an emulated one this big, with a fit
# target that leaves 80 MiB for the model (all of it on the device would need ~127 MiB: experts must be split).
DEMO_EMULATED_GPU_MIB = 96
DEMO_FIT_TARGET_MIB = 16
HOST_RESERVE = 512 * MIB  # RAM left to the OS and fitter itself when judging host memory
PLACEHOLDER_ENDPOINT = "127.0.0.1:50052"  # an emulated GPU's name before its server has chosen a port


def emulated_fit_targets(caps: tuple[int, ...]) -> tuple[int, ...]:
    """The fit target (MiB) of each emulated GPU when `--fit-target` is not given: the demo's share of its device
    (16 MiB of 96, so `--emulated-gpu 96` is the automatic demo), never more than llama.cpp's default 1024 MiB. An
    emulated GPU has no other tenant (no desktop, no driver's context), so the margin llama.cpp keeps on a real card
    would leave a device under 1 GiB nothing (`--emulated-gpu 64,48` was refused with budgets of -960 and -976 MiB)."""
    return tuple(min(DEFAULT_FIT_TARGET_MIB, cap * DEMO_FIT_TARGET_MIB // DEMO_EMULATED_GPU_MIB) for cap in caps)


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
    # the resolved search space and its source when the target fixes them (a replay: the recorded space)
    distributions: dict[str, Any] | None = None
    space_source: str | None = None
    # the options as the target fixes them, with a note for the log (a replay: its recorded flags, space and bench)
    fixed_options: Callable[[TuneOptions], tuple[TuneOptions, str]] | None = None
    # a baseline recorded with the target, not run by llama.cpp's fit (a replay: the recorded point, or why none)
    recorded_baseline: RecordedBaseline | None = None


@dataclass(frozen=True)
class RecordedBaseline:
    flags: tuple[str, ...] | None  # None: no baseline was recorded
    reason: str | None = None  # why none was


def local_target(snapshot: MachineSnapshot, base: LaunchConfig, process: ProcessFlags,
                 emulated_mib: int | tuple[int, ...] | None,
                 demo: bool, fit_targets: tuple[int, ...] | None, emulated_kind: str = "rpc",
                 llama_cpp: str | None = None) -> Target:
    """This machine: the devices a user's build lists (`--llama-cpp DIR`: any backend's; NVML annotates its CUDA
    ones), else its NVIDIA GPUs (free memory from the snapshot), the config's `--rpc` servers, or an emulated GPU
    (`--emulated-gpu [cuda:|vulkan:]MiB`, or by itself for the demo model on a machine without a GPU)."""
    cpu = snapshot.cpu
    notes: list[str] = []
    built: tuple[Device, ...] = ()
    if llama_cpp is not None and emulated_mib is None and not base.rpc:
        from fitter.measure.llamacpp.builds import devices_of_build, find_build

        built, build_notes = devices_of_build(find_build(llama_cpp))
        notes += build_notes
    try:
        gpus = tuple(c.gpu for c in snapshot.gpu_order())  # those llama.cpp sees (CUDA_VISIBLE_DEVICES)
    except GpuOrderError:
        if emulated_mib is None and not base.rpc and not built:
            raise
        gpus = ()  # CUDA's order of these GPUs is unknown, and the trials run elsewhere: left alone
    if built and not any(d.profile.kind == "cuda" for d in built):
        gpus = ()  # NVML's GPUs are not the build's devices (a Vulkan or ROCm build): no CUDA peaks sampled
    default_fit_target: tuple[int, ...] | None = None
    no_emulator = None
    if llama_cpp is not None and emulated_mib is None and not gpus and not built and not base.rpc and demo:
        from fitter.measure.emulator.capdev import emulated_gpu_problem
        from fitter.measure.llamacpp.builds import find_build

        # the build's own shared ggml serves the emulated GPU when it has RPC; a static build needs llama-cpp-python's
        no_emulator = emulated_gpu_problem(find_build(llama_cpp).llama_server)
        if no_emulator is not None:
            notes.append(f"no GPU found, and no emulated GPU ({no_emulator}): tuning the demo model on the CPU with "
                         "your build")
    if emulated_mib is None and not gpus and not built and not base.rpc and demo and no_emulator is None:
        emulated_mib = DEMO_EMULATED_GPU_MIB
        default_fit_target = (DEMO_FIT_TARGET_MIB,)
        shown = ",".join(map(str, fit_targets or default_fit_target))
        notes.append(f"no GPU found: tuning the demo model on fitter's emulated GPU ({emulated_mib} MiB, fit target "
                     f"{shown} MiB; its speed is CPU speed)")
    elif emulated_mib is not None and not fit_targets:
        default_fit_target = emulated_fit_targets(emulated_caps(emulated_mib))
        notes.append(f"fit target {','.join(map(str, default_fit_target))} MiB on the emulated GPU (the demo's share "
                     f"of {DEMO_FIT_TARGET_MIB} MiB in {DEMO_EMULATED_GPU_MIB}; --fit-target MiB[,MiB…] to choose)")
    # each emulated GPU's RPC server computes on the CPU too: its core is not the trials' to use (the Vulkan one has
    # no server: lavapipe computes in the trial's own process)
    servers = len(emulated_caps(emulated_mib)) if emulated_kind != "vulkan" else 0
    reserved = min(servers, cpu.physical_cores - 1) if servers else 0
    if reserved and process.threads is None:
        whose = "the emulated GPU's server" if servers == 1 else f"the {servers} emulated GPUs' servers"
        cores = "one core" if reserved == 1 else f"{reserved} cores"
        notes.append(f"{cores} left to {whose}: trials use up to {cpu.physical_cores - reserved} threads")
    machine = snapshot.record()
    if built:  # the build's devices name the machine, and `fitter check` holds a result to them
        from fitter.measure.llamacpp.builds import device_records

        machine = with_build_devices(machine, device_records(built))
    own = rpc_devices(list(base.rpc)) if base.rpc else built or (snapshot.devices() if gpus else ())

    def started(runner: TrialRunner) -> tuple[Device, ...]:
        """With the worker started, the GPUs' free memory is read again: what the worker holds is not the trials'
        (a build's devices: each trial starts a llama-server of its own, which holds nothing between trials)."""
        return runner.devices() or (own if base.rpc or built or not gpus else gpus_now(snapshot) or own)

    placeholders: tuple[str, ...] = ()
    if emulated_mib is not None:
        caps = emulated_caps(emulated_mib)
        machine["emulated_gpu_mib"] = emulated_mib if isinstance(emulated_mib, int) else list(emulated_mib)
        if emulated_kind != "rpc":
            machine["emulated_gpu_kind"] = emulated_kind  # `fitter check` starts the same kind
        if emulated_kind == "vulkan":  # lavapipe's limits, read now: a machine without it stops here
            from fitter.measure.emulator.emulated_vulkan import emulated_vulkan_devices, find_lavapipe

            planned: tuple[Device, ...] = emulated_vulkan_devices(caps, find_lavapipe()[1])
        else:
            placeholders = placeholder_endpoints(len(caps))
            planned = tuple(emulated_device(rpc_device_name(e), cap * MIB, emulated_kind == "cuda")
                            for e, cap in zip(placeholders, caps, strict=True))
    else:
        planned = own
    if (built or emulated_kind == "vulkan") and planned and not any(d.profile.kind == "rpc" for d in planned):
        # the devices llama.cpp gives the model unasked on the build's listing: exports pin them (-dev), so the
        # launch uses the devices that were measured even where the listing grows (another card, an iGPU)
        machine["model_devices"] = [d.name for d in default_devices(planned)]
    cpus, nvml, build = process.cpus, bool(gpus), snapshot.llama_cpp or None
    order = tuple(g.index for g in gpus) if gpus else None  # NVML's index of CUDA0, CUDA1, … for the peak sampler

    def make_runner() -> TrialRunner:
        if llama_cpp is not None or (emulated_mib is not None and emulated_kind == "vulkan"):
            # the user's build runs every trial, its llama-server; on the emulated Vulkan GPU a Vulkan build's
            # (fitter's own without --llama-cpp: lavapipe crashes flash-attention decoding inside a Python
            # process, llama-cpp-python's, where llama-server runs it)
            from fitter.measure.emulator.emulated_vulkan import vulkan_build
            from fitter.measure.llamacpp.builds import find_build

            if emulated_kind == "cuda":
                raise FitterError(CUDA_SHAPED_NEEDS_WORKER)
            folder = llama_cpp if llama_cpp is not None else vulkan_build()
            return ServerRunner(str(find_build(folder).llama_server), emulated_mib, process, nvml=nvml,
                                gpu_order=order, emulated_kind=emulated_kind)
        return WorkerRunner(emulated_gpu_mib=emulated_mib, cpus=cpus, nvml=nvml, build=build,
                            emulated_kind=emulated_kind, gpu_order=order)

    return Target(
        make_runner=make_runner,
        devices=started, planned_devices=planned,
        planned_rpc=placeholders,
        machine=machine, machine_dir=machine_dir_name(machine, emulated_mib),
        physical_cores=cpu.physical_cores - reserved, performance_cores=max(1, cpu.performance_cores - reserved),
        default_threads=max(1, cpu.recommended_threads - reserved),
        host_budget=snapshot.ram.available - HOST_RESERVE, cpu_profile=snapshot.cpu_profile,
        has_gpu=bool(own or base.rpc or emulated_mib is not None), emulated_mib=emulated_mib,
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


def tune_target(o: TuneOptions, snapshot: MachineSnapshot | None) -> Target:
    """What the trials run on: this machine (`snapshot`) or a simulated one."""
    m = o.measure
    if m.backend == "sim":
        return sim_target(m.machine, m.emulated_gpu_mib, o.spec, o.search.seed)
    if m.backend == "replay":  # a landscape is read above the tune (fitter.grid): its target is handed in
        raise FitterError("--backend replay: a replayed landscape is tuned by fitter.grid.replay_tune.run_replay")
    assert snapshot is not None, "a tune on this machine needs its snapshot"
    return local_target(snapshot, o.base, o.process, m.emulated_gpu_mib, o.demo, o.search.fit_targets,
                        m.emulated_kind, m.llama_cpp)


def fit_targets(o: TuneOptions, target: Target) -> tuple[int, ...]:
    return o.search.fit_targets or target.default_fit_target or (DEFAULT_FIT_TARGET_MIB,)


def plan_request(o: TuneOptions, target: Target, devices: tuple[Device, ...], rpc: tuple[str, ...],
                 log: Callable[[str], None] = lambda _: None) -> TuneRequest:
    """The request for the target's devices: objectives, the resolved space less what the flags fix, budgets."""
    objectives = o.search.objectives
    if "vram" in objectives and not target.has_gpu:
        objectives = tuple(x for x in objectives if x != "vram")
        log("fitter: no GPU: the vram objective is dropped")
    distributions, source = _space(o, target)
    if QUALITY in objectives and target.distributions is None:  # what each KV type costs is measured: all of them
        distributions = widened_kv_types(distributions, o.search.quality_kv_types or tuple(KV_CACHE_TYPES))
    if o.workload.min_ctx and target.distributions is None:  # the context as a trade: searched, a Pareto axis
        contexts = context_choices(o.workload.min_ctx, o.spec.n_ctx_train)
        distributions = {CTX_KEY: CategoricalDistribution(contexts), **distributions}
        objectives = (*objectives, "ctx") if "ctx" not in objectives else objectives
    if target.distributions is None and len(devices) > 1 and not set(split.FIXING_FLAGS) & o.base.given:
        # several GPUs: per-device placement instead of -ncmoe's first layers (fitter.search.split)
        distributions = split.split_dims(distributions, len(devices), o.spec.n_layer)
    elif target.distributions is None:  # the flags place the model (or one GPU): -sm is not the search's to change
        distributions.pop(split.MODE, None)
    if o.process.threads is not None:
        distributions.pop("threads", None)
    if o.process.threads_batch is not None:
        distributions.pop("threads-batch", None)
    if o.process.threads_batch is not None and o.process.threads is None:
        raise FitterError("-tb without -t: give both, or neither to search them")
    w = o.workload  # the runner measures each depth (fitter.measure.served); the spec names the deepest
    bench = BenchSpec(n_prompt=w.n_prompt, n_gen=w.n_gen, n_depth=max(w.depths), repetitions=o.measure.repetitions,
                      threads=o.process.threads or target.default_threads, threads_batch=o.process.threads_batch,
                      streams=w.concurrency)
    budgets: dict[str, int] = {}
    for name, budget in device_budgets(devices, fit_targets(o, target)).items():
        if budget is None:
            raise FitterError(f"{name}: its free memory is unknown, so tune has no VRAM budget for it; give "
                              "--emulated-gpu MiB, or tune on the machine that has the GPU")
        budgets[name] = budget
    return TuneRequest(model=o.model, spec=o.spec, base=o.base, distributions=distributions, devices=devices,
                       budgets=Budgets(budgets, target.host_budget, {}), cpu=target.cpu_profile,
                       objectives=objectives, bench=bench, workload=w, n_trials=o.search.trials,
                       timeout_s=o.search.timeout_s, trial_timeout_s=o.measure.trial_timeout_s, seed=o.search.seed,
                       rpc=rpc, space_source=source)


def _tensor_split(o: TuneOptions, target: Target) -> bool:
    """Whether llama.cpp runs this model with -sm tensor on the target's GPUs (two to 16 of them, an architecture
    off llama.cpp's deny-list, flash attention not turned off by the flags: fitter.memory.plan.tensor_split)."""
    try:
        n = len(model_devices(replace(o.base, split_mode=TENSOR), target.planned_devices))
    except FitterError:  # -dev, -ts or -mg that llama.cpp refuses: the estimate says so for every trial
        return False
    return tensor_mode_runs(o.spec, o.base, n)


def _space(o: TuneOptions, target: Target) -> tuple[dict[str, BaseDistribution], str]:
    """The resolved search space (the target's, else the given or shipped one) less what the flags fix."""
    if target.distributions is not None:  # a replay: the recorded space
        distributions, source = dict(target.distributions), target.space_source or ""
    else:
        space = (load_space(o.search.space) if o.search.space else
                 shipped_space(default_space_name(o.spec.n_expert, target.has_gpu)))
        distributions = resolve(space, n_layer=o.spec.n_layer, physical_cores=target.physical_cores,
                                performance_cores=target.performance_cores, expert_layers=expert_layers(o.spec))
        distributions = for_target(distributions, has_gpu=target.has_gpu, pinned_host=any(
            d.profile.host_buft for d in target.planned_devices), tensor_split=_tensor_split(o, target))
        source = space.source
    fixed = fixed_space_keys(o.base)
    distributions = {k: d for k, d in distributions.items() if k not in fixed}
    if "n-cpu-moe" not in distributions:  # the flags place the experts (or there are none): nothing to order
        distributions.pop(split.ORDER, None)
    return distributions, source
