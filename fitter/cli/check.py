"""`fitter check`: re-measure a tuned config; exit 1 when it got slower or no longer fits (a CI step)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fitter.cli.common import log, warn
from fitter.errors import FitterError
from fitter.flags.consumers import CONSUMER_NAMES
from fitter.results.pareto import POLICIES

if TYPE_CHECKING:
    from fitter.machine.snapshot import MachineSnapshot
    from fitter.measure.runners import RunnerFactory


def cmd_check(ns: argparse.Namespace, runner_factory: RunnerFactory | None = None) -> int:
    """0 when the pick holds, 1 with the diff when it fell or no longer fits (a FitterError becomes the CLI's exit
    code 2). `runner_factory` defaults to what the result was tuned on (fitter.check.run.runner_factory_for)."""
    from fitter.check.run import parse_tolerance, run_check, runner_factory_for, verdict_json, verdict_text
    from fitter.machine.snapshot import gpus_now, take_snapshot

    tolerance = parse_tolerance(str(ns.tolerance))
    snapshot = _listed(take_snapshot(), Path(ns.result))
    model = getattr(ns, "model", None)
    factory = runner_factory or runner_factory_for(Path(ns.result), snapshot, model)
    log(f"fitter: check: re-measuring the {ns.policy} pick of {ns.result}")
    built = _build_devices(Path(ns.result))
    verdict = run_check(Path(ns.result), ns.policy, tolerance, factory, model=model,
                        timeout=getattr(ns, "timeout", None), cpu=snapshot.cpu_profile,
                        machine_devices=lambda: built if built is not None else (
                            (gpus_now(snapshot) or snapshot.devices()) if snapshot.gpus else ()),
                        consumer=getattr(ns, "consumer", None),
                        machine_gpus=lambda: snapshot.record()["gpu_map"], perplexity=_perplexity(Path(ns.result)))
    for w in verdict.warnings:
        warn(w)
    print(json.dumps(verdict_json(verdict), indent=1) if ns.json else verdict_text(verdict))
    return 0 if verdict.ok else 1


def _build_devices(result: Path) -> Any:
    """The devices of the build a result was tuned through (`--llama-cpp DIR`), as it lists them now, for the fit
    check; refused when they or its backends are not those it was tuned on (fitter.measure.llamacpp.builds
    .build_change). None for a result tuned otherwise."""
    from fitter.measure.llamacpp.builds import recorded_build_devices
    from fitter.results.pareto import load_result

    try:
        doc = load_result(result)
    except FitterError:
        return None  # run_check reports the unreadable result
    binary = doc.llama_cpp.get("llama_server")
    if not isinstance(binary, str) or not Path(binary).is_file() or "build_devices" not in doc.machine:
        return None
    return recorded_build_devices(doc.machine, doc.llama_cpp, binary, doc.source)


def _listed(snapshot: MachineSnapshot, result: Path) -> MachineSnapshot:
    """The snapshot with the device list of the llama-server the result was tuned with, when it is still there and
    this machine has GPUs: which GPU it calls CUDA0, as the tune read it (fitter.machine.gpu_order)."""
    from fitter.errors import FitterError
    from fitter.measure.llamacpp.builds import listed_by
    from fitter.results.pareto import load_result

    if not snapshot.gpus:
        return snapshot
    try:
        binary = load_result(result).llama_cpp.get("llama_server")
    except FitterError:
        return snapshot  # run_check reports the unreadable result
    return listed_by(snapshot, binary if isinstance(binary, str) and Path(binary).is_file() else None)


def register(sub: Any) -> None:
    check = sub.add_parser(
        "check", help="re-measure a tuned config; exit 1 when it got slower or no longer fits (a CI step)",
        description="Re-measure the picked config of a tuning result (the folder with pareto.json) on this machine "
        "with its recorded flags, threads and -p/-n/-d/-r, and compare it with the recorded confirm run. Exit 1 with a "
        "diff when pp or tg fell below old·(1 − tolerance) − 2·√(σ_old² + σ_new²), or when the config no longer fits "
        "(the run ends out of memory, or the estimator puts it over free memory less the recorded fit target); else 0.")
    check.add_argument("result", help="a results folder (or its pareto.json)")
    check.add_argument("--policy", default="balanced", choices=POLICIES)
    check.add_argument("--tolerance", default="5%", metavar="PCT",
                       help="slowdown allowed beyond noise, as 5%% or 0.05 (default 5%%)")
    check.add_argument("--model", metavar="PATH", help="the tuned GGUF at another path (its header must match)")
    check.add_argument("--timeout", type=float, default=None, metavar="S",
                       help="seconds before the run counts as hung (default: from the predicted work)")
    check.add_argument("--for", dest="consumer", choices=CONSUMER_NAMES, default=None, metavar="PROGRAM",
                       help="check the pick as this program runs it: " + " | ".join(CONSUMER_NAMES)
                       + " (default: the program it was tuned for)")
    check.add_argument("--json", action="store_true", help="the verdict, each check and the new measurement as JSON")
    check.set_defaults(func=cmd_check)


def _perplexity(result: Path) -> Path | None:
    """The build's llama-perplexity for a result that recorded quality (fitter.check.quality_recheck), else None."""
    from fitter.check.quality_recheck import perplexity_for
    from fitter.results.pareto import load_result

    try:
        doc = load_result(result)
    except FitterError:
        return None  # run_check reports the unreadable result
    return perplexity_for(doc) if any(e.quality is not None for e in doc.pareto) else None
