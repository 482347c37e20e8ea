"""What a tune asks for (`TuneRequest`) and what one configuration of its search space stands for (`Candidate`):
the launch config (the user's fixed flags with the searched parameters applied: parsed once, carried typed), the
bench spec with its threads, and the flags a trial records."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from fitter.errors import FitterError, LaunchConfigError
from fitter.flags import LaunchConfig, ProcessFlags, pin, validate
from fitter.flags.parse import with_params
from fitter.gguf.model_spec import ModelSpec
from fitter.measure.types import BenchSpec
from fitter.memory.backends.devices import CpuProfile, Device
from fitter.memory.plan.projected import Projects
from fitter.search.screen import Budgets
from fitter.search.space import is_valid_combination
from fitter.search.split import ORDER, apply_split, is_split_key, last_experts_rule, read_split
from fitter.workload import Workload

OBJECTIVES: dict[str, str] = {"tg": "maximize", "pp": "maximize", "vram": "minimize", "ctx": "maximize",
                              "tg-stream": "maximize", "ttft": "minimize", "quality": "minimize"}
# the objectives of several streams served at once: one stream's decode and the time to its first token
STREAM_OBJECTIVES: dict[str, str] = {"tg-stream": "tg_stream", "ttft": "ttft"}  # → the measurement's key
CTX_KEY = "ctx-size"  # searched only under a workload's min_ctx (--min-ctx): the context as a trade
PLACEMENT_KEYS = ("n-cpu-moe", "n-gpu-layers")  # with the per-device keys of fitter.search.split (is_placement_key)
THREAD_KEYS = ("threads", "threads-batch")
# llama-server's own defaults, the tie-breaker when the physics prior cannot tell two combos apart
EMULATED_ENDPOINT = "<emulated GPU>"  # fitter's own emulated GPU in a config's key (Candidate.key)
# where the weights and the KV cache live (load-mode, kv-offload): trades the first guesses leave at the defaults
TRADE_DEFAULTS: dict[str, Any] = {"load-mode": "auto", "kv-offload": True}
SERVER_DEFAULTS: dict[str, Any] = {"batch-size": 2048, "ubatch-size": 512, "cache-type-k": "f16",
                                   "cache-type-v": "f16", "flash-attn": "auto", **TRADE_DEFAULTS}


def is_placement_key(key: str) -> bool:
    return key in PLACEMENT_KEYS or is_split_key(key)


class TuneError(FitterError):
    pass


@dataclass(frozen=True)
class TuneRequest:
    model: str
    spec: ModelSpec
    base: LaunchConfig  # the user's llama.cpp flags (context, slots, anything not searched), parsed; .given: theirs
    distributions: dict[str, BaseDistribution]  # the resolved search space, llama.cpp long flag names
    devices: tuple[Device, ...]
    budgets: Budgets
    cpu: CpuProfile
    objectives: tuple[str, ...] = ("tg", "pp", "vram")
    bench: BenchSpec = field(default_factory=BenchSpec)
    workload: Workload = field(default_factory=Workload)  # what the runner measures each trial under (its depths)
    n_trials: int = 12  # launched trials, the baseline included, in the whole study (a resumed one too)
    timeout_s: float | None = None
    trial_timeout_s: float | None = None
    seed: int = 0
    rpc: tuple[str, ...] = ()
    space_source: str = ""  # where the search space came from (a file, or shipped:<name>)
    # the build's own projection of a config (device → {model, kv, compute} bytes), asked before each launch when
    # fitter guesses a kind for the model (fitter.memory.plan.projected) or the build is not the llama.cpp fitter's
    # rules were matched against (the drift guard, fitter.tune.session)
    projector: Projects | None = field(default=None, compare=False)

    @property
    def default_threads(self) -> int:
        """Threads of a trial whose params do not choose them: the bench spec's."""
        return self.bench.threads

    @property
    def fixed_flags(self) -> tuple[str, ...]:
        """The user's flags as fitter writes them back (the fields they set)."""
        return tuple(pin(self.base, given=True))


