"""`fitter check`: re-measure the picked config of a tuning result on this machine and say whether it still holds.

A step for users' CI: pin a tuned config, and let a new llama.cpp build, driver or machine image fail the pipeline
when it made that config slower or when the config no longer fits.

- **Slower**: for prefill (pp) and decode (tg) each, the re-measurement fails when
  `new_avg < old_avg·(1 − tolerance) − 2·√(σ_old² + σ_new²)`, i.e. when it fell by more than the tolerance beyond
  what noise explains. σ is the noise *between runs*: the standard deviation of the recorded config's averages over
  its interleaved confirm rounds (fitter.tune.confirm), for both runs, since the new run is one more run of the same
  config on the same machine. On a shared machine runs differ far more than one run's repetitions do (decode
  260-408 t/s in six runs whose own spread was 2-15 %), so the within-run `stddev_ts` would fail healthy configs.
  A result without rounds (written before them) falls back to each run's `stddev_ts` (`--json`: `noise`).
- **No longer fits**: the re-measurement ends `oom` (any failed outcome fails), or the estimator predicts the config
  over a device's budget: its free memory now minus the fit target the result recorded (for fitter's emulated GPU,
  free = its cap).

The re-measurement repeats the recorded one: the same pinned flags, threads (`-t`/`-tb`), prompt, generation,
depth and repetitions (read back from the recorded pp/tg: `n`, `depth`; the confirm rounds' repetitions). A result
measured on the emulated GPU carries the `--rpc` endpoint of a server long gone: a fresh emulated GPU of the same cap is
started and its endpoint put in its place.

`compare`, `regression_threshold` and `parse_tolerance` are pure; `run_check` does the I/O through a runner factory
(fitter's worker, or a simulated machine's runner), so tests drive it with a fake.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from fitter.check.quality_recheck import recheck_quality
from fitter.errors import FitterError, LaunchConfigError
from fitter.flags import ProcessFlags, parse_launch_flags, split_process_flags
from fitter.flags.consumers import retarget
from fitter.flags.parse import flag_value, process_flags_of, with_endpoints
from fitter.gguf.model_spec import ModelSpec, with_draft
from fitter.gguf.projector import with_projector
from fitter.machine.gpu_order import gpu_map_text
from fitter.machine.snapshot import MachineSnapshot
from fitter.measure.runners import RunnerFactory, ServerRunner, WorkerRunner
from fitter.measure.served import WorkloadRunner
from fitter.measure.types import BenchSpec
from fitter.memory.backends.devices import CPU_AVX2, CpuProfile, Device, rpc_devices
from fitter.memory.fit.budgets import DEFAULT_FIT_TARGET_MIB, device_budgets, target_of
from fitter.memory.plan.estimator import MemoryPlan, estimate
from fitter.noise import between_run_sd
from fitter.results.measurement import measurement_json, round_avgs, vram_bytes
from fitter.results.pareto import Entry, ParetoDoc, load_result, recorded_model
from fitter.search.screen import device_totals
from fitter.units import MIB
from fitter.workload import Workload

METRICS = (("pp", "prefill"), ("tg", "decode"))


@dataclass(frozen=True)
class CheckVerdict:
    ok: bool
    lines: tuple[str, ...]  # the readable diff: per metric old avg±σ, new avg±σ, threshold, PASS/FAIL
    measurement: dict[str, Any] | None  # the new bench JSON
    failures: tuple[str, ...] = ()  # one short reason per failed check (empty when ok)
    details: dict[str, Any] = field(default_factory=dict)  # the same, machine-readable (for --json)
    warnings: tuple[str, ...] = ()  # about the model and its estimate, for the command to print


# -- pure ------------------------------------------------------------------------------------------------------


def regression_threshold(old_avg: float, old_sd: float, new_sd: float, tolerance: float) -> float:
    """The lowest new average that is not a regression: the tolerance below the old average, less twice the
    combined standard deviation of the two measurements (noise)."""
    return old_avg * (1 - tolerance) - 2 * math.hypot(old_sd, new_sd)  # hypot: no overflow squaring a huge σ


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


def compare_speeds(old: dict[str, Any], new: dict[str, Any], tolerance: float) -> CheckVerdict:
    """The recorded measurement against the re-measurement (both `fitter bench --json` shapes): each of pp and tg
    the old one has passes unless the new average is below `regression_threshold`; a failed new outcome fails."""
    rounds = round_avgs(old)
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
    failures: list[str] = []
    metrics: dict[str, dict[str, Any]] = {}
    if any(len(rounds.get(k, ())) > 1 for k, _, _ in recorded):
        lines.append(f"noise: between runs, the spread of the recorded config's {max(map(len, rounds.values()))} "
                     "interleaved confirm rounds (± below)")
    for key, label, o in recorded:
        n = _stats(new, key)
        if n is None:
            lines.append(f"{key}  {label}: recorded {o[0]:.2f} t/s, not measured now  FAIL")
            failures.append(f"{key} not measured")
            metrics[key] = {"old_avg": o[0], "old_sd": o[1], "new_avg": None, "new_sd": None, "threshold": None,
                            "pass": False}
            continue
        if len(rounds.get(key, ())) > 1:  # the noise between runs, from the recorded confirm rounds
            noise, sd = "between runs", between_run_sd(rounds[key])
            threshold = regression_threshold(o[0], sd, sd, tolerance)
        else:
            noise, sd = "within runs: no confirm rounds", o[1]
            threshold = regression_threshold(o[0], o[1], n[1], tolerance)
        passed = n[0] >= threshold
        change = (n[0] - o[0]) / o[0] * 100 if o[0] else 0.0
        lines.append(f"{key}  {label:<8} old {o[0]:10.2f} ± {sd:<8.2f} new {n[0]:10.2f} ± {n[1]:<8.2f} "
                     f"{change:+7.1f} %  threshold {threshold:10.2f}  {'PASS' if passed else 'FAIL'}")
        if not passed:
            failures.append(f"{key} {n[0]:.2f} t/s < threshold {threshold:.2f} t/s ({change:+.1f} %)")
        metrics[key] = {"old_avg": o[0], "old_sd": o[1], "new_avg": n[0], "new_sd": n[1],
                        "noise_sd": sd, "noise": noise.split(":")[0],
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


def fit_lines(totals: dict[str, int], devices: tuple[Device, ...], targets_mib: tuple[int, ...],
              source: str = "fit_target_mib") -> tuple[list[str], list[str], dict[str, Any]]:
    """(lines, failures, details): each device's predicted total against its free memory less the fit target
    (pure). A device whose free memory is unknown (an RPC server fitter cannot ask) is reported, not judged."""
    lines: list[str] = []
    failures: list[str] = []
    details: dict[str, Any] = {}
    if not devices:
        lines.append("fit  no GPU in this config: the run itself is the check")
        return lines, failures, details
    budgets = device_budgets(devices, targets_mib or (DEFAULT_FIT_TARGET_MIB,), source)
    for i, d in enumerate(devices):
        target = target_of(targets_mib or (DEFAULT_FIT_TARGET_MIB,), i)
        predicted = totals.get(d.name, 0)
        free = d.free_bytes if d.free_bytes is not None else d.total_bytes
        budget = budgets[d.name]
        if free is None or budget is None:
            lines.append(f"fit  {d.name}: predicted {predicted / MIB:.2f} MiB; free memory unknown: not checked")
            details[d.name] = {"predicted_bytes": predicted, "free_bytes": None, "fit_target_mib": target,
                               "budget_bytes": None, "pass": None}
            continue
        passed = predicted <= budget
        lines.append(f"fit  {d.name}: predicted {predicted / MIB:.2f} MiB, budget {budget / MIB:.2f} MiB (free "
                     f"{free / MIB:.2f} − fit target {target} MiB)  {'PASS' if passed else 'FAIL'}")
        if not passed:
            failures.append(f"no longer fits: {d.name} predicted {predicted / MIB:.2f} MiB over its budget "
                            f"{budget / MIB:.2f} MiB by {(predicted - budget) / MIB:.2f} MiB")
        details[d.name] = {"predicted_bytes": predicted, "free_bytes": free, "fit_target_mib": target,
                           "budget_bytes": budget, "pass": passed}
    return lines, failures, details


def gpu_change(recorded: dict[str, Any], now: list[dict[str, Any]]) -> str | None:
    """How this machine's GPUs (`now`: `machine.gpu_map`, CUDA0 first) differ from those a result was tuned on, or
    None when they are the same: each CUDA device's PCI bus id and name, and its total memory within 1 % (a driver
    may move it a little; another card of the same name moves it far more). A result written before `gpu_map`, or
    tuned on a simulated or replayed machine, is not compared (pure)."""
    old = recorded.get("gpu_map")
    if not isinstance(old, list) or recorded.get("sim") or recorded.get("replay"):
        return None

    def same(a: Any, b: dict[str, Any]) -> bool:
        if not isinstance(a, dict) or any(a.get(k) != b.get(k) for k in ("device", "pci_bus_id", "name")):
            return False
        x, y = a.get("memory_total"), b.get("memory_total")
        return not (isinstance(x, int) and isinstance(y, int)) or abs(x - y) <= 0.01 * max(x, y)

    if len(old) == len(now) and all(same(a, b) for a, b in zip(old, now, strict=True)):
        return None
    return (f"was tuned on {gpu_map_text([g for g in old if isinstance(g, dict)])}; this machine has "
            f"{gpu_map_text(now)}: its placement and budgets are for those GPUs; tune again here, or run the check "
            "with the CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER it was tuned with")


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
        spec = BenchSpec(n_prompt=int(pp["n"]) if isinstance(pp, dict) else 0,
                         n_gen=int(tg["n"]) if isinstance(tg, dict) else 0,
                         n_depth=int(first.get("depth", 0)), repetitions=_repetitions(measurement, first),
                         threads=threads, threads_batch=threads_batch)
        # llama-bench reads -p -n -d -r as C ints: a larger count is a damaged file (and a run that never ends)
        if max(spec.n_prompt, spec.n_gen, spec.n_depth, spec.repetitions) > 2**31 - 1:
            raise ValueError(f"-p {spec.n_prompt} -n {spec.n_gen} -d {spec.n_depth} -r {spec.repetitions} "
                             "exceed llama-bench's int")
        return spec
    except (KeyError, TypeError, ValueError, FitterError) as e:
        raise FitterError(f"{where}: its measurement has no usable pp/tg n, depth and samples_ts ({e}): cannot "
                          "repeat it") from None


def recorded_workload(measurement: dict[str, Any], where: str) -> Workload | None:
    """The workload a recorded measurement was taken under, when it was more than one test (its depths, its
    streams: fitter.measure.served records it); None: the single test `recorded_spec` repeats."""
    if "workload" not in measurement:
        return None
    try:
        return Workload.from_json(measurement["workload"], f"{where}: workload")
    except FitterError as e:
        raise FitterError(f"{e}: cannot repeat it") from None


def _repetitions(measurement: dict[str, Any], first: dict[str, Any]) -> int:
    """A confirm run's repetitions per round (its samples pool every round), else the number of samples."""
    confirm = measurement.get("confirm")
    if isinstance(confirm, dict) and isinstance(confirm.get("repetitions"), int) and confirm["repetitions"] > 0:
        return int(confirm["repetitions"])
    return len(first["samples_ts"])


