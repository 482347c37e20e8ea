"""What a launch may choose from when it starts: every measured config of a result, in the order a policy prefers
them, each re-planned for the devices it will run on with what it needs on each; the first that fits the memory free
now is served (`choose`). Where none does, the policy's pick with the experts of more layers on the CPU (a larger
`-ncmoe`) or, when even all of them there is too much, a smaller context, re-planned by the estimator and marked
unmeasured (`replans`). Never a line that cannot load: no candidate fits, nothing is chosen.

Pure: the model spec, the devices (with their free memory now) and the configs come from the caller (`fitter serve`,
`fitter export --format launcher`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from fitter.errors import FitterError
from fitter.flags import LaunchConfig, ProcessFlags, pin
from fitter.flags.overrides import ncmoe_rules, split_ncmoe
from fitter.gguf.model_spec import ModelSpec
from fitter.memory.backends.devices import CPU_AVX2, CpuProfile, Device
from fitter.memory.fit.budgets import DEFAULT_FIT_CTX, target_of
from fitter.memory.plan.estimator import estimate
from fitter.results.pareto import Entry, ParetoDoc
from fitter.units import MIB

CTX_PAD = 256  # src/llama-context.cpp: n_ctx is padded to a multiple of 256


@dataclass(frozen=True)
class Option:
    """A measured config of the result as the launch would run it (its devices' names as they are now)."""

    trial: int
    config: LaunchConfig
    process: ProcessFlags
    speeds: dict[str, float]  # measured tg/pp (t/s)


@dataclass(frozen=True)
class LaunchLine:
    trial: int  # the measured config it is, or was re-planned from
    flags: tuple[str, ...]  # llama-server's flags, pinned (no -m)
    need: dict[str, int]  # device → bytes the plan allocates on it (llama.cpp's buffers)
    speeds: dict[str, float] = field(default_factory=dict)  # measured (a re-plan: its source's)
    change: str = ""  # what a re-plan changed ("-ncmoe 4 → 6"); "" for a measured config

    @property
    def measured(self) -> bool:
        return not self.change

    def label(self) -> str:
        return f"trial {self.trial}" + (f" with {self.change} (unmeasured: re-planned by the estimator)"
                                         if self.change else "")


@dataclass(frozen=True)
class Room:
    """A device's memory for the launch: free now, less what it uses outside llama.cpp's buffers and the fit target
    the result was tuned with (fitter.memory.fit.budgets)."""

    free: int | None  # None: unknown (nothing is judged on it)
    overhead: int
    target_mib: int

    @property
    def budget(self) -> int | None:
        return None if self.free is None else self.free - self.overhead - self.target_mib * MIB

    @property
    def reserve(self) -> int:
        return self.overhead + self.target_mib * MIB

    def text(self) -> str:
        less = [f"{size(self.overhead)} outside llama.cpp's buffers"] if self.overhead else []
        less += [f"the {self.target_mib} MiB fit target"] if self.target_mib else []
        free = "unknown" if self.free is None else size(self.free)
        return f"{free} free" + (" less " + " and ".join(less) if less else "")


@dataclass(frozen=True)
class Choice:
    candidate: LaunchLine | None  # None: nothing fits, nothing may start
    reason: str  # one line: what the policy's pick needs, what is free, what is served and what it costs


def size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / MIB:.2f} MiB"


def rooms(devices: Sequence[Device], targets_mib: Sequence[int]) -> dict[str, Room]:
    """Each device's room now: its free memory (else its total), its overhead, its fit target."""
    out = {}
    for i, d in enumerate(devices):
        free = d.free_bytes if d.free_bytes is not None else d.total_bytes
        out[d.name] = Room(free, d.overhead.bytes if d.overhead is not None else 0,
                           target_of(targets_mib, i) if targets_mib else 0)
    return out


def policy_order(doc: ParetoDoc, policy: str) -> list[Entry]:
    """The result's measured configs as `policy` prefers them: its pick first, then the rest fastest first by the
    policy's own measure (as fitter.results.pareto.fastest ranks them: decode, prefill, or balanced's lower of the two
    ratios to the best; min-vram and max-context by decode), the lower trial first among equals."""
    pick = doc.entry(policy, "serve")
    rest = [e for e in doc.pareto if e is not pick and e.ok and e.trial is not None]
    entries = [pick, *rest]
    tg_best = max((e.speed("tg") or 0.0 for e in entries), default=0.0)
    pp_best = max((e.speed("pp") or 0.0 for e in entries), default=0.0)

    def score(e: Entry) -> float:
        tg, pp = e.speed("tg") or 0.0, e.speed("pp") or 0.0
        if policy == "max-prefill":
            return pp
        if policy == "balanced":
            return min(pp / pp_best if pp_best else 0.0, tg / tg_best if tg_best else 0.0)
        return tg

    return [pick, *sorted(rest, key=lambda e: (-score(e), e.trial or 0))]


def need_of(spec: ModelSpec, config: LaunchConfig, devices: Sequence[Device], cpu: CpuProfile = CPU_AVX2
            ) -> dict[str, int]:
    """Bytes the config's plan allocates on each of `devices` (fitter.memory.plan.estimator)."""
    totals = estimate(spec, config, tuple(devices), cpu).totals()
    return {d.name: totals[d.name].total for d in devices if d.name in totals}


