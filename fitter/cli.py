"""fitter's command line: thin commands over the library; FitterError → one line on stderr and exit code 2.

Imports stay light (no optuna, pandas or llama_cpp here): `fitter estimate` must finish in well under a second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn

from fitter import LLAMA_CPP_TARGET, __version__
from fitter.errors import FitterError, LaunchConfigError

MIB = 1024 * 1024


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other bad input
        print(f"fitter: error: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def _model_path(arg: str | None) -> str:
    if arg:
        return arg
    from fitter.demo_models import demo_model_path

    return str(demo_model_path())


def _target_devices(ns: argparse.Namespace) -> tuple[Any, ...]:
    from fitter.devices import detect_gpus, parse_devices, rpc_devices

    rpc = tuple(x for x in ns.rpc.split(",") if x)
    if ns.devices and rpc:
        raise LaunchConfigError(f"--devices {ns.devices} and --rpc {ns.rpc}: give one target, not both")
    if ns.devices:
        return parse_devices(ns.devices)
    if rpc:
        return rpc_devices(list(rpc))
    return detect_gpus()


def cmd_estimate(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.devices import detect_cpu_profile
    from fitter.estimator import estimate
    from fitter.launch_config import launch_config_from_args
    from fitter.model_spec import load_model_spec
    from fitter.report import plan_json, plan_table

    config = launch_config_from_args(ns, flags)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = load_model_spec(_model_path(ns.model))
    plan = estimate(spec, config, _target_devices(ns), detect_cpu_profile())
    for w in [str(c.message) for c in caught] + list(plan.warnings):
        print(f"fitter: warning: {w}", file=sys.stderr)
    if ns.json:
        print(json.dumps(plan_json(plan, LLAMA_CPP_TARGET), indent=1, sort_keys=False))
    else:
        print(plan_table(plan, LLAMA_CPP_TARGET, per_tensor=ns.tensors))
    return 0


def _mib_list(value: str, flag: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in value.split(",") if x)
    except ValueError:
        raise LaunchConfigError(f"{flag} {value!r}: expected MiB[,MiB...]") from None
    if not out or any(x < 0 for x in out):
        raise LaunchConfigError(f"{flag} {value!r}: expected non-negative MiB[,MiB...]")
    return out


def cmd_fit(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.devices import RPC, Device, detect_cpu_profile
    from fitter.export import server_command, server_flags
    from fitter.fit import fit
    from fitter.launch_config import launch_config_from_args
    from fitter.model_spec import load_model_spec
    from fitter.report import fit_json, fit_table

    config = launch_config_from_args(ns, flags)
    targets = _mib_list(ns.fit_target, "--fit-target")
    model = _model_path(ns.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = load_model_spec(model)
    for c in caught:
        print(f"fitter: warning: {c.message}", file=sys.stderr)
    gpu = None
    try:
        if ns.emulated_gpu is not None:
            from fitter.emulated_gpu import EmulatedGpu

            if ns.devices or ns.rpc:
                raise LaunchConfigError("--emulated-gpu replaces --devices and --rpc: give one target")
            gpu = EmulatedGpu(cap_mib=ns.emulated_gpu).start()
            cap = ns.emulated_gpu * MIB
            devices: tuple[Any, ...] = (Device(gpu.device_name, RPC, cap, cap),)
        else:
            devices = _target_devices(ns)
        result = fit(spec, config, devices, targets, ns.fit_ctx, detect_cpu_profile())
        rpc = (gpu.endpoint,) if gpu is not None else config.rpc
        launch = server_flags(result.config, result.plan.context, rpc)
        verify = None
        if ns.verify:
            if gpu is None:
                raise LaunchConfigError("--verify needs --emulated-gpu: only an emulated device can be loaded here")
            verify = _verify(model, launch, gpu)
    finally:
        if gpu is not None:
            gpu.stop()
    for w in result.plan.warnings:
        print(f"fitter: warning: {w}", file=sys.stderr)
    if ns.json:
        out = fit_json(result, launch, server_command(model, launch), emulated=gpu is not None, verify=verify)
        print(json.dumps(out, indent=1))
    else:
        print(fit_table(result, server_command(model, launch), emulated=gpu is not None, verify=verify))
    return 0 if result.fits else 1


def _verify(model: str, launch: list[str], gpu: Any) -> dict[str, Any]:
    """Load the chosen flags on the emulated device and read what it really allocated."""
    from fitter.launch_config import parse_launch_flags
    from fitter.llama_cpp_loader import load_and_capture

    gpu.reset_peak()
    res = load_and_capture(model, parse_launch_flags(launch))
    stats = gpu.stats()
    return {
        "loaded": res.ok,
        "error": res.error,
        "device_peak_bytes": stats.peak_bytes,
        "device_cap_bytes": stats.cap_bytes,
        "buffers": [{"buft": b.buft, "kind": b.kind, "mib": b.mib} for b in res.buffers],
    }


def cmd_bench(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.bench import bench_json, bench_table, machine_record, parse_cpu_mask
    from fitter.devices import RPC, Device, detect_cpu_profile
    from fitter.estimator import estimate
    from fitter.launch_config import launch_config_from_args, parse_launch_flags
    from fitter.model_spec import load_model_spec
    from fitter.nvml_peak import NvmlPeakSampler
    from fitter.probe import build_cpu_info, detect_nvidia, detect_ram, read_cpu_snapshot
    from fitter.worker import BenchSpec

    config = launch_config_from_args(ns, flags)  # bad flags stop here, before any process starts
    model = _model_path(ns.model)
    if ns.backend == "sim":
        return _bench_sim(ns, model, config, flags)
    cpu = build_cpu_info(read_cpu_snapshot())
    gpus, nvidia = detect_nvidia()
    machine = machine_record(cpu, detect_ram().total, [g.name for g in gpus], nvidia.driver)
    # llama.cpp's advice for hybrid CPUs: one thread per physical performance core (fitter probe)
    threads = ns.threads if ns.threads is not None else cpu.recommended_threads
    cpus = parse_cpu_mask(ns.cpu_mask, ns.cpu_range)
    affinity_flags = [*(["-C", ns.cpu_mask] if ns.cpu_mask else []),
                      *(["-Cr", ns.cpu_range] if ns.cpu_range else [])]
    spec = BenchSpec(n_prompt=ns.n_prompt, n_gen=ns.n_gen, n_depth=ns.n_depth, repetitions=ns.repetitions,
                     threads=threads, threads_batch=ns.threads_batch)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        model_spec = load_model_spec(model)
    gpu = None
    try:
        devices: tuple[Any, ...] = ()
        if ns.emulated_gpu is not None:
            from fitter.emulated_gpu import EmulatedGpu

            gpu = EmulatedGpu(cap_mib=ns.emulated_gpu).start()
            flags = [*flags, "--rpc", gpu.endpoint]
            config = parse_launch_flags(flags)
            cap = ns.emulated_gpu * MIB
            devices = (Device(gpu.device_name, RPC, cap, cap),)
        elif config.rpc:
            devices = _target_devices(ns)
        plan: Any = estimate(model_spec, config, devices, detect_cpu_profile())
        if ns.llama_server and ns.llama_bench:
            raise LaunchConfigError("--llama-server and --llama-bench: measure with one backend at a time")
        sampler = NvmlPeakSampler() if gpus else contextlib.nullcontext(None)
        with sampler:
            m, backend, plan = _bench_backend(ns, model, model_spec, config, spec, plan, flags, threads,
                                              affinity_flags, cpus)
        peak = {gpu.device_name: {"bytes": gpu.stats().peak_bytes, "source": "emulator"}} if gpu else {}
        if isinstance(sampler, NvmlPeakSampler):
            peak.update({name: {"bytes": b, "source": "nvml"} for name, b in sampler.peaks.items()})
    finally:
        if gpu is not None:
            gpu.stop()
    result = bench_json(m, backend, plan, emulated=gpu is not None, peak_vram=peak)
    result["threads"] = threads
    result["threads_batch"] = ns.threads_batch or threads
    result["cpus"] = list(cpus) if cpus else None
    result["machine"] = machine
    print(json.dumps(result, indent=1) if ns.json else bench_table(result))
    return 0 if m.outcome == "ok" else 1


def _bench_sim(ns: argparse.Namespace, model: str, config: Any, flags: list[str]) -> int:
    """One measurement on a simulated machine (fitter/sim.py): same result shape, backend "sim"."""
    from fitter.bench import bench_json, bench_table
    from fitter.model_spec import load_model_spec
    from fitter.sim import SimRunner, load_machine
    from fitter.worker import BenchSpec

    if not ns.machine:
        raise FitterError("--backend sim: give --machine NAME|FILE (fitter machines lists the shipped ones)")
    if ns.emulated_gpu is not None or ns.llama_server or ns.llama_bench:
        raise FitterError("--backend sim measures the simulated machine: drop --emulated-gpu/--llama-server/"
                          "--llama-bench")
    machine = load_machine(ns.machine)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        spec = load_model_spec(model)
    runner = SimRunner(machine, spec, seed=ns.seed)
    bench = BenchSpec(n_prompt=ns.n_prompt, n_gen=ns.n_gen, n_depth=ns.n_depth, repetitions=ns.repetitions,
                      threads=ns.threads or machine.cpu.p_cores, threads_batch=ns.threads_batch)
    result = runner.run(model, config, bench, ns.timeout)
    plan = runner.plan(config)
    out = bench_json(result.measurement, "sim", plan, emulated=False, peak_vram=result.peak_vram)
    out["threads"] = bench.threads
    out["machine"] = {"sim": machine.name, "description": machine.description, "profile": machine.path}
    print(json.dumps(out, indent=1) if ns.json else f"simulated machine {machine.name}: {machine.description}\n"
          + bench_table(out))
    return 0 if result.measurement.outcome == "ok" else 1


def _bench_backend(ns: argparse.Namespace, model: str, model_spec: Any, config: Any, spec: Any, plan: Any,
                   flags: list[str], threads: int, affinity_flags: list[str],
                   cpus: tuple[int, ...] | None) -> tuple[Any, str, Any]:
    """One measurement with the backend the user chose: (measurement, backend name, the plan that applies)."""
    from fitter.worker import measure

    if ns.llama_bench:
        from fitter.llama_bench_backend import measure_llama_bench

        if ns.threads_batch is not None:
            raise LaunchConfigError("-tb: llama-bench has one thread count (-t) for prefill and decode")

        if ns.cpu_range:
            raise LaunchConfigError("--cpu-range: llama-bench only takes --cpu-mask")
        m = measure_llama_bench(ns.llama_bench, model, config, spec, timeout=ns.timeout or 600.0,
                                cpu_mask=ns.cpu_mask)
        backend = "llama-bench"
        plan = None  # llama-bench allocates its own p+n+d context: the deployed estimate does not apply
    elif ns.llama_server:
        from fitter.server_backend import measure_server

        server_flags = [*flags, "-t", str(threads), "-tb", str(ns.threads_batch or threads), *affinity_flags]
        m = measure_server(ns.llama_server, model, server_flags, spec, timeout=ns.timeout or 600.0,
                           vocab_size=model_spec.n_vocab)
        backend = "llama-server"
    else:
        m = measure(model, config, spec, timeout=ns.timeout, cpus=cpus)
        backend = "llama-cpp-python"
    return m, backend, plan


def cmd_tune(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.tune_command import run_tune

    if ns.trials < 1:
        raise FitterError(f"--trials {ns.trials}: give at least 1")
    return run_tune(ns, flags)


def cmd_export(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.launcher_export import render

    path = Path(ns.result)
    if path.is_dir():
        path = path / "pareto.json"
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise FitterError(f"{path}: cannot read the tuning result: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise FitterError(f"{path}: not valid JSON ({e})") from None
    print(render(doc, ns.policy, ns.format, str(path)))
    return 0


def cmd_check(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.check import cmd_check as run_check_command

    return run_check_command(ns, flags, _sim_check_factory(ns))


def _sim_check_factory(ns: argparse.Namespace) -> Any:
    """A result tuned on a simulated machine is re-measured on that machine (its profile as recorded)."""
    import contextlib

    path = Path(ns.result)
    path = path / "pareto.json" if path.is_dir() else path
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # run_check reports the unreadable result
    machine_record = doc.get("machine") or {}
    if not machine_record.get("sim"):
        return None
    from fitter.model_spec import load_model_spec
    from fitter.sim import SimRunner, load_machine

    profile = machine_record.get("profile") or machine_record["sim"]
    machine = load_machine(profile if Path(profile).is_file() else machine_record["sim"])
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        spec = load_model_spec(ns.model or doc["model"]["path"])
    return lambda **_: contextlib.nullcontext(SimRunner(machine, spec))


def cmd_report(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.report_study import cmd_report as run_report_command

    return run_report_command(ns, flags)


def cmd_machines(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.sim import machines_table

    print(machines_table())
    return 0


def cmd_demo_model(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.demo_models import SHAPES, demo_model_path, write_model

    if ns.shape not in SHAPES:
        raise FitterError(f"demo-model --shape {ns.shape!r}: unknown shape; known: {', '.join(sorted(SHAPES))}")
    if ns.shape == "demo":
        path = demo_model_path(Path(ns.out) if ns.out else None)
        print(path)
        return 0
    if not ns.out:
        raise FitterError(f"demo-model --shape {ns.shape}: give --out PATH for shapes other than the demo")
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    for p in write_model(SHAPES[ns.shape], Path(ns.out), sparse=ns.sparse, n_shards=ns.shards):
        print(p)
    return 0


def cmd_probe(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.probe import probe, probe_json, probe_table

    result = probe()
    print(json.dumps(probe_json(result), indent=1) if ns.json else probe_table(result))
    return 0


def add_measure_arguments(parser: argparse.ArgumentParser) -> None:
    """What bench and tune measure (llama-bench's -p -n -d -r), where (-C/-Cr) and on what (--backend/--machine)."""
    g = parser.add_argument_group("measurement")
    g.add_argument("-p", "--n-prompt", dest="n_prompt", type=int, default=512, metavar="N")
    g.add_argument("-n", "--n-gen", dest="n_gen", type=int, default=128, metavar="N")
    g.add_argument("-d", "--n-depth", dest="n_depth", type=int, default=0, metavar="N")
    g.add_argument("-r", "--repetitions", dest="repetitions", type=int, default=3, metavar="N")
    g.add_argument("-C", "--cpu-mask", dest="cpu_mask", metavar="M", help="CPU affinity mask (hex), as llama.cpp")
    g.add_argument("-Cr", "--cpu-range", dest="cpu_range", metavar="lo-hi", help="CPU range, as llama.cpp")
    g.add_argument("--backend", choices=("llama-cpp-python", "sim"), default="llama-cpp-python",
                   help="measure with llama.cpp (default) or on a simulated machine (--machine)")
    g.add_argument("--machine", metavar="NAME|FILE", help="the simulated machine (fitter machines lists them)")


def build_parser() -> argparse.ArgumentParser:
    from fitter.launch_config import SERVER_DEFAULTS_HELP, add_launch_arguments

    parser = _Parser(prog="fitter", description="Find the fastest llama.cpp launch settings a machine can hold.")
    parser.add_argument("--version", action="version", version=f"fitter {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    est = sub.add_parser(
        "estimate",
        help="predict every buffer llama.cpp will allocate, from the GGUF header alone",
        description="Predict llama.cpp's memory per buffer and device for a model and a set of llama-server "
        "flags, from the GGUF header alone (no tensor data is read).",
        epilog=SERVER_DEFAULTS_HELP + "\n\nTargets: (none) NVIDIA GPUs seen by NVML, else CPU only; "
        "--devices none; --devices cuda:MiB[,MiB...] (hypothetical GPUs; the CUDA rules are not yet validated "
        "against a CUDA build); --rpc HOST:PORT or --devices rpc:HOST:PORT.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    est.add_argument("model", nargs="?", help="GGUF file or any shard of a split model (default: the demo model)")
    est.add_argument("--devices", default="", help="none | cuda:MiB[,MiB...] | rpc:HOST:PORT[,...]")
    est.add_argument("--json", action="store_true", help="machine-readable output (CONTRACTS.md)")
    est.add_argument("--tensors", action="store_true", help="also list every tensor's buffer type")
    add_launch_arguments(est)
    est.set_defaults(func=cmd_estimate)

    fit = sub.add_parser(
        "fit",
        help="the placement that puts the most on the GPU(s) within free memory minus a target",
        description="Find the placement (-ngl, -ncmoe, -ot) that puts the most weights on the GPU(s) within free "
        "memory minus --fit-target, for the given context, batch and KV choices; with -c 0 also the largest "
        "context that placement allows. Judged by fitter's estimator; nothing is loaded unless --verify.",
        epilog=SERVER_DEFAULTS_HELP + "\n\nTargets: NVIDIA GPUs (NVML free memory), --devices cuda:MiB[,MiB...] "
        "(hypothetical GPUs; CUDA rules not yet validated against a CUDA build), or --emulated-gpu MiB (a capped "
        "llama.cpp RPC device fitter starts on 127.0.0.1: real placement and out-of-memory behaviour, CPU speed). "
        "Exit code 1 when nothing fits.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fit.add_argument("model", nargs="?", help="GGUF file or any shard (default: the demo model)")
    fit.add_argument("--fit-target", default="1024", metavar="MiB[,MiB...]",
                     help="memory to leave free per device (default 1024, as llama.cpp's --fit-target)")
    fit.add_argument("--fit-ctx", type=int, default=4096, metavar="N",
                     help="with -c 0: the context the placement is found at before it grows (default 4096)")
    fit.add_argument("--devices", default="", help="none | cuda:MiB[,MiB...] | rpc:HOST:PORT[,...]")
    fit.add_argument("--emulated-gpu", type=int, metavar="MiB", help="fit onto a capped emulated GPU")
    fit.add_argument("--verify", action="store_true", help="load the result on the emulated GPU and report it")
    fit.add_argument("--json", action="store_true")
    add_launch_arguments(fit)
    fit.set_defaults(func=cmd_fit)

    bench = sub.add_parser(
        "bench",
        help="measure prefill and decode speed of one llama.cpp configuration at its deployed context",
        description="A warm-up, then -r repetitions of a prefill of -p tokens and a decode of -n tokens after -d "
        "tokens of context, like llama-bench, but in a context allocated at the deployed size, so a passing run "
        "proves the configuration fits. Buffers are shown beside fitter's estimate. Exit code 1 on oom, crash or "
        "timeout (a state, never a zero speed).",
        epilog=SERVER_DEFAULTS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("model", nargs="?", help="GGUF file or any shard (default: the demo model)")
    bench.add_argument("-t", "--threads", dest="threads", type=int, default=None, metavar="N",
                       help="threads (default: the physical performance cores, as fitter probe counts them)")
    bench.add_argument("-tb", "--threads-batch", dest="threads_batch", type=int, default=None, metavar="N",
                       help="threads for prefill (default: -t)")
    bench.add_argument("--timeout", type=float, default=None, metavar="S",
                       help="seconds before a trial counts as hung (default: from the predicted work)")
    bench.add_argument("--emulated-gpu", type=int, metavar="MiB", help="run on a capped emulated GPU")
    bench.add_argument("--llama-server", metavar="PATH", help="measure this llama-server binary instead")
    bench.add_argument("--llama-bench", metavar="PATH",
                       help="measure with this llama-bench binary instead (its context is p+n+d, not the deployed one)")
    bench.add_argument("--devices", default="", help=argparse.SUPPRESS)
    bench.add_argument("--seed", type=int, default=None, help="the simulated machine's noise seed")
    bench.add_argument("--json", action="store_true")
    add_measure_arguments(bench)
    add_launch_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    tune = sub.add_parser(
        "tune",
        help="find the fastest llama.cpp settings this machine can hold (Optuna over real measured trials)",
        description="A constrained multi-objective Optuna study: decode t/s, prefill t/s and peak VRAM over the search "
        "space (-ncmoe/-ngl, -b/-ub, -ctk/-ctv, -fa, -t/-tb), under the free-VRAM target and host RAM. Every config "
        "is screened by the estimator first (predicted over budget: never launched); every launched trial is "
        "measured like `fitter bench` at the deployed context. Trial 0 is llama.cpp's own --fit choice, the "
        "baseline. The Pareto-optimal configs are re-measured and written with the picks to "
        "results/<model>/<machine>/<llama.cpp build>/pareto.json; a killed tune resumes from study.db.",
        epilog=SERVER_DEFAULTS_HELP + "\n\nThe context (-c), slots (-np) and other llama.cpp flags you give are "
        "fixed; a searched flag you give (e.g. -ub 512) is removed from the search.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune.add_argument("model", nargs="?", help="GGUF file or any shard (default: the demo model)")
    tune.add_argument("--space", metavar="FILE", help="search space TOML (default: shipped moe, dense or cpu)")
    tune.add_argument("--objectives", default="tg,pp,vram", metavar="LIST",
                      help="any of tg (decode t/s), pp (prefill t/s), vram (peak VRAM) (default: tg,pp,vram)")
    tune.add_argument("--fit-target", default=None, metavar="MiB[,MiB...]",
                      help="memory to leave free per device (default 1024, as llama.cpp's --fit-target)")
    tune.add_argument("--trials", type=int, default=12, metavar="N",
                      help="launched trials in the study, the baseline included (default 12)")
    tune.add_argument("--timeout", type=float, default=None, metavar="S", help="stop launching after S seconds")
    tune.add_argument("--trial-timeout", type=float, default=None, metavar="S",
                      help="seconds before a trial counts as hung (default: from the predicted work)")
    tune.add_argument("--dry-run", action="store_true",
                      help="show the space, the feasible region and the planned first trials; launch nothing")
    tune.add_argument("--storage", metavar="URL", help="any Optuna storage URL (default: the results folder's "
                      "study.db); e.g. postgresql://… for a fleet of identical machines")
    tune.add_argument("--results", default="results", metavar="DIR", help="results root (default ./results)")
    tune.add_argument("--emulated-gpu", type=int, metavar="MiB", help="tune on a capped emulated GPU")
    tune.add_argument("--llama-fit-params", metavar="PATH", help="llama.cpp's llama-fit-params for the baseline")
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument("-t", "--threads", dest="threads", type=int, default=None, metavar="N",
                      help="fix the threads (removes threads from the search)")
    tune.add_argument("-tb", "--threads-batch", dest="threads_batch", type=int, default=None, metavar="N",
                      help="fix the batch threads (removes threads-batch from the search)")
    tune.add_argument("--json", action="store_true", help="print pareto.json instead of the table")
    add_measure_arguments(tune)
    add_launch_arguments(tune)
    tune.set_defaults(func=cmd_tune)

    export = sub.add_parser("export", help="a tuned config for a launcher (llama-server, llama-swap, python, ...)",
                            description="Render the picked config of a tuning result (the folder with pareto.json) "
                            "for a launcher, pinning everything llama-server would otherwise decide itself.")
    export.add_argument("result", help="a results folder (or its pareto.json)")
    export.add_argument("--policy", default="balanced",
                        choices=("max-decode", "max-prefill", "balanced", "min-vram"))
    export.add_argument("--format", default="server", choices=("server", "preset-ini", "llama-swap", "python", "json"))
    export.set_defaults(func=cmd_export)

    check = sub.add_parser(
        "check", help="re-measure a tuned config; exit 1 when it got slower or no longer fits (a CI step)",
        description="Re-measure the picked config of a tuning result (the folder with pareto.json) on this machine "
        "with "
        "its recorded flags, threads and -p/-n/-d/-r, and compare it with the recorded confirm run. Exit 1 with a diff "
        "when pp or tg fell below old·(1 − tolerance) − 2·√(σ_old² + σ_new²), or when the config no longer fits (the "
        "run ends out of memory, or the estimator puts it over free memory less the recorded fit target); else 0.")
    check.add_argument("result", help="a results folder (or its pareto.json)")
    check.add_argument("--policy", default="balanced", choices=("max-decode", "max-prefill", "balanced", "min-vram"))
    check.add_argument("--tolerance", default="5%", metavar="PCT",
                       help="slowdown allowed beyond noise, as 5%% or 0.05 (default 5%%)")
    check.add_argument("--model", metavar="PATH", help="the tuned GGUF at another path (its header must match)")
    check.add_argument("--timeout", type=float, default=None, metavar="S",
                       help="seconds before the run counts as hung (default: from the predicted work)")
    check.add_argument("--json", action="store_true", help="the verdict, each check and the new measurement as JSON")
    check.set_defaults(func=cmd_check)

    report = sub.add_parser(
        "report", help="tables and figures of a tuning result, finished or still running",
        description="The trials table, the Pareto front with ratios over llama.cpp's own choice, and figures (PNG and "
        "an offline report.html): decode vs VRAM, optimisation history, parameter importances, predicted vs "
        "measured device memory. Reads the study without changing it.")
    report.add_argument("result", help="a results folder with study.db (or its pareto.json)")
    report.add_argument("--out", metavar="DIR",
                        help="where to write the CSVs, PNGs and report.html (default: RESULT/report)")
    report.add_argument("--json", action="store_true", help="the tables, warnings and file paths as JSON")
    report.set_defaults(func=cmd_report)

    machines = sub.add_parser("machines", help="the shipped simulated machines (--backend sim --machine NAME)",
                              description="The simulated machines fitter ships (fitter/machines/*.toml): physical "
                              "parameters only; `--backend sim --machine NAME|FILE` runs bench and tune on them.")
    machines.set_defaults(func=cmd_machines)

    demo = sub.add_parser("demo-model", help="write the demo model (or a test shape) and print its path")
    demo.add_argument("--out", help="where to write it (default: fitter's cache)")
    demo.add_argument("--shape", default="demo", help="demo (default) or a test shape, e.g. gpt-oss-120b")
    demo.add_argument("--sparse", action="store_true", help="header only; the data region is a hole")
    demo.add_argument("--shards", type=int, default=1)
    demo.set_defaults(func=cmd_demo_model)

    probe = sub.add_parser("probe", help="report this machine's GPUs, CPU, RAM and llama.cpp build",
                           description="Report what this machine offers llama.cpp: NVIDIA GPUs (NVML), CPU topology "
                           "and ISA, RAM, and the installed llama-cpp-python build.")
    probe.add_argument("--json", action="store_true", help="machine-readable output (shape: fitter/probe.py)")
    probe.set_defaults(func=cmd_probe)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    flags = _llama_flags(argv, getattr(ns, "model", None))
    try:
        result: int = ns.func(ns, flags)
        return result
    except FitterError as e:
        print(f"fitter: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _llama_flags(argv: list[str], model: str | None) -> list[str]:
    """The llama.cpp flags as given: the command, the model path and fitter's own options dropped."""
    own = {"--devices": 1, "--json": 0, "--tensors": 0, "--fit-target": 1, "--fit-ctx": 1, "--emulated-gpu": 1,
           "--verify": 0, "-p": 1, "--n-prompt": 1, "-n": 1, "--n-gen": 1, "-d": 1, "--n-depth": 1, "-r": 1,
           "--repetitions": 1, "-t": 1, "--threads": 1, "--timeout": 1, "--llama-server": 1, "--llama-bench": 1,
           "-C": 1, "--cpu-mask": 1, "-Cr": 1, "--cpu-range": 1, "--space": 1, "--objectives": 1, "--trials": 1,
           "--trial-timeout": 1, "--dry-run": 0, "--storage": 1, "--results": 1, "--llama-fit-params": 1,
           "--seed": 1, "--policy": 1, "--format": 1, "--tolerance": 1, "--backend": 1, "--machine": 1,
           "-tb": 1, "--threads-batch": 1, "--out": 1}
    out, i = [], 1  # argv[0] is the command
    while i < len(argv):
        a = argv[i]
        if a in own:
            i += 1 + own[a]
            continue
        if a == model:
            model = None  # drop its first occurrence only
        else:
            out.append(a)
        i += 1
    return out


if __name__ == "__main__":
    raise SystemExit(main())
