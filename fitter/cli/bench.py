"""`fitter bench`: one configuration measured at its deployed context, beside fitter's estimate."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

from fitter.cli.common import (
    add_emulated_gpu,
    add_llama_cpp,
    add_projection,
    build_projector,
    launch_args,
    load_model,
    log,
    model_path,
    target_devices,
    warn,
)
from fitter.errors import FitterError, LaunchConfigError
from fitter.flags import SERVER_DEFAULTS_HELP, ProcessFlags, add_launch_arguments, add_process_arguments
from fitter.flags.consumers import with_bench_context

if TYPE_CHECKING:  # the measuring side loads when a command measures, not when the parser is built
    from fitter.flags import LaunchConfig
    from fitter.machine.snapshot import MachineSnapshot
    from fitter.measure.runners import TrialRunner
    from fitter.workload import Workload


def _runner(ns: argparse.Namespace, process: ProcessFlags, snapshot: MachineSnapshot, vocab_size: int) -> TrialRunner:
    """The backend the user chose: fitter's worker (default), their llama-server or their llama-bench."""
    from fitter.measure.runners import CUDA_SHAPED_NEEDS_WORKER, LlamaBenchRunner, ServerRunner, WorkerRunner

    nvml = bool(snapshot.gpus)
    order = snapshot.nvml_indices() if nvml else None  # NVML's peaks named as llama.cpp names the devices
    if ns.llama_cpp:  # the build's own llama-server
        from fitter.measure.llamacpp.builds import find_build

        if ns.llama_server or ns.llama_bench:
            raise LaunchConfigError("--llama-cpp DIR and --llama-server/--llama-bench: name one build")
        ns.llama_server = str(find_build(ns.llama_cpp).llama_server)
    if ns.llama_server and ns.llama_bench:
        raise LaunchConfigError("--llama-server and --llama-bench: measure with one backend at a time")
    if ns.emulated_gpu is not None and ns.emulated_kind == "vulkan" and not (ns.llama_server or ns.llama_bench):
        from fitter.measure.emulator.emulated_vulkan import vulkan_build

        # the Vulkan build's own llama-server measures (lavapipe crashes flash-attention decoding inside a Python
        # process, the worker's)
        ns.llama_server = str(vulkan_build() / "llama-server")
    if ns.emulated_kind == "cuda" and (ns.llama_server or ns.llama_bench):
        raise LaunchConfigError(CUDA_SHAPED_NEEDS_WORKER)
    if ns.llama_bench:
        if ns.threads_batch is not None:
            raise LaunchConfigError("-tb: llama-bench has one thread count (-t) for prefill and decode")
        if ns.cpu_range:
            raise LaunchConfigError("--cpu-range: llama-bench only takes --cpu-mask")
        return LlamaBenchRunner(ns.llama_bench, ns.emulated_gpu, ns.cpu_mask, nvml=nvml, gpu_order=order,
                                emulated_kind=ns.emulated_kind)
    if ns.llama_server:
        return ServerRunner(ns.llama_server, ns.emulated_gpu, process, nvml=nvml, vocab_size=vocab_size,
                            gpu_order=order, emulated_kind=ns.emulated_kind)
    return WorkerRunner(emulated_gpu_mib=ns.emulated_gpu, cpus=process.cpus, nvml=nvml,
                        build=snapshot.llama_cpp or None, emulated_kind=ns.emulated_kind, gpu_order=order)


def _listed(snapshot: MachineSnapshot, ns: argparse.Namespace) -> MachineSnapshot:
    """The snapshot with the device list of the user's binary that measures, if any (fitter.machine.gpu_order)."""
    from fitter.measure.llamacpp.builds import find_build, listed_by

    binary = ns.llama_server or ns.llama_bench or (find_build(ns.llama_cpp).llama_server if ns.llama_cpp else None)
    return listed_by(snapshot, binary)