def measured_line(option: Option, spec: ModelSpec, devices: Sequence[Device], cpu: CpuProfile = CPU_AVX2
              ) -> LaunchLine | None:
    """The measured config with its need on the devices; None where the estimator (llama.cpp's rules) refuses it
    on them."""
    try:
        need = need_of(spec, option.config, devices, cpu)
    except FitterError:
        return None
    return LaunchLine(option.trial, tuple(pin(option.config, process=option.process)), need, option.speeds)


def replans(pick: Option, spec: ModelSpec, devices: Sequence[Device], cpu: CpuProfile = CPU_AVX2,
            min_ctx: int = DEFAULT_FIT_CTX) -> Iterator[LaunchLine]:
    """The pick moved toward less device memory, nearest first: at its own context the experts of one more layer on
    the CPU at a time (`-ncmoe`, common/common.h llm_add_n_cpu_ffn_overrides: the first layers'), up to every layer;
    then the same at each halved context (a multiple of 256, src/llama-context.cpp) down to `min_ctx` (llama.cpp's
    own --fit shrinks no further by default: common/common.h fit_params_min_ctx). Each one needs less on some
    device than every one before it, or it is left out (it could never be the first to fit)."""
    config = pick.config
    n, rest = split_ncmoe(config.overrides)
    layers = range(n, spec.n_layer + 1) if spec.n_expert > 0 else range(n, n + 1)
    ctx0 = config.ctx_size or spec.n_ctx_train
    contexts = [ctx0]
    while (c := contexts[-1] // 2 // CTX_PAD * CTX_PAD) >= max(min_ctx, CTX_PAD) and c < contexts[-1]:
        contexts.append(c)
    seen: list[dict[str, int]] = []
    for ctx in contexts:
        for k in layers:
            if ctx == ctx0 and k == n:
                continue
            moved = replace(config, ctx_size=ctx, overrides=(*ncmoe_rules(k), *rest))
            try:
                need = need_of(spec, moved, devices, cpu)
            except FitterError:
                continue
            if any(all(need[d] >= s.get(d, 0) for d in need) for s in seen):
                continue
            seen.append(need)
            change = [f"-ncmoe {n} → {k}"] if k != n else []
            change += [f"-c {ctx0} → {ctx}"] if ctx != ctx0 else []
            yield LaunchLine(pick.trial, tuple(pin(moved, process=pick.process)), need, pick.speeds,
                            ", ".join(change))


def fits(c: LaunchLine, room: dict[str, Room]) -> bool:
    return all(r.budget is None or c.need.get(name, 0) <= r.budget for name, r in room.items())


def _over(c: LaunchLine, room: dict[str, Room]) -> tuple[str, int]:
    """The device the candidate is most over its budget on (name, bytes over)."""
    over = {name: c.need.get(name, 0) - r.budget for name, r in room.items() if r.budget is not None}
    name = max(over, key=lambda k: over[k])
    return name, over[name]


def _needs(c: LaunchLine, room: dict[str, Room], name: str | None = None) -> str:
    names = [name] if name is not None else [n for n in c.need if n in room]
    return ", ".join(f"{size(c.need.get(n, 0))} on {n}" for n in names) or "no device memory"


def _speed(c: LaunchLine, pick: LaunchLine) -> str:
    parts = [f"{label} {c.speeds[k] / pick.speeds[k]:.2f}×" for k, label in (("tg", "decode"), ("pp", "prefill"))
             if c.speeds.get(k) and pick.speeds.get(k)]
    return " and ".join(parts) + " of it" if parts else "its speed unknown"


def choose(policy: str, measured: Sequence[LaunchLine], replanned: Iterable[LaunchLine], room: dict[str, Room],
           source: str = "the result") -> Choice:
    """The first of `measured` (the policy's order, its pick first) that fits every device's budget, else the first
    re-plan that does (`replanned` is read only that far), else none: the reason says what would fit."""
    if not measured:
        return Choice(None, f"{source}: no {policy} config the estimator accepts on these devices: nothing started")
    pick = measured[0]
    if fits(pick, room):
        judged = [n for n, r in room.items() if r.budget is not None]
        where = "; ".join(f"{size(pick.need.get(n, 0))} on {n}, {room[n].text()}" for n in judged)
        return Choice(pick, f"{policy} pick ({pick.label()}) needs {where or 'no device memory fitter can judge'}: "
                            "serving it")
    name, _ = _over(pick, room)
    head = f"{policy} needs {_needs(pick, room, name)}, {room[name].text()}"
    for c in measured[1:]:
        if fits(c, room):
            return Choice(c, f"{head}: serving {c.label()} ({_needs(c, room)}), {_speed(c, pick)}")
    least = min(measured, key=lambda c: _over(c, room)[1])
    for c in replanned:
        if fits(c, room):
            return Choice(c, f"{head}; no measured config fits: serving {c.label()} ({_needs(c, room)}); its "
                             "speed is not known")
        if _over(c, room)[1] < _over(least, room)[1]:
            least = c
    dev, short = _over(least, room)
    return Choice(None, f"{source}: no config fits the memory free now: {head}; the least any config or re-plan "
                        f"needs is {_needs(least, room, dev)} ({least.label()}), {size(short)} more than that leaves: "
                        "nothing started")
