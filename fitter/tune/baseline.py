"""Trial 0 of every study: what llama.cpp does on its own. With a GPU, its `--fit` placement (llama-fit-params built
from the same source, fitter.measure.llamacpp.fit_params) with llama-server's default batch, KV and threads; without
one, llama-server's defaults. A resumed study keeps its baseline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial

from fitter.errors import LaunchConfigError
from fitter.flags import ProcessFlags, parse_flags, pin, validate
from fitter.flags.parse import flag_value, with_endpoint, with_endpoints
from fitter.measure.llamacpp.fit_params import LlamaFit, LlamaFitError, baseline_config, run_llama_fit
from fitter.memory.backends.devices import Device, rpc_device_name
from fitter.memory.plan.estimator import estimate
from fitter.search.request import Candidate, TuneRequest
from fitter.storage.fleet import measured
from fitter.storage.optuna_api import frozen
from fitter.tune.study import Tuner
from fitter.tune.targets import RecordedBaseline
from fitter.units import MIB

NAME = "llama.cpp --fit"


@dataclass(frozen=True)
class Baseline:
    """The baseline as pareto.json records it (`data`) and, when it ran, the candidate it ran as."""

    data: dict[str, Any]
    candidate: Candidate | None = None


def _recorded(req: TuneRequest, t: FrozenTrial) -> Baseline:
    """A resumed study's baseline. Its flags name the RPC endpoint of the run that measured it; when this run's
    devices are its own (fitter's emulated GPU on a fresh port), the baseline is confirmed on them."""
    flags = t.user_attrs.get("flags")
    data = {"name": NAME, "trial": t.number, "flags": flags, "measurement": t.user_attrs.get("measurement")}
    if not flags:
        return Baseline(data)
    flags = data["flags"] = on_these_devices(req, flags)
    return Baseline(data, _candidate(req, flags, "the recorded baseline's flags"))


def on_these_devices(req: TuneRequest, flags: list[str]) -> list[str]:
    """Recorded baseline flags name the RPC endpoint of the run that measured them; when this run's devices are its
    own (fitter's emulated GPU on a fresh port, not a `--rpc` the user gave), they move to this run's endpoint."""
    old = flag_value(flags, "rpc")
    if not (old and req.rpc and "rpc" not in req.base.given):
        return list(flags)
    olds = old.split(",")
    if len(olds) != len(req.rpc):
        return with_endpoint(flags, old, ",".join(req.rpc))
    return with_endpoints(flags, olds, req.rpc)  # each emulated GPU's: `-ot …=RPC0[endpoint]` names one


def _candidate(req: TuneRequest, flags: list[str], where: str) -> Candidate:
    """A baseline's flags as a trial (read once, at the storage or the fit tool's boundary)."""
    try:
        config, process = parse_flags(flags, req.base.consumer)
    except LaunchConfigError as e:
        raise LaunchConfigError(f"{where}: {e}") from None
    threads = process.threads or req.default_threads
    spec = replace(req.bench, threads=threads, threads_batch=process.threads_batch or threads)
    return Candidate({}, config, spec, tuple(flags))


def run_baseline(req: TuneRequest, tuner: Tuner, tool: Path | None, targets: tuple[int, ...],
                 fit_devices: Callable[[], Any], log: Callable[[str], None],
                 unavailable: str | None = None) -> Baseline:
    """Measure the baseline as trial 0, unless the study has one. `fit_devices()` is the context manager the fit runs
    in (yields the RPC endpoints it sees); `unavailable` says why llama.cpp's fit cannot run here (then no baseline)."""
    if (elsewhere := _claimed(req, tuner)) is not None:
        return elsewhere
    cand, why, message = baseline_candidate(req, tool, targets, fit_devices, unavailable)
    if cand is None:
        return _none(tuner, why, message, log)
    if message:  # a note on how llama.cpp's fit was run
        log(f"fitter: baseline: {message}")
    return _launch(req, tuner, cand)


CLAIM = "baseline"  # the baseline runs once per study, by the worker of a fleet that claims it (fitter.storage.fleet)


def _claimed(req: TuneRequest, tuner: Tuner) -> Baseline | None:
    """None when this worker is to measure the baseline; else the study's baseline: measured before (a resumed
    study keeps it), measured by another worker of a fleet, or being measured by one (then read again before the
    confirm rounds: `study_baseline`)."""
    if (resumed := _resumed(req, tuner)) is not None:
        return resumed
    c = tuner.claim(CLAIM)
    if c.granted:
        return None
    return study_baseline(req, tuner) or Baseline({"name": NAME, "flags": None, "measurement": None,
                                                    "reason": f"measured by worker {c.holder}"})


def study_baseline(req: TuneRequest, tuner: Tuner) -> Baseline | None:
    """The baseline as the study has it now: its trial, or why there is none (llama.cpp's fit could not run)."""
    if (resumed := _resumed(req, tuner)) is not None:
        return resumed
    if (why := tuner.study.user_attrs.get("baseline_reason")) is not None:
        return Baseline({"name": NAME, "flags": None, "measurement": None, "reason": why})
    return None


def _none(tuner: Tuner, why: str, message: str, log: Callable[[str], None]) -> Baseline:
    """No baseline for this study, and why: kept in the study, so every worker of a fleet and a resumed run say it."""
    log(f"fitter: {message}")
    tuner.study.set_user_attr("baseline_reason", why)
    tuner.claims.finish(CLAIM, tuner.worker.name)
    return Baseline({"name": NAME, "flags": None, "measurement": None, "reason": why})


def baseline_candidate(req: TuneRequest, tool: Path | None, targets: tuple[int, ...], fit_devices: Callable[[], Any],
                       unavailable: str | None = None) -> tuple[Candidate | None, str, str]:
    """The baseline as a trial (llama.cpp's fit on the devices, llama-server's defaults otherwise), or None, why
    there is none and the line that says so (with a baseline: a note on how the fit ran, or ""). `fitter tune`
    launches it as trial 0; `fitter grid` records it as a point."""
    config = req.base
    note = ""  # how llama.cpp's fit was run, when that needs saying
    if req.devices:
        if tool is None or unavailable is not None:
            why = (f"llama.cpp's fit cannot run here: {unavailable}" if unavailable is not None else
                   "llama-fit-params not found (python -m fitter.measure.llamacpp.tools llama-fit-params, or "
                   "--llama-fit-params PATH)")
            return None, why, f"{why}: no baseline, so no ratios over llama.cpp's own choice"
        if req.base.draft_model:
            # llama-server's own --fit counts the draft (common/common.cpp passes it to common_fit_params as an extra
            # model); llama-fit-params parses no -md (tools/fit-params), so that fit cannot be projected alone
            why = (f"-md {req.base.draft_model}: llama-fit-params takes no draft model, so llama-server's own --fit "
                   "of the pair (which counts the draft) cannot be projected")
            return None, why, f"{why}: no baseline, so no ratios over llama.cpp's own choice"
        # the deployed context, explicitly: the fit must place the model for the context every trial runs with
        # (with -c 0 llama-fit-params resolves a context of its own, not llama-server's)
        config = config.with_given(ctx_size=estimate(req.spec, req.base, (), req.cpu).context.n_ctx)
        if config.split_mode == "tensor":
            # common/fit.cpp common_params_fit_impl refuses SPLIT_MODE_TENSOR (llama-fit-params exits 1), and
            # llama-server's --fit logs that and loads the flags as given (common/common.cpp): that load is the baseline
            config = config.with_given(fit=False)
            if req.rpc and not config.rpc:
                config = config.with_given(rpc=req.rpc)
            validate(config)
            threads = req.default_threads
            return Candidate({}, config, replace(req.bench, threads=threads, threads_batch=threads),
                             tuple(pin(config, process=ProcessFlags(threads, threads), given=True))), "", ""
        if req.base.mmproj:
            targets, note = projector_margins(req, targets)
        try:
            fitted = _llama_fit(tool, req, pin(config, given=True), targets, fit_devices)
        except LlamaFitError as e:
            return None, str(e), f"llama.cpp's --fit failed, no baseline: {e}"
        config = baseline_config(fitted, config)  # the fit tool's answer, read once
        if req.rpc and not config.rpc:
            config = config.with_given(rpc=req.rpc)
        validate(config)
    threads = req.default_threads
    process = ProcessFlags(threads, threads)
    return Candidate({}, config, replace(req.bench, threads=threads, threads_batch=threads),
                     tuple(pin(config, process=process, given=True))), "", note


def projector_margins(req: TuneRequest, targets: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    """llama-server's own --fit with a projector: it measures the projector first (libmtmd's
    mtmd_get_memory_usage: each weight's bytes and the warm-up's compute buffer, per device) and adds that to the
    device's margin (tools/server/server-context.cpp load_model, `fit_params_target[i] += size`); llama-fit-params
    parses no --mmproj, so fitter adds it to the targets it passes. (llama-server indexes the margins by ggml's
    device registry, the fit by the model's devices: they agree for a build's own GPUs without -dev, which is what
    this reproduces, not the mismatch with RPC devices or -dev.)"""
    from fitter.memory.plan.mmproj import MODEL

    projector = req.spec.projector
    if projector is None:
        return targets, ""
    plan = estimate(req.spec, req.base, req.devices, req.cpu)
    unpadded = sum(t.n_bytes for t in projector.tensors)
    extra = {d.name: 0 for d in req.devices}
    for b in plan.buffers:
        if b.model == MODEL and b.device in extra:
            extra[b.device] += unpadded if b.kind == "model" else b.bytes
    if not targets:
        return targets, ""
    added = tuple(-(-extra[d.name] // MIB) for d in req.devices)
    moved = ", ".join(f"{d.name} +{n} MiB" for d, n in zip(req.devices, added, strict=True) if n)
    return (tuple(t + n for t, n in zip(targets, added, strict=True)),
            "llama-fit-params ignores the projector (--mmproj is not its flag); the baseline's margins add what "
            f"llama-server's own --fit adds for it ({moved or 'nothing on a GPU'})")


def recorded_baseline(req: TuneRequest, tuner: Tuner, recorded: RecordedBaseline, log: Callable[[str], None]) -> \
        Baseline:
    """A baseline recorded with the target (a replayed landscape's point, fitter.grid.replay_tune): its flags, no fit
    run; launched as trial 0 like a measured one, so the target's runner answers it."""
    if (elsewhere := _claimed(req, tuner)) is not None:
        return elsewhere
    if recorded.flags is None:
        why = f"the landscape has no baseline ({recorded.reason or 'not recorded'})"
        return _none(tuner, why, why, log)
    return _launch(req, tuner, _candidate(req, list(recorded.flags), "the landscape's baseline flags"))


def _resumed(req: TuneRequest, tuner: Tuner) -> Baseline | None:
    """The baseline a resumed study measured already (it keeps it), or None. One still running (another worker's) or
    whose worker died before it ended (no outcome) is not measured yet."""
    for t in tuner.study.get_trials(deepcopy=False):
        if t.user_attrs.get("phase") == "baseline" and measured(t):
            return _recorded(req, t)
    return None


def _launch(req: TuneRequest, tuner: Tuner, cand: Candidate) -> Baseline:
    s = tuner.screener(cand)
    trial = tuner.ask()
    # Measured even when fitter predicts it over the fit target: it is llama.cpp's choice, the reference point.
    tuner.launch(trial, cand, s, "baseline", claim=CLAIM)
    t = frozen(tuner.study, trial)
    return Baseline({"name": NAME, "trial": t.number, "flags": t.user_attrs.get("flags"),
                     "measurement": t.user_attrs.get("measurement")}, cand)


def _llama_fit(tool: Path, req: TuneRequest, flags: list[str], targets: tuple[int, ...],
               fit_devices: Callable[[], Any]) -> LlamaFit:
    """llama.cpp's fit on the devices the trials use (`fit_devices()`: a context manager yielding the RPC endpoints
    the fit must see)."""
    with fit_devices() as rpc:
        fitted = run_llama_fit(tool, req.model, flags, rpc, targets, threads=req.default_threads)
    if not req.rpc and rpc:  # emulated GPUs stood in for the request's devices (a simulated machine's)
        fitted = replace(fitted, flags=tuple(named_as_devices(list(fitted.flags), tuple(rpc), req.devices)))
    return fitted


def sim_fit_devices(req: TuneRequest, tool: Path | None = None, machine: Any = None) -> Any:
    """Each simulated GPU stood in for by an emulated one with the free memory llama.cpp's fit would read there (its
    free memory less the CUDA context: cudaMemGetInfo runs in a context already made): the fit only queries memory
    and projects (no_alloc), so a header-only model is enough. Served by the ggml beside `tool` (llama-fit-params)
    when its build is a shared one with RPC (fitter's own tools are), else by llama-cpp-python's. The stand-ins
    project the RPC backend's compute buffers, not CUDA's."""
    import contextlib

    from fitter.measure.emulator.emulated_gpu import EmulatedGpus
    from fitter.sim.physics import context_bytes

    @contextlib.contextmanager
    def devices() -> Any:
        caps = tuple(((d.free_bytes or d.total_bytes or 0) - (context_bytes(machine, d.name) if machine else 0))
                     // MIB for d in req.devices)
        with EmulatedGpus(caps, beside=tool) as gpus:
            yield gpus.endpoints

    return devices


def named_as_devices(flags: list[str], endpoints: tuple[str, ...], devices: tuple[Device, ...]) -> list[str]:
    """A fit answer on stand-in emulated GPUs, its `-ot …=RPC0[endpoint]` rules naming the devices they stood in for
    (a simulated machine's CUDA0, CUDA1, …): ggml-rpc names each server's device RPC0[host:port]."""
    out = list(flags)
    for endpoint, device in zip(endpoints, devices, strict=True):
        out = with_endpoint(out, rpc_device_name(endpoint), device.name)
    return out