def cmd_bench(ns: argparse.Namespace) -> int:
    from fitter.machine.snapshot import gpus_now, take_snapshot
    from fitter.measure.bench import bench
    from fitter.measure.bench_table import bench_table
    from fitter.measure.served import WorkloadRunner
    from fitter.measure.types import BenchSpec

    config, process = launch_args(ns)  # bad flags stop here, before any process starts
    workload, config = workload_from_args(ns, config)
    model = model_path(ns.model)
    spec = load_model(model, config)
    if ns.backend == "sim":
        return _bench_sim(ns, model, spec, config, process, workload)
    if ns.backend == "replay":
        if not workload.is_default_shape:
            raise FitterError("--backend replay plays one recorded test back: drop the depth list and --concurrency")
        return _bench_replay(ns, model, spec, config)
    snapshot = _listed(take_snapshot(), ns)
    # llama.cpp's advice for hybrid CPUs: one thread per physical performance core (fitter probe)
    threads = ns.threads if ns.threads is not None else snapshot.cpu.recommended_threads
    cpus = process.cpus
    bench_spec = BenchSpec(n_prompt=ns.n_prompt, n_gen=ns.n_gen, n_depth=ns.n_depth, repetitions=ns.repetitions,
                           threads=threads, threads_batch=ns.threads_batch)
    runner = WorkloadRunner(_runner(ns, process, snapshot, spec.n_vocab), workload)
    if config.rpc:  # the config's RPC servers; --devices is not a bench target (it would not be measured)
        devices = target_devices(ns, config, snapshot)
    else:
        devices = (gpus_now(snapshot) or snapshot.devices()) if snapshot.gpus and ns.emulated_gpu is None else ()
    # refused here, before anything starts, where fitter guesses and no build can project (as `fitter estimate`)
    build_projector(ns, spec, config.rpc, devices)
    result = bench(model, spec, config, bench_spec, runner, snapshot.cpu_profile, devices, ns.timeout,
                   projector_for=lambda rpc, planned: build_projector(ns, spec, rpc, planned))
    for w in result["warnings"]:  # as `fitter estimate` warns
        warn(w)
    if "projection" in result:
        log(f"fitter: {result['projection']['summary']}")
    result["threads"] = threads
    result["threads_batch"] = ns.threads_batch or threads
    result["cpus"] = list(cpus) if cpus else None
    result["machine"] = snapshot.record()
    print(json.dumps(result, indent=1) if ns.json else bench_table(result))
    if snapshot.gpus and result["outcome"] == "ok":
        from fitter.machine.measured_overhead import record_measurements

        problem = record_measurements([(result, f"fitter bench {time.strftime('%Y-%m-%d')}")],
                                      tuple(c.gpu for c in snapshot.gpu_order()), result["machine"]["fingerprint"],
                                      snapshot.nvidia.driver)
        if problem:
            warn(problem)
    return 0 if result["outcome"] == "ok" else 1


def _bench_sim(ns: argparse.Namespace, model: str, spec: Any, config: Any, process: ProcessFlags,
               workload: Workload) -> int:
    """One measurement on a simulated machine (fitter.sim): same result shape, backend "sim"."""
    from fitter.measure.served import WorkloadRunner
    from fitter.measure.types import BenchSpec
    from fitter.sim import SimRunner, load_machine

    if not ns.machine:
        raise FitterError("--backend sim: give --machine NAME|FILE (fitter machines lists the shipped ones)")
    _refuse_devices(ns, "--backend sim measures the simulated machine")
    machine = load_machine(ns.machine)
    runner = WorkloadRunner(SimRunner(machine, spec, seed=ns.seed), workload)
    bench_spec = BenchSpec(n_prompt=ns.n_prompt, n_gen=ns.n_gen, n_depth=ns.n_depth, repetitions=ns.repetitions,
                           threads=ns.threads or machine.cpu.p_cores, threads_batch=ns.threads_batch)
    return _bench_without_llama_cpp(
        ns, model, spec, config, runner, runner.cpu_profile(), bench_spec,
        {"sim": machine.name, "description": machine.description, "profile": machine.path},
        f"simulated machine {machine.name}: {machine.description}")


def _bench_replay(ns: argparse.Namespace, model: str, spec: Any, config: Any) -> int:
    """One recorded run of a config of a landscape (fitter.grid.replay): same result shape, backend "replay"."""
    from fitter.grid import ReplayRunner, load_landscape
    from fitter.measure.types import BenchSpec

    if not ns.landscape:
        raise FitterError("--backend replay: give --landscape FILE (fitter grid records one)")
    _refuse_devices(ns, "--backend replay plays a recorded landscape back")
    land = load_landscape(ns.landscape)
    runner = ReplayRunner(land, seed=ns.seed or 0)
    threads = ns.threads or land.target["default_threads"]
    b = land.bench
    bench_spec = BenchSpec(n_prompt=b["p"], n_gen=b["n"], n_depth=b["d"], repetitions=ns.repetitions,
                           threads=threads, threads_batch=ns.threads_batch or threads)
    return _bench_without_llama_cpp(ns, model, spec, config, runner, land.cpu_profile, bench_spec,
                                    {"replay": ns.landscape, "recorded": land.machine}, f"replay of {ns.landscape}")


