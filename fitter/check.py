"""`fitter check`: re-measure the picked config of a tuning result on this machine and say whether it still holds.

A step for users' CI: pin a tuned config, and let a new llama.cpp build, driver or machine image fail the pipeline
when it made that config slower or when the config no longer fits.

- **Slower**: for prefill (pp) and decode (tg) each, the re-measurement fails when
  `new_avg < old_avg·(1 − tolerance) − 2·√(σ_old² + σ_new²)` (σ: each measurement's `stddev_ts` over its
  repetitions), i.e. when it fell by more than the tolerance beyond what the two runs' noise explains.
- **No longer fits**: the re-measurement ends `oom` (any failed outcome fails), or the estimator predicts the config
  over a device's budget: its free memory now minus the fit target the result recorded (for fitter's emulated GPU,
  free = its cap).

The re-measurement repeats the recorded one: the same pinned flags, threads (`-t`/`-tb`), prompt, generation,
depth and repetitions (read back from the recorded pp/tg: `n`, `depth`, the number of samples). A result measured
on the emulated GPU carries the `--rpc` endpoint of a server long gone: a fresh emulated GPU of the same cap is
started and its endpoint put in its place.

`compare`, `regression_threshold` and `parse_tolerance` are pure; `run_check` does the I/O through a runner factory
(fitter's worker, or a simulated machine's runner), so tests drive it with a fake.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from fitter.devices import Device, detect_cpu_profile
from fitter.errors import FitterError
from fitter.estimator import estimate
from fitter.fit import DEFAULT_FIT_TARGET_MIB
from fitter.launch_config import LaunchConfig, parse_launch_flags, split_process_flags
from fitter.launcher_export import POLICIES, picked_entry
from fitter.screen import device_totals
from fitter.trial_runner import TrialResult
from fitter.worker import BenchSpec

MIB = 1024 * 1024
METRICS = (("pp", "prefill"), ("tg", "decode"))


class CheckRunner(Protocol):
    """What `run_check` needs of a runner: fitter.trial_runner.WorkerRunner's interface (a simulated machine's
    runner has the same)."""

    backend: str
    emulated: bool

    @property
    def rpc(self) -> tuple[str, ...]: ...

    def devices(self) -> tuple[Device, ...]: ...

    def build(self) -> dict[str, str]: ...

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None) -> TrialResult: ...

    def __enter__(self) -> CheckRunner: ...

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None: ...


# Called as factory(emulated_gpu_mib=MiB | None, cpus=(cpu, …) | None), like WorkerRunner's constructor.
RunnerFactory = Callable[..., AbstractContextManager[CheckRunner]]


@dataclass(frozen=True)
class CheckVerdict:
    ok: bool
    lines: tuple[str, ...]  # the readable diff: per metric old avg±σ, new avg±σ, threshold, PASS/FAIL
    measurement: dict[str, Any] | None  # the new bench JSON
    failures: tuple[str, ...] = ()  # one short reason per failed check (empty when ok)
    details: dict[str, Any] = field(default_factory=dict)  # the same, machine-readable (for --json)


# -- pure ------------------------------------------------------------------------------------------------------


def regression_threshold(old_avg: float, old_sd: float, new_sd: float, tolerance: float) -> float:
    """The lowest new average that is not a regression: the tolerance below the old average, less twice the
    combined standard deviation of the two measurements (noise)."""
    return old_avg * (1 - tolerance) - 2 * math.sqrt(old_sd ** 2 + new_sd ** 2)


def parse_tolerance(text: str) -> float:
    """`5%` → 0.05, `0.05` → 0.05; a fraction in [0, 1)."""
    raw = text.strip()
    percent = raw.endswith("%")
    try:
        value = float(raw.removesuffix("%").strip())
    except ValueError:
        value = math.nan
    if percent:
        value /= 100
    if not math.isfinite(value) or not 0 <= value < 1:
        hint = f" (did you mean {raw}%?)" if not percent and math.isfinite(value) and 1 <= value < 100 else ""
        raise FitterError(f"--tolerance {text!r}: expected a percentage such as 5% or a fraction such as 0.05, "
                          f"at least 0 and below 100 %{hint}")
    return value


def compare(old: dict[str, Any], new: dict[str, Any], tolerance: float) -> CheckVerdict:
    """The recorded measurement against the re-measurement (both `fitter bench --json` shapes): each of pp and tg
    the old one has passes unless the new average is below `regression_threshold`; a failed new outcome fails."""
    recorded = [(k, label, o) for k, label in METRICS if (o := _stats(old, k)) is not None]
    if old.get("outcome") != "ok" or not recorded:
        raise FitterError(f"the recorded measurement ended {old.get('outcome')!r} with no pp/tg speeds: nothing to "
                          "compare against")
    lines = [_build_line(old, new)] if _commit(old) or _commit(new) else []
    if new.get("outcome") != "ok":
        outcome = new.get("outcome") or "unknown"
        reason = " ".join(str(new.get("reason") or "no reason given").split())
        what = "no longer fits (out of memory)" if outcome == "oom" else "no longer runs"
        lines.append(f"FAIL  {what}: {outcome}: {reason}")
        return CheckVerdict(False, tuple(lines), new, (f"no longer runs: {outcome}",),
                            {"outcome": outcome, "reason": reason, "metrics": {}})
    failures, metrics = [], {}
    for key, label, o in recorded:
        n = _stats(new, key)
        if n is None:
            lines.append(f"{key}  {label}: recorded {o[0]:.2f} t/s, not measured now  FAIL")
            failures.append(f"{key} not measured")
            metrics[key] = {"old_avg": o[0], "old_sd": o[1], "new_avg": None, "new_sd": None, "threshold": None,
                            "pass": False}
            continue
        threshold = regression_threshold(o[0], o[1], n[1], tolerance)
        passed = n[0] >= threshold
        change = (n[0] - o[0]) / o[0] * 100 if o[0] else 0.0
        lines.append(f"{key}  {label:<8} old {o[0]:10.2f} ± {o[1]:<8.2f} new {n[0]:10.2f} ± {n[1]:<8.2f} "
                     f"{change:+7.1f} %  threshold {threshold:10.2f}  {'PASS' if passed else 'FAIL'}")
        if not passed:
            failures.append(f"{key} {n[0]:.2f} t/s < threshold {threshold:.2f} t/s ({change:+.1f} %)")
        metrics[key] = {"old_avg": o[0], "old_sd": o[1], "new_avg": n[0], "new_sd": n[1],
                        "threshold": threshold, "change_pct": round(change, 2), "pass": passed}
    return CheckVerdict(not failures, tuple(lines), new, tuple(failures),
                        {"outcome": "ok", "metrics": metrics})


def _stats(m: dict[str, Any], key: str) -> tuple[float, float] | None:
    s = m.get(key)
    if not isinstance(s, dict) or not isinstance(s.get("avg_ts"), int | float):
        return None
    sd = s.get("stddev_ts")
    return float(s["avg_ts"]), float(sd) if isinstance(sd, int | float) else 0.0


def _commit(m: dict[str, Any]) -> str | None:
    c = (m.get("llama_cpp") or {}).get("commit")
    return c if isinstance(c, str) and c else None


def _build_line(old: dict[str, Any], new: dict[str, Any]) -> str:
    def where(m: dict[str, Any]) -> str:
        return f"{_commit(m) or 'unknown'} ({m.get('backend') or 'unknown backend'})"

    return f"llama.cpp: recorded with {where(old)}, re-measured with {where(new)}"


def fit_lines(totals: dict[str, int], devices: tuple[Device, ...],
              targets_mib: tuple[int, ...]) -> tuple[list[str], list[str], dict[str, Any]]:
    """(lines, failures, details): each device's predicted total against its free memory less the fit target
    (pure). A device whose free memory is unknown (an RPC server fitter cannot ask) is reported, not judged."""
    lines: list[str] = []
    failures: list[str] = []
    details: dict[str, Any] = {}
    if not devices:
        lines.append("fit  no GPU in this config: the run itself is the check")
    for i, d in enumerate(devices):
        target = targets_mib[i if len(targets_mib) > 1 else 0] if targets_mib else DEFAULT_FIT_TARGET_MIB
        predicted = totals.get(d.name, 0)
        free = d.free_bytes if d.free_bytes is not None else d.total_bytes
        if free is None:
            lines.append(f"fit  {d.name}: predicted {predicted / MIB:.2f} MiB; free memory unknown: not checked")
            details[d.name] = {"predicted_bytes": predicted, "free_bytes": None, "fit_target_mib": target,
                               "budget_bytes": None, "pass": None}
            continue
        budget = free - target * MIB
        passed = predicted <= budget
        lines.append(f"fit  {d.name}: predicted {predicted / MIB:.2f} MiB, budget {budget / MIB:.2f} MiB (free "
                     f"{free / MIB:.2f} − fit target {target} MiB)  {'PASS' if passed else 'FAIL'}")
        if not passed:
            failures.append(f"no longer fits: {d.name} predicted {predicted / MIB:.2f} MiB over its budget "
                            f"{budget / MIB:.2f} MiB by {(predicted - budget) / MIB:.2f} MiB")
        details[d.name] = {"predicted_bytes": predicted, "free_bytes": free, "fit_target_mib": target,
                           "budget_bytes": budget, "pass": passed}
    return lines, failures, details


def verdict_text(v: CheckVerdict) -> str:
    """The diff, then one line saying PASS or FAIL and why."""
    last = "check: PASS" if v.ok else "check: FAIL: " + "; ".join(v.failures)
    return "\n".join([*v.lines, last])


def verdict_json(v: CheckVerdict) -> dict[str, Any]:
    return {"ok": v.ok, "failures": list(v.failures), "lines": list(v.lines), **v.details,
            "measurement": v.measurement}


# -- the result, its pick and its bench spec (pure) ---------------------------------------------------------------




def recorded_spec(measurement: dict[str, Any], threads: int, threads_batch: int, where: str) -> BenchSpec:
    """The bench spec a recorded measurement was taken with: -p from pp.n, -n and -d from tg.n and tg.depth, -r from
    the number of samples (a confirm run's repetitions)."""
    pp, tg = measurement.get("pp"), measurement.get("tg")
    first = tg if isinstance(tg, dict) else pp
    try:
        if not isinstance(first, dict):
            raise TypeError("neither pp nor tg")
        return BenchSpec(n_prompt=int(pp["n"]) if isinstance(pp, dict) else 0,
                         n_gen=int(tg["n"]) if isinstance(tg, dict) else 0,
                         n_depth=int(first.get("depth", 0)), repetitions=len(first["samples_ts"]),
                         threads=threads, threads_batch=threads_batch)
    except (KeyError, TypeError, ValueError, FitterError) as e:
        raise FitterError(f"{where}: its measurement has no usable pp/tg n, depth and samples_ts ({e}): cannot "
                          "repeat it") from None


def _threads(value: str | None, flag: str, where: str) -> int:
    try:
        n = int(value) if value is not None else 0
    except ValueError:
        n = 0
    if n < 1:
        raise FitterError(f"{where}: {flag} {value!r}: expected a thread count >= 1 (the picked flags pin -t and -tb)")
    return n


def with_endpoint(flags: list[str], old: str, new: str) -> list[str]:
    """`flags` with every mention of an RPC endpoint (the `--rpc` value, `-ot …=RPC0[old]`) moved to another."""
    return [f.replace(old, new) for f in flags]


def load_result(result: Path) -> tuple[dict[str, Any], Path]:
    """pareto.json of a results folder (or the file itself), as a dict, and its path."""
    path = result / "pareto.json" if result.is_dir() else result
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise FitterError(f"{path}: cannot read the tuning result: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FitterError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise FitterError(f"{path}: expected a JSON object written by `fitter tune`")
    if not isinstance(doc.get("picks"), dict) or not doc["picks"]:
        raise FitterError(f"{path}: no \"picks\" (the tune found no confirmed configuration?); nothing to check")
    return doc, path


# -- the check (I/O through the runner) ---------------------------------------------------------------------------


def run_check(result_dir: Path, policy: str, tolerance: float, runner_factory: RunnerFactory, *,
              model: str | None = None, timeout: float | None = None,
              local_devices: Callable[[LaunchConfig], tuple[Device, ...]] | None = None) -> CheckVerdict:
    """Re-measure the `policy` pick of a tuning result and compare it with its recorded confirm run.

    `runner_factory(emulated_gpu_mib=…, cpus=…)` returns a context-managed runner (WorkerRunner, a simulated
    machine's runner, a fake). The devices the fit is checked against are the runner's own (the emulated GPU), else
    `local_devices(config)` (default: the config's `--rpc` servers, else this machine's GPUs through NVML).
    `model` replaces the recorded GGUF path (the same file elsewhere; its header identity must match)."""
    from fitter.bench import parse_cpu_mask
    from fitter.tune import measurement_json

    doc, path = load_result(Path(result_dir))
    if policy not in POLICIES:
        raise FitterError(f"--policy {policy!r}: unknown policy; choose one of {', '.join(POLICIES)}")
    entry = picked_entry(doc, policy, str(path))
    where = f"{path}: the {policy} pick (trial {entry.get('trial')})"
    old = entry.get("measurement")
    if not isinstance(old, dict) or old.get("outcome") != "ok":
        raise FitterError(f"{where}: no ok measurement recorded; nothing to compare against")
    flags = entry.get("flags")
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise FitterError(f"{where}: \"flags\" must be a list of strings, got {flags!r}")
    launch, process = split_process_flags(flags, where)
    threads = _threads(process.get("-t"), "-t", where)
    threads_batch = _threads(process.get("-tb", process.get("-t")), "-tb", where)
    spec = recorded_spec(old, threads, threads_batch, where)
    cpus = parse_cpu_mask(process.get("-C"), process.get("-Cr"))

    model_path, model_spec = _model(doc, path, model)
    emulated = bool(doc.get("emulated") or old.get("emulated"))
    cap = _emulated_cap(doc, path) if emulated else None
    raw_targets = doc.get("fit_target_mib") or [DEFAULT_FIT_TARGET_MIB]
    if not isinstance(raw_targets, list) or not all(isinstance(t, int) for t in raw_targets):
        raise FitterError(f"{path}: \"fit_target_mib\" must be a list of integers (MiB), got {raw_targets!r}")
    targets = tuple(raw_targets)

    with runner_factory(emulated_gpu_mib=cap, cpus=cpus) as runner:
        if emulated:
            launch = _to_fresh_gpu(launch, runner.rpc, where)
        try:
            config = parse_launch_flags(launch)
        except FitterError as e:
            raise FitterError(f"{where}: {e}") from None
        devices = tuple(runner.devices()) or (local_devices or _local_devices)(config)
        header = [f"check: {policy} pick (trial {entry.get('trial')}) of {path}, tolerance {tolerance * 100:g} %",
                  f"flags: {' '.join(flags)}"]
        if emulated:
            header.append(f"on a fresh emulated GPU of {cap} MiB at {', '.join(runner.rpc) or '?'} (the recorded "
                          "one is gone)")
        fits: tuple[list[str], list[str], dict[str, Any]]
        try:
            plan: Any = estimate(model_spec, config, devices, detect_cpu_profile())
        except FitterError as e:  # llama.cpp would now refuse it: still measured, to show what it does
            plan, fits = None, ([f"fit  the estimator refuses the config: {e}"], [f"refused: {e}"], {})
        else:
            fits = fit_lines(device_totals(plan), devices, targets)
        result = runner.run(model_path, config, spec, timeout)
        new = measurement_json(result, runner.backend, plan, runner.emulated)
    speed = compare(old, new, tolerance)
    fit_text, fit_failures, fit_details = fits
    lines = (*header, *speed.lines, *fit_text, *_vram_lines(entry, new))
    failures = (*speed.failures, *fit_failures)
    details = {"result": str(path), "policy": policy, "trial": entry.get("trial"), "tolerance": tolerance,
               "flags": list(flags), **speed.details, "fit": fit_details}
    return CheckVerdict(not failures, lines, new, failures, details)


def _model(doc: dict[str, Any], path: Path, override: str | None) -> tuple[str, Any]:
    from fitter.model_spec import load_model_spec

    recorded = doc.get("model") or {}
    model = override or recorded.get("path")
    if not isinstance(model, str) or not model:
        raise FitterError(f"{path}: no model.path; give the GGUF file with --model")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        try:
            spec = load_model_spec(model)
        except FitterError as e:
            raise FitterError(f"{e} (the model {path} was tuned on; give it with --model PATH)") from None
    identity = recorded.get("identity")
    if identity and spec.identity != identity:
        raise FitterError(f"{model}: not the model {path} was tuned on (header identity {spec.identity} != "
                          f"{identity}); a check compares the same model")
    return model, spec


def _emulated_cap(doc: dict[str, Any], path: Path) -> int:
    cap = (doc.get("machine") or {}).get("emulated_gpu_mib")
    if not isinstance(cap, int) or cap < 1:
        raise FitterError(f"{path}: measured on the emulated GPU but machine.emulated_gpu_mib is {cap!r}: cannot "
                          "start one of the same cap")
    return cap


def _to_fresh_gpu(launch: list[str], rpc: tuple[str, ...], where: str) -> list[str]:
    """The emulated GPU's old endpoint replaced by the fresh one's, wherever the flags name it."""
    old: list[str] = []
    for i, f in enumerate(launch):
        if f in ("--rpc", "-rpc") and i + 1 < len(launch):
            old += [x for x in launch[i + 1].split(",") if x]
    if not old:
        return launch
    if len(old) > 1 or len(rpc) != 1:
        raise FitterError(f"{where}: --rpc {','.join(old)} on the emulated GPU: expected one endpoint to replace "
                          f"with the fresh emulated GPU's, the runner has {len(rpc)}")
    return with_endpoint(launch, old[0], rpc[0])


def _local_devices(config: LaunchConfig) -> tuple[Device, ...]:
    from fitter.devices import detect_gpus, rpc_devices

    if config.rpc:
        return rpc_devices(list(config.rpc))
    return tuple(detect_gpus())


def _vram_lines(entry: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Peak device memory then and now (information, not judged: the fit check judges memory)."""
    peak = new.get("peak_vram") or {}
    if not peak or new.get("outcome") != "ok":
        return []
    now = sum(int(p["bytes"]) for p in peak.values()) / MIB
    then = entry.get("vram_bytes")
    before = f"recorded {then / MIB:.2f} MiB, " if isinstance(then, int | float) else ""
    return [f"vram {before}now {now:.2f} MiB (peak, {', '.join(sorted({p['source'] for p in peak.values()}))})"]


# -- the command line's edge ---------------------------------------------------------------------------------------


def cmd_check(ns: argparse.Namespace, flags: list[str], runner_factory: RunnerFactory | None = None) -> int:
    """`fitter check RESULT [--policy P] [--tolerance 5%] [--model PATH] [--timeout S] [--json]`: 0 when the pick
    holds, 1 with the diff when it fell or no longer fits (a FitterError becomes the CLI's exit code 2).
    `runner_factory` defaults to fitter's worker (with NVML peaks when this machine has NVIDIA GPUs)."""
    tolerance = parse_tolerance(str(ns.tolerance))
    if runner_factory is None:
        from functools import partial

        from fitter.devices import detect_gpus
        from fitter.trial_runner import WorkerRunner

        runner_factory = partial(WorkerRunner, nvml=bool(detect_gpus()))
    print(f"fitter: check: re-measuring the {ns.policy} pick of {ns.result}", file=sys.stderr, flush=True)
    verdict = run_check(Path(ns.result), ns.policy, tolerance, runner_factory, model=getattr(ns, "model", None),
                        timeout=getattr(ns, "timeout", None))
    print(json.dumps(verdict_json(verdict), indent=1) if ns.json else verdict_text(verdict))
    return 0 if verdict.ok else 1