# -- the check (I/O through the runner) ---------------------------------------------------------------------------


def run_check(result_dir: Path, policy: str, tolerance: float, runner_factory: RunnerFactory, *,
              model: str | None = None, timeout: float | None = None, cpu: CpuProfile = CPU_AVX2,
              machine_devices: Callable[[], tuple[Device, ...]] = tuple,
              consumer: str | None = None,
              machine_gpus: Callable[[], list[dict[str, Any]]] | None = None,
              perplexity: Path | None = None) -> CheckVerdict:
    """Re-measure the `policy` pick of a tuning result and compare it with its recorded confirm run.

    `runner_factory(emulated_gpu_mib=…, cpus=…)` returns a runner (WorkerRunner, a simulated machine's runner, a
    fake). The devices the fit is checked against are the runner's own (the emulated GPU), else the config's
    `--rpc` servers, else `machine_devices()` (this machine's GPUs, read once the runner has started).
    `model` replaces the recorded GGUF path (the same file elsewhere; its header identity must match). `consumer`
    checks the pick as another program would run it (`--for`; default: the program it was tuned for).
    `machine_gpus()`: this machine's `machine.gpu_map` now; a result tuned on other GPUs is refused (`gpu_change`),
    unless it was measured on the emulated GPU. `perplexity`: the build's llama-perplexity, which measures the pick's
    quality again when the result has it and the build changed (fitter.check.quality_recheck)."""
    doc = load_result(result_dir)
    path = doc.source
    entry = doc.entry(policy, "check")
    where = f"{path}: the {policy} pick (trial {entry.trial})"
    if entry.measurement is None or not entry.measurement.ok:
        raise FitterError(f"{where}: no ok measurement recorded; nothing to compare against")
    old = entry.measurement.data
    if entry.flags is None:
        raise FitterError(f"{where}: \"flags\" must be a list of strings, got None")
    flags = list(entry.flags)
    launch, _ = split_process_flags(flags, where)
    try:
        process = process_flags_of(flags)
        cpus = process.cpus
    except LaunchConfigError as e:
        raise FitterError(f"{where}: {e}") from None
    if process.threads is None:
        raise FitterError(f"{where}: no -t (threads); the picked flags pin -t and -tb as measured")
    spec = recorded_spec(old, process.threads, process.threads_batch or process.threads, where)
    workload = recorded_workload(old, where)

    model_path, model_spec = _model(doc, model)
    emulated = doc.emulated or entry.measurement.emulated
    if machine_gpus is not None and not emulated and isinstance(doc.machine.get("gpu_map"), list):
        changed = gpu_change(doc.machine, machine_gpus())
        if changed:
            raise FitterError(f"{path} {changed}")
    cap = _emulated_cap(doc) if emulated else None
    targets = doc.fit_targets() or (DEFAULT_FIT_TARGET_MIB,)

    kind = doc.machine.get("emulated_gpu_kind", "rpc") if emulated else "rpc"  # the one the result was tuned on
    with runner_factory(emulated_gpu_mib=cap, cpus=cpus, **({"emulated_kind": kind} if kind != "rpc" else {})) \
            as runner:
        if emulated:
            launch = _to_fresh_gpu(launch, runner.rpc, where)
        try:
            config = parse_launch_flags(launch, doc.consumer)
            if consumer is not None and consumer != doc.consumer:
                config = retarget(config, consumer)
            if config.draft_model:  # the draft's memory is the config's too
                model_spec = with_draft(model_spec, config.draft_model)
            if config.mmproj:  # and the projector's
                model_spec = with_projector(model_spec, config.mmproj)
        except FitterError as e:
            raise FitterError(f"{where}: {e}") from None
        devices = tuple(runner.devices()) or (rpc_devices(list(config.rpc)) if config.rpc else machine_devices())
        header = [f"check: {policy} pick (trial {entry.trial}) of {path}, tolerance {tolerance * 100:g} %",
                  f"flags: {' '.join(flags)}"]
        if workload is not None:
            header.append(f"workload: {workload.label()}, as recorded ({workload.source})")
        if config.consumer != doc.consumer:
            header.append(f"for {config.consumer} (tuned for {doc.consumer}): its memory rules and what it fixes")
        if emulated:
            mib = "+".join(map(str, cap)) if isinstance(cap, tuple) else cap
            header.append(f"on a fresh emulated GPU of {mib} MiB at {', '.join(runner.rpc) or '?'} (the recorded "
                          "one is gone)")
        fits: tuple[list[str], list[str], dict[str, Any]]
        plan: MemoryPlan | None
        try:
            plan = estimate(model_spec, config, devices, runner.cpu_profile() or cpu)
        except FitterError as e:  # llama.cpp would now refuse it: still measured, to show what it does
            plan, fits = None, ([f"fit  the estimator refuses the config: {e}"], [f"refused: {e}"], {})
        else:
            plan, note = _projected(plan, runner.rpc)
            header += note
            fits = fit_lines(device_totals(plan), devices, targets, f"{path}: fit_target_mib")
        served = WorkloadRunner(runner, workload) if workload is not None else runner
        result = served.run(model_path, config, spec, timeout, plan)
        new = measurement_json(result, runner.backend, plan, runner.emulated)
    speed = compare_speeds(old, new, tolerance)
    fit_text, fit_failures, fit_details = fits
    q_lines, q_failures, q_details = recheck_quality(doc, entry, model_path, perplexity)
    lines = (*header, *speed.lines, *fit_text, *_vram_lines(entry, new), *q_lines)
    failures = (*speed.failures, *fit_failures, *q_failures)
    details = {"for": config.consumer, "result": str(path), "policy": policy, "trial": entry.trial,
               "tolerance": tolerance,
               "flags": list(flags), **speed.details, "fit": fit_details, **q_details}
    # the model's warnings and the estimate's, as `fitter estimate` prints them (a kind fitter guesses, or took from
    # the build's projection once the emulated GPU ran)
    warnings = tuple(dict.fromkeys((*model_spec.warnings, *(plan.warnings if plan is not None else ()))))
    return CheckVerdict(not failures, lines, new, failures, details, warnings)