def _refuse_devices(ns: argparse.Namespace, what: str) -> None:
    if ns.emulated_gpu is not None or ns.llama_server or ns.llama_bench:
        raise FitterError(f"{what}: drop --emulated-gpu/--llama-server/--llama-bench")


def _bench_without_llama_cpp(ns: argparse.Namespace, model: str, spec: Any, config: Any, runner: Any, cpu: Any,
                             bench_spec: Any, machine: dict[str, Any], header: str) -> int:
    """A simulated or replayed measurement, printed as `fitter bench` prints one, with the machine it stands for."""
    from fitter.measure.bench import bench
    from fitter.measure.bench_table import bench_table

    out = bench(model, spec, config, bench_spec, runner, cpu, timeout=ns.timeout)
    out["threads"] = bench_spec.threads
    out["machine"] = machine
    print(json.dumps(out, indent=1) if ns.json else f"{header}\n" + bench_table(out))
    return 0 if out["outcome"] == "ok" else 1


def workload_from_args(ns: argparse.Namespace, config: LaunchConfig, tune: bool = False) -> \
        tuple[Workload, LaunchConfig]:
    """The workload asked for (`--workload`, else -p -n -d --concurrency; tune's `--min-ctx`) and `config` able to
    serve it (a slot per stream; the smallest context a searched one starts from; llama-bench's context sized for
    its deepest test). Sets ns.n_prompt, ns.n_gen and ns.n_depth (the deepest) for what reads them as one test.
    Only tune searches a context: bench refuses a workload that asks it to."""
    from dataclasses import replace

    from fitter.workload import Workload, load_workload, parse_depths, searched_context, serving_config, with_images

    if ns.workload:
        given = [f for f, v in (("-p", ns.n_prompt), ("-n", ns.n_gen), ("-d", ns.n_depth),
                                ("--concurrency", ns.concurrency)) if v is not None]
        if given:
            raise FitterError(f"--workload {ns.workload} and {', '.join(given)}: the workload file sets them; give "
                              "one or the other")
        w = load_workload(ns.workload)
    else:
        w = Workload(n_prompt=512 if ns.n_prompt is None else ns.n_prompt,
                     n_gen=128 if ns.n_gen is None else ns.n_gen,
                     depths=parse_depths(ns.n_depth) if ns.n_depth is not None else (0,),
                     concurrency=1 if ns.concurrency is None else ns.concurrency, source="flags")
    min_ctx = getattr(ns, "min_ctx", None)
    if min_ctx is not None:
        if w.min_ctx:
            raise FitterError(f"--workload {ns.workload} and --min-ctx: the workload file sets min_ctx; give one or "
                              "the other")
        w = replace(w, min_ctx=min_ctx)
    elif w.min_ctx and not tune:
        raise FitterError(f"{w.source}: min_ctx {w.min_ctx} asks for a search of the context, which only "
                          "`fitter tune` does; bench measures the -c you give")
    if getattr(ns, "prompts", None):
        from fitter.workload.prompts import read_prompts

        if w.prompts is not None:
            raise FitterError(f"--workload {ns.workload} and --prompts: the workload file sets its prompts; give one "
                              "or the other")
        w = replace(w, prompts=read_prompts(ns.prompts))
    if getattr(ns, "images", None) is not None:
        if w.images:
            raise FitterError(f"--workload {ns.workload} and --images: the workload file sets images; give one or "
                              "the other")
        w = replace(w, images=ns.images)
    if w.images:
        from fitter.gguf.projector import load_projector_spec

        w = with_images(w, load_projector_spec(config.mmproj).tokens_per_image if config.mmproj else None)
    ns.n_prompt, ns.n_gen, ns.n_depth = w.n_prompt, w.n_gen, max(w.depths)
    config = with_bench_context(serving_config(w, searched_context(w, config)), w.tokens_per_stream())
    return w, config