@dataclass
class Candidate:
    params: dict[str, Any]
    config: LaunchConfig
    spec: BenchSpec
    flags: tuple[str, ...]  # the llama.cpp flags of this trial as recorded (fixed flags, the searched ones, -t -tb)
    error: str | None = None  # llama.cpp refuses these flags (e.g. a quantized V cache without flash attention)
    endpoint: str | None = None  # the `--rpc` value of fitter's own emulated GPU, a port that differs every run

    @property
    def key(self) -> str:
        """The config as the study knows it: its flags, with fitter's own emulated GPU named instead of its port, so
        a resumed run and every worker of a fleet (each on an emulated GPU of its own) find it measured."""
        flags = list(self.flags)
        for i in range(len(flags) - 1):
            if flags[i] == "--rpc" and flags[i + 1] == self.endpoint:
                flags[i + 1] = EMULATED_ENDPOINT
        return " ".join(flags)

    @property
    def process(self) -> ProcessFlags:
        return ProcessFlags(self.spec.threads, self.spec.threads_batch or self.spec.threads)


# -- candidates -------------------------------------------------------------------------------------------------


def candidate(req: TuneRequest, params: dict[str, Any]) -> Candidate:
    """The config and bench spec a param dict stands for: the searched flags applied to the user's config (as if
    they followed it on the command line), threads to the bench spec (-t/-tb)."""
    searched = {k: v for k, v in params.items() if k not in THREAD_KEYS and not is_split_key(k)}
    spread = {k: v for k, v in params.items() if is_split_key(k)}
    last = None  # one GPU, expert-order last: -ncmoe's count as the last expert layers' rule (fitter.search.split)
    if set(spread) == {ORDER}:
        spread = {}
        if params[ORDER] == "last" and "n-cpu-moe" in searched:
            last = last_experts_rule(req.spec, int(searched["n-cpu-moe"]))
            if last is not None:
                del searched["n-cpu-moe"]
    extra: dict[str, Any] = {}
    ctx = searched.pop(CTX_KEY, None)
    if ctx is not None:  # in the place of the -c min_ctx the base was given (fitter.workload.searched_context)
        extra["ctx_size"] = int(ctx)
    if req.spec.n_expert and "n-gpu-layers" not in params and "n_gpu_layers" not in req.base.given:
        extra["n_gpu_layers"] = -2  # experts placed explicitly: every layer on the GPU, as the seeds' recipe
    endpoint = None
    if req.rpc and "rpc" not in req.base.given:
        endpoint = ",".join(req.rpc)
        extra["rpc"] = req.rpc
    threads = int(params.get("threads", req.default_threads))
    threads_batch = int(params.get("threads-batch", req.bench.threads_batch or threads))
    spec = replace(req.bench, threads=threads, threads_batch=threads_batch)
    process = ProcessFlags(threads, threads_batch)
    try:
        config = with_params(req.base.with_given(**extra), searched, check=False)
    except LaunchConfigError as e:  # a value llama.cpp cannot read: the base's flags and the values, refused
        shown = (*pin(req.base, given=True), *(f"--{k}={v}" for k, v in searched.items()), *process.flags())
        return Candidate(dict(params), LaunchConfig(), spec, shown, error=str(e), endpoint=endpoint)
    if last is not None:
        config = config.with_given(overrides=(*config.overrides, last))
    if spread:  # on several devices: -ts or -sm none -mg, and each device's expert rules (fitter.search.split)
        config = apply_split(req.spec, req.devices, config, read_split(spread, len(req.devices), req.spec.n_layer))
    flags = tuple(pin(config, process=process, given=True))  # the one writer: what the trial records and runs
    try:
        validate(config)
    except LaunchConfigError as e:  # llama.cpp would refuse it: screened out like a config that does not fit
        return Candidate(dict(params), LaunchConfig(), spec, flags, error=str(e), endpoint=endpoint)
    return Candidate(dict(params), config, spec, flags, endpoint=endpoint)


def combos(req: TuneRequest) -> list[dict[str, Any]]:
    """Every combination of the context-level choices (batch sizes, KV types, flash attention) llama.cpp accepts."""
    keys = [k for k in req.distributions if not is_placement_key(k) and k not in THREAD_KEYS]
    choices = [_choices(req.distributions[k]) for k in keys]
    out = []
    for values in itertools.product(*choices):
        params = dict(zip(keys, values, strict=True))
        if is_valid_combination(params) is None:
            out.append(params)
    return out


def _choices(d: BaseDistribution) -> list[Any]:
    if isinstance(d, CategoricalDistribution):
        return list(d.choices)
    if isinstance(d, IntDistribution):
        return list(range(d.low, d.high + 1, d.step))
    raise TuneError(f"search space: {d!r} is not a finite distribution")


def _default_choice(d: BaseDistribution, preferred: Any) -> Any:
    choices = _choices(d)
    return preferred if preferred in choices else choices[0]


def _default_distance(params: dict[str, Any]) -> int:
    return sum(1 for k, v in SERVER_DEFAULTS.items() if k in params and params[k] != v)