def _projected(plan: MemoryPlan, rpc: tuple[str, ...]) -> tuple[MemoryPlan, list[str]]:
    """The plan with what fitter guesses for its model taken from the pinned build's projection (fitter.memory.
    projected); without one the check still runs and says that its "still fits" is fitter's guess."""
    from fitter.measure.llamacpp.projection import projector_for

    try:
        projector = projector_for(plan.model, rpc=rpc, devices=plan.devices)  # None where fitter guesses nothing
        return (projector.plan(plan) if projector is not None else plan), []
    except FitterError as e:  # no build, or its projection failed
        return plan, [f"fit: fitter's guess, not llama.cpp's projection: {e}"]


def _model(doc: ParetoDoc, override: str | None) -> tuple[str, ModelSpec]:
    return recorded_model(doc, override, "; a check compares the same model")


def _emulated_cap(doc: ParetoDoc) -> int | tuple[int, ...]:
    """The recorded emulated GPU's cap, or each of several's (a list)."""
    cap = doc.machine.get("emulated_gpu_mib")
    caps: list[Any] = cap if isinstance(cap, list) and cap else [cap]
    if not all(type(c) is int and c >= 1 for c in caps):
        raise FitterError(f"{doc.source}: measured on the emulated GPU but machine.emulated_gpu_mib is {cap!r}: "
                          "cannot start one of the same cap")
    return cap if isinstance(cap, int) else tuple(caps)