def workload_names() -> tuple[str, ...]:
    from fitter.workload import shipped_workload_names

    return shipped_workload_names()


def add_measure_arguments(parser: argparse.ArgumentParser) -> None:
    """What bench and tune measure (llama-bench's -p -n -d -r), where (-C/-Cr) and on what (--backend/--machine)."""
    g = parser.add_argument_group("measurement (the workload)")
    g.add_argument("-p", "--n-prompt", dest="n_prompt", type=int, default=None, metavar="N",
                   help="prompt tokens per prefill test (default 512)")
    g.add_argument("-n", "--n-gen", dest="n_gen", type=int, default=None, metavar="N",
                   help="tokens per decode test (default 128)")
    g.add_argument("-d", "--n-depth", dest="n_depth", default=None, metavar="LIST",
                   help="context already in the cache, llama-bench's list syntax: 0,32768 or 0-32768+8192; every "
                   "depth is measured, their speeds combined as the tokens' time (default 0)")
    g.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help="streams served at once: N concurrent requests, a slot (-np N) each, through llama-server "
                   "(--llama-cpp DIR) or a simulated machine; tg is their aggregate decode (default 1)")
    g.add_argument("--images", type=int, default=None, metavar="N",
                   help="images in each request's prompt (with --mmproj): each adds the projector's tokens per image "
                   "to the prompt measured and the context a slot must hold (the encoder's own time is not measured)")
    g.add_argument("--workload", metavar="NAME|FILE", help="the workload as a TOML file (prompt, gen, depths, "
                   "weights, concurrency), or a shipped one: " + ", ".join(workload_names()))
    g.add_argument("--prompts", metavar="FILE", help="decode on your text instead of synthetic tokens: JSON lines "
                   "(strings or {\"prompt\": ...}) or one prompt per paragraph; each repetition decodes -n tokens "
                   "after every prompt, through llama-server (--llama-cpp DIR). A speculation (-md with --spec-type "
                   "draft-simple) is measured only this way: its speed depends on the text")
    g.add_argument("-r", "--repetitions", dest="repetitions", type=int, default=3, metavar="N")
    add_process_arguments(g, names=("-C", "-Cr"))
    g.add_argument("--backend", choices=("llama-cpp-python", "sim", "replay"), default="llama-cpp-python",
                   help="measure with llama.cpp (default), on a simulated machine (--machine) or replay a recorded "
                   "landscape (--landscape)")
    g.add_argument("--machine", metavar="NAME|FILE", help="the simulated machine (fitter machines lists them)")
    g.add_argument("--landscape", metavar="FILE", help="the landscape --backend replay plays back (fitter grid)")


def register(sub: Any) -> None:
    b = sub.add_parser(
        "bench",
        help="measure prefill and decode speed of one llama.cpp configuration at its deployed context",
        description="A warm-up, then -r repetitions of a prefill of -p tokens and a decode of -n tokens after -d "
        "tokens of context, like llama-bench, but in a context allocated at the deployed size, so a passing run "
        "proves the configuration fits. Buffers are shown beside fitter's estimate. Exit code 1 on oom, crash or "
        "timeout (a state, never a zero speed).",
        epilog=SERVER_DEFAULTS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("model", nargs="?", help="GGUF file or any shard (default: the demo model)")
    add_process_arguments(b, {"-t": "threads (default: the physical performance cores, as fitter probe counts them)",
                              "-tb": "threads for prefill (default: -t)"}, names=("-t", "-tb"))
    b.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds before a trial counts as hung (default: from the predicted work)")
    add_emulated_gpu(b, "run on", several=True)
    b.add_argument("--llama-server", metavar="PATH", help="measure this llama-server binary instead")
    add_llama_cpp(b, "measure with that build's llama-server")
    add_projection(b)
    b.add_argument("--llama-bench", metavar="PATH",
                   help="measure with this llama-bench binary instead (its context is p+n+d, not the deployed one)")
    b.add_argument("--devices", default="", help=argparse.SUPPRESS)
    b.add_argument("--seed", type=int, default=None, help="the simulated machine's noise seed")
    b.add_argument("--json", action="store_true")
    add_measure_arguments(b)
    add_launch_arguments(b)
    b.set_defaults(func=cmd_bench)