def _to_fresh_gpu(launch: list[str], rpc: tuple[str, ...], where: str) -> list[str]:
    """The emulated GPUs' old endpoints replaced by the fresh ones', in order, wherever the flags name them."""
    old = [x for x in (flag_value(launch, "rpc") or "").split(",") if x]
    if not old:
        return launch
    if len(old) != len(rpc):
        raise FitterError(f"{where}: --rpc {','.join(old)} on the emulated GPUs: expected {len(old)} endpoints to "
                          f"replace with the fresh emulated GPUs', the runner has {len(rpc)}")
    return with_endpoints(launch, old, rpc)


def _vram_lines(entry: Entry, new: dict[str, Any]) -> list[str]:
    """VRAM then and now (information, not judged: the fit check judges memory)."""
    peak = new.get("peak_vram") or {}
    if not peak or new.get("outcome") != "ok":
        return []
    now = vram_bytes(new) / MIB
    before = f"recorded {entry.vram_bytes / MIB:.2f} MiB, " if entry.vram_bytes is not None else ""
    return [f"vram {before}now {now:.2f} MiB (peak, {', '.join(sorted({p['source'] for p in peak.values()}))})"]


def runner_factory_for(result: Path, snapshot: MachineSnapshot, model: str | None = None) -> RunnerFactory:
    """How `fitter check` re-measures a result: a result tuned on a simulated machine on that machine (its profile
    as recorded), any other with fitter's worker (NVML peaks when this machine has NVIDIA GPUs)."""
    try:
        doc: ParetoDoc | None = load_result(result)
    except FitterError:
        doc = None  # run_check reports the unreadable result
    recorded = doc.machine if doc is not None else {}
    if doc is not None and recorded.get("sim"):
        from fitter.sim import SimRunner, load_machine

        sim, profile = recorded["sim"], recorded.get("profile") or recorded["sim"]
        if not isinstance(sim, str) or not isinstance(profile, str):  # the file's to edit: Path() takes only text
            raise FitterError(f"{doc.source}: machine.sim {sim!r} and machine.profile {profile!r} must name the "
                              "simulated machine (a shipped profile or a TOML file)")
        try:
            machine = load_machine(profile if Path(profile).is_file() else sim)
        except FitterError as e:
            raise FitterError(f"{doc.source}: the simulated machine it was tuned on: {e}") from None
        _, spec = _model(doc, model)
        return lambda **_: SimRunner(machine, spec)
    def order() -> tuple[int, ...] | None:  # read when a runner is made: a simulated machine needs none
        return snapshot.nvml_indices() if snapshot.gpus else None

    binary = (doc.llama_cpp.get("llama_server") if doc is not None else None)
    if isinstance(binary, str):  # tuned through a user's llama.cpp build (`--llama-cpp DIR`): re-measured with it
        if not Path(binary).is_file():
            raise FitterError(f"{doc.source if doc else result}: tuned with {binary}, which is gone; rebuild it there "
                              "or tune again")
        return lambda emulated_gpu_mib=None, cpus=None, **_: ServerRunner(
            binary, emulated_gpu_mib, ProcessFlags(cpu_mask=hex(sum(1 << c for c in cpus)) if cpus else None),
            nvml=bool(snapshot.gpus), gpu_order=order())
    return partial(WorkerRunner, nvml=bool(snapshot.gpus), build=snapshot.llama_cpp or None, gpu_order=order())
