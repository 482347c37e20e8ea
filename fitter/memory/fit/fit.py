"""`fitter fit`: the placement that puts the most useful bytes on the GPU(s) within free memory minus a target.

Every candidate is judged by the estimator alone (no model is loaded). For a MoE model the search starts from the
seeds' recipe, all layers on the GPU and the smallest `-ncmoe N` that fits, and also tries llama.cpp's `--fit` order
(the experts of the last layers on the CPU), whichever expert tensors of the boundary layer still fit (`-ot`), and a
few lower `-ngl` values once every expert on the CPU fits; of all placements that fit it keeps the one that uses the
most device memory, then the most weights. A dense model gets the largest `-ngl`; an `-ngl` the user gives is kept,
and then "nothing fits" is a real answer, with what would fit instead. With `-c 0` the placement is found at
`--fit-ctx` (default 4096, as llama.cpp's `--fit-ctx`) and the context then grows to the largest that still fits,
up to the model's training context.

llama.cpp's own `--fit` (common/fit.cpp) only ever moves the experts of the highest-numbered layers and whole layers;
placements differ in their compute buffers (the graph splits differently), so fitter judges both orders.

On two or more GPUs with no split given (-sm, -ts, -mg), fit also places the model under `-sm tensor` where llama.cpp
runs it (the GPUs as one Meta device, placed as one GPU) and keeps that placement only where it holds the whole model
and the layer split's best does not (a Meta device offloads no op: with weights left on the CPU, tensor mode's
prefill computes them there instead of copying them to a GPU, a trade of speed); llama.cpp's own `--fit` refuses
`-sm tensor`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from fitter.errors import FitterError
from fitter.flags import LaunchConfig
from fitter.flags.overrides import EXPERT_KINDS, experts_rules, ncmoe_rules
from fitter.gguf.model_spec import ModelSpec, Role
from fitter.memory.backends.devices import CPU_AVX2, CpuProfile, Device
from fitter.memory.fit.budgets import (
    DEFAULT_FIT_CTX,
    DEFAULT_FIT_TARGET_MIB,
    device_budgets,
    lowered_targets,
    target_of,
)
from fitter.memory.fit.fit_devices import DeviceSearch, better, expert_layers
from fitter.memory.plan.estimator import MemoryPlan, complete, estimate, model_devices, place
from fitter.memory.plan.projected import Projects, guessed_kinds, with_projection
from fitter.memory.plan.tensor_split import meta_buft_name, tensor_mode_runs
from fitter.units import MIB


@dataclass(frozen=True)
class FitResult:
    fits: bool
    config: LaunchConfig
    plan: MemoryPlan
    budgets: dict[str, int]  # device → free memory minus the fit target
    expert_layers_on_device: int
    shortfall: int | None  # bytes over budget on the worst device, when nothing fits
    suggestions: tuple[str, ...]


def _device_bytes(plan: MemoryPlan) -> dict[str, int]:
    totals = plan.totals()
    return {d.name: totals[d.name].total for d in plan.devices}


def _over(plan: MemoryPlan, budgets: dict[str, int]) -> int:
    """Bytes by which the worst device exceeds its budget (≤ 0 when everything fits)."""
    used = _device_bytes(plan)
    return max(used[name] - budget for name, budget in budgets.items())


_EXACT_PASSES = 4  # searches before a placement whose full estimate fits is given up on (one, unless a judgment misled)


class _Search:
    def __init__(self, spec: ModelSpec, devices: tuple[Device, ...], budgets: dict[str, int], cpu: CpuProfile,
                 projects: Projects | None = None):
        self.spec, self.devices, self.budgets, self.cpu = spec, devices, budgets, cpu
        self.projects = projects
        self.source = projects.source if projects is not None else ""
        self.guessed = guessed_kinds(spec, devices) if projects is not None else ()  # () without a projector
        # A projection costs a no-alloc load (~0.5-0.8 s on a 62-layer MoE) and fit judges dozens of placements.
        # Which layers sit on which device at one context decides the KV cache, and the compute buffers barely move
        # with the experts, so the search judges a placement by a projection of one with the same layers and
        # context (its hint); the placement fit returns is projected itself (`exact`).
        self._hints: dict[object, Mapping[str, Mapping[str, int]]] = {}
        # Judged on the prompt graph alone (estimator.complete's prompt_only; a fit replays dozens of graphs, and the
        # one-token graph is the larger only on the host, which no budget holds); what fit returns is estimated in
        # full, and where a device's figure differs the search runs again in full
        self.prompt_only = projects is None
        self.tried = 0

    def plan(self, config: LaunchConfig) -> MemoryPlan:
        self.tried += 1
        return self._own_projection(estimate(self.spec, config, self.devices, self.cpu))

    def exact(self, plan: MemoryPlan) -> MemoryPlan:
        """A judged plan in full: both graphs sized, and what fitter guesses taken from the build's projection of
        this very config."""
        if self.prompt_only:  # never with a projector
            return estimate(self.spec, plan.config, self.devices, self.cpu)
        return self._own_projection(plan)

    def _own_projection(self, plan: MemoryPlan) -> MemoryPlan:
        return with_projection(plan, self._project(plan), self.source) if self.guessed else plan

    def _project(self, plan: MemoryPlan) -> Mapping[str, Mapping[str, int]]:
        assert self.projects is not None
        projection = self.projects(plan.config)
        self._hints.setdefault((plan.context, plan.layer_devices), projection)
        return projection

    def hinted(self, config: LaunchConfig) -> MemoryPlan:
        """A full estimate that takes what fitter guesses from the hint (the N-device search's planner)."""
        return self._hinted(estimate(self.spec, config, self.devices, self.cpu))

    def _hinted(self, plan: MemoryPlan) -> MemoryPlan:
        if not self.guessed:
            return plan
        if "model" in self.guessed:  # a backend without rules: where the experts sit moves its model buffers too
            return with_projection(plan, self._project(plan), self.source)
        hint = self._hints.get((plan.context, plan.layer_devices))
        return with_projection(plan, hint if hint is not None else self._project(plan), self.source)

    def fits(self, config: LaunchConfig) -> MemoryPlan | None:
        """The plan when it fits, else None. A placement whose model and KV buffers alone exceed a budget is
        rejected before its compute graph is replayed: compute buffers only add to a device's bytes. Where fitter
        guesses a kind, the plan takes it from the hint (see __init__); only the model buffers are judged before."""
        self.tried += 1
        placed = place(self.spec, config, self.devices, self.cpu)
        static: dict[str, int] = {}
        for b in placed.buffers:
            if b.kind not in self.guessed:
                static[b.device] = static.get(b.device, 0) + b.bytes
        if any(static.get(name, 0) > budget for name, budget in self.budgets.items()):
            return None
        plan = self._hinted(complete(self.spec, config, self.devices, placed, self.prompt_only))
        return plan if _over(plan, self.budgets) <= 0 else None


def _expert_layers_on_device(plan: MemoryPlan) -> int:
    """Layers with at least one expert tensor on a device."""
    names = {d.name for d in plan.devices} | {meta_buft_name(plan.devices)}  # -sm tensor: the Meta() buffer type
    return len({p.tensor.layer for p in plan.placements if p.tensor.role is Role.EXPERT and p.buft in names})


def _place(s: _Search, base: LaunchConfig) -> tuple[LaunchConfig, MemoryPlan] | None:
    if len(s.devices) > 1 and base.split_mode == "layer":
        across = _place_across(s, base)
        if not _tensor_too(s, base):
            return across
        # -sm tensor: the GPUs as one Meta device, placed as one GPU is; kept only where it holds the whole model
        # and the layer split cannot. Where the CPU keeps weights, the Meta device offloads no op
        # (ggml-backend-meta.cpp: offload_op = nullptr): the CPU computes its weights' prompt itself where the layer
        # split's op offload copies them to a GPU, a trade of speed bytes cannot judge, as is the GPUs' link where
        # both hold the model (fitter tune measures both). llama.cpp's own --fit refuses -sm tensor.
        tensor = (_place_moe if s.spec.n_expert else _place_layers)(s, replace(base, split_mode="tensor"))
        if tensor is not None and _all_on_devices(tensor[1]) and (across is None or _cpu_weight_bytes(across[1])
                                                                   > _cpu_weight_bytes(tensor[1])):
            return tensor
        return across
    return (_place_moe if s.spec.n_expert else _place_layers)(s, base)


def _tensor_too(s: _Search, base: LaunchConfig) -> bool:
    """Whether fit also tries -sm tensor: the flags leave the split mode and the layer split to it, llama.cpp splits
    the architecture over these devices with flash attention (fitter.memory.plan.tensor_split.check_tensor_mode),
    and no build's projection is asked (llama-fit-params, which projects, refuses -sm tensor)."""
    if {"split_mode", "tensor_split", "main_gpu"} & base.given or s.projects is not None:
        return False
    try:
        n = len(model_devices(replace(base, split_mode="tensor"), s.devices))
    except FitterError:  # -dev or -ts llama.cpp refuses: the layer split's estimate says so
        return False
    return tensor_mode_runs(s.spec, base, n)


def _all_on_devices(plan: MemoryPlan) -> bool:
    """Every weight the graph computes with on a device: the host keeps only the token embedding (a row lookup)."""
    on_devices = {d.name for d in plan.devices} | {meta_buft_name(plan.devices)}
    return all(p.buft in on_devices or p.tensor.role is Role.EMBEDDING for p in plan.placements)


def _cpu_weight_bytes(plan: MemoryPlan) -> int:
    """Weight bytes left in host memory: the tensors on no device (nor the Meta device of -sm tensor)."""
    on_devices = {d.name for d in plan.devices} | {meta_buft_name(plan.devices)}
    return sum(p.tensor.n_bytes for p in plan.placements if p.buft not in on_devices)


def _place_across(s: _Search, base: LaunchConfig) -> tuple[LaunchConfig, MemoryPlan] | None:
    """Two or more devices (fitter.memory.fit.fit_devices): -ts and each device's experts, for each -ngl from all
    layers down (an -ngl or -ts the user gave is kept); below the first -ngl that fits, two more are tried, where
    whole layers' KV traded for experts can still pay."""
    search = DeviceSearch(s.spec, s.devices, s.budgets, s.fits, base, s.cpu, s.hinted)
    n_layer = s.spec.n_layer
    fixed = base.n_gpu_layers != -1
    ngl_values = [base.n_gpu_layers] if fixed else list(range(n_layer + 1, -1, -1))
    counts = base.tensor_split or None
    best: tuple[LaunchConfig, MemoryPlan] | None = None
    first_fitting: int | None = None
    for ngl in ngl_values:
        if first_fitting is not None and (ngl < first_fitting - 2 or not s.spec.n_expert):
            break
        if ngl == 0:  # nothing on the devices: the split and the experts are moot
            config = replace(base, n_gpu_layers=0, overrides=())
            plan = s.fits(config)
            found = (config, plan) if plan is not None else None
        else:
            found = search.place(-2 if ngl == n_layer + 1 and not fixed else ngl, counts)
        if found is None:
            continue
        first_fitting = ngl if first_fitting is None else first_fitting
        if best is None or better(found[1], best[1]):
            best = found
    return best


def _cpu_layers(layers: list[int], n: int, from_top: bool) -> list[int]:
    """The layers whose experts go to the CPU for n of the model's expert layers (`layers`): the last n (llama.cpp's
    --fit), or every layer up to the n-th expert layer, as -ncmoe counts them (-ncmoe 3 moves nothing on DeepSeek-V3,
    whose first 3 layers are dense; a skipped NextN block has no experts to move)."""
    if from_top:
        return layers[len(layers) - n:]
    return list(range(layers[n - 1] + 1)) if n else []


def _better(a: tuple[LaunchConfig, MemoryPlan] | None, b: tuple[LaunchConfig, MemoryPlan]) -> bool:
    """More device memory put to use, then more weights on the devices."""
    return a is None or better(b[1], a[1])


def _place_moe(s: _Search, base: LaunchConfig) -> tuple[LaunchConfig, MemoryPlan] | None:
    """Search layers on the GPU × how many layers' experts go to the CPU (first or last ones, as -ncmoe or as
    llama.cpp's --fit) × which expert tensors of the boundary layer come back, keeping the placement that fits and
    uses the most device memory. For each -ngl the count of expert layers is found by bisection (more experts on the
    CPU never needs more device memory); -ngl is only lowered below the first value where every expert on the CPU
    fits by two more steps, where whole layers' KV traded for experts can still pay."""
    n_layer = s.spec.n_layer
    with_experts = expert_layers(s.spec)
    fixed = base.n_gpu_layers != -1
    ngl_values = [base.n_gpu_layers] if fixed else list(range(n_layer + 1, -1, -1))
    best: tuple[LaunchConfig, MemoryPlan] | None = None
    first_fitting_ngl: int | None = None
    for ngl in ngl_values:
        if first_fitting_ngl is not None and ngl < first_fitting_ngl - 2:
            break
        layered = replace(base, n_gpu_layers=-2 if ngl == n_layer + 1 and not fixed else ngl)
        all_cpu = replace(layered, overrides=experts_rules(_cpu_layers(with_experts, len(with_experts), False)))
        plan_all_cpu = s.fits(all_cpu)
        if plan_all_cpu is None:
            continue
        first_fitting_ngl = ngl if first_fitting_ngl is None else first_fitting_ngl
        if _better(best, (all_cpu, plan_all_cpu)):
            best = (all_cpu, plan_all_cpu)
        for from_top in (False, True):
            lo, hi = 0, len(with_experts)  # the smallest count of CPU expert layers that fits lies in [lo, hi]
            found: dict[int, tuple[LaunchConfig, MemoryPlan]] = {hi: (all_cpu, plan_all_cpu)}
            while lo < hi:
                mid = (lo + hi) // 2
                config = replace(layered, overrides=experts_rules(_cpu_layers(with_experts, mid, from_top)))
                plan = s.fits(config)
                if plan is not None:
                    hi, found[mid] = mid, (config, plan)
                else:
                    lo = mid + 1
            n = lo
            if _better(best, found[n]):
                best = found[n]
            if n == 0:
                continue
            # the boundary layer: whichever of its expert tensors still fit go back to the device
            cpu_layers = _cpu_layers(with_experts, n, from_top)
            boundary = cpu_layers[0] if from_top else cpu_layers[-1]
            rest = [i for i in cpu_layers if i != boundary]
            # two of its expert kinds on the CPU first, then one: one kind on the CPU keeps more on the device than
            # any pair holding it, so it cannot fit where such a pair does not (more on the device never needs less
            # device memory, as the bisection takes) and is not estimated (each full estimate replays the graph
            # twice: half of a DeepSeek-V3 fit's time went to those)
            pairs = [(a, b) for i, a in enumerate(EXPERT_KINDS) for b in EXPERT_KINDS[i + 1:]]
            over: set[str] = set()  # kinds in a pair that did not fit
            for to_cpu in [*pairs, *((k,) for k in EXPERT_KINDS)]:
                if len(to_cpu) == 1 and to_cpu[0] in over:
                    continue
                config = replace(layered, overrides=experts_rules(rest, boundary, to_cpu))
                plan = s.fits(config)
                if plan is None:
                    over.update(to_cpu)
                elif _better(best, (config, plan)):
                    best = (config, plan)
    if best is None and not fixed:
        return None
    return best


def _place_layers(s: _Search, base: LaunchConfig) -> tuple[LaunchConfig, MemoryPlan] | None:
    """The most layers that fit; an -ngl the user gave is kept as it is."""
    choices = range(s.spec.n_layer + 1, -1, -1) if base.n_gpu_layers == -1 else (base.n_gpu_layers,)
    for ngl in choices:
        config = replace(base, n_gpu_layers=ngl)
        plan = s.fits(config)
        if plan is not None:
            return config, plan
    return None


def _grow_context(s: _Search, config: LaunchConfig, plan: MemoryPlan) -> tuple[LaunchConfig, MemoryPlan]:
    """The largest context (a multiple of 256, up to the training context) that still fits this placement."""
    lo, hi = config.ctx_size // 256, s.spec.n_ctx_train // 256
    best = (config, plan)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        candidate = replace(config, ctx_size=mid * 256)
        candidate_plan = s.fits(candidate)
        if candidate_plan is not None:
            lo, best = mid, (candidate, candidate_plan)
        else:
            hi = mid - 1
    return best


def _lightest(s: _Search, base: LaunchConfig) -> LaunchConfig:
    """The least a placement can put on the devices: every expert on the CPU, and no layers unless -ngl was given."""
    ngl = 0 if base.n_gpu_layers == -1 else base.n_gpu_layers
    return replace(base, n_gpu_layers=ngl, overrides=ncmoe_rules(s.spec.n_layer) if s.spec.n_expert else ())


def _suggestions(s: _Search, base: LaunchConfig, plan: MemoryPlan, targets_mib: tuple[int, ...]
                 ) -> tuple[str, ...]:
    """What would fit instead, each checked with the estimator at the lightest placement."""
    lightest = _lightest(s, base)
    ctx = plan.context.n_ctx
    variants: list[tuple[str, LaunchConfig]] = [
        (f"-c {max(256, ctx // 2 // 256 * 256)}", replace(base, ctx_size=max(256, ctx // 2 // 256 * 256))),
        ("-c 4096", replace(base, ctx_size=4096)),
        ("-fa on", replace(base, flash_attn="on")),
        ("-ctk q8_0 -ctv q8_0 -fa on", replace(base, cache_type_k="q8_0", cache_type_v="q8_0", flash_attn="on")),
        ("-ub 256", replace(base, ubatch_size=256)),
        ("-ub 128", replace(base, ubatch_size=128)),
        ("-nkvo", replace(base, no_kv_offload=True)),
        # CUDA copies CPU weights into its compute buffer for big batches (op offload)
        ("--no-op-offload", replace(base, no_op_offload=True)),
    ]
    out = []
    for label, variant in variants:
        if variant == base:
            continue
        try:
            placed = _place(s, variant)
        except FitterError:
            continue
        if placed is not None:
            used = max(_device_bytes(placed[1]).values())
            out.append(f"{label}: fits ({used / MIB:.0f} MiB on the busiest device)")
    if not out and (lower := _lower_targets(s, lightest, plan, targets_mib)) is not None:
        out.append(lower)
    return tuple(out)


def _lower_targets(s: _Search, lightest: LaunchConfig, plan: MemoryPlan, targets_mib: tuple[int, ...]) -> str | None:
    """The fit targets under which the lightest placement (`plan`) fits, or the device too small for it at any
    target."""
    used = _device_bytes(plan)
    placement = "with nothing offloaded" if lightest.n_gpu_layers == 0 else \
        f"at -ngl {lightest.n_gpu_layers} with every expert on the CPU"
    over = [used.get(d.name, 0) - s.budgets[d.name] for d in s.devices]
    lower = lowered_targets([o / MIB for o in over], targets_mib)
    why = []
    for i, d in enumerate(s.devices):
        need = used.get(d.name, 0)
        room = s.budgets[d.name] + target_of(targets_mib, i) * MIB  # its free memory less its overhead (CUDA's context)
        if lower is None and need > room:  # over by more than its target: no target makes room
            return (f"a device with more room: {d.name} needs {need / MIB:.0f} MiB {placement}, more than the "
                    f"{max(room, 0) / MIB:.0f} MiB it has free after its backend's own overhead")
        if over[i] > 0:
            why.append(f"{d.name} needs {need / MIB:.0f} MiB {placement}, of its {room / MIB:.0f} MiB free")
    return f"--fit-target {','.join(map(str, lower or ()))}: fits ({'; '.join(why)})" if why else None


def fit(
    spec: ModelSpec,
    base: LaunchConfig,
    devices: tuple[Device, ...],
    targets_mib: tuple[int, ...] = (DEFAULT_FIT_TARGET_MIB,),
    fit_ctx: int = DEFAULT_FIT_CTX,
    cpu: CpuProfile = CPU_AVX2,
    projects: Projects | None = None,
) -> FitResult:
    """The placement; with `projects` the memory fitter only guesses for the model is llama.cpp's own projection
    (the placement returned is projected itself, and searched again within less room while it is over)."""
    if not devices:
        raise FitterError("fitter fit: no GPU to fit onto (no NVIDIA GPU found); give --devices cuda:MiB, "
                          "--emulated-gpu MiB or --rpc HOST:PORT")
    budgets: dict[str, int] = {}
    for name, budget in device_budgets(devices, targets_mib).items():
        if budget is None:
            raise FitterError(f"{name}: its free memory is unknown; give --devices cuda:MiB or --emulated-gpu MiB")
        budgets[name] = budget
    s = _Search(spec, devices, budgets, cpu, projects)
    auto_ctx = base.ctx_size == 0
    start = replace(base, ctx_size=min(fit_ctx, spec.n_ctx_train)) if auto_ctx else base
    for _ in range(_EXACT_PASSES):
        placed = _place(s, start)
        if placed is None:
            break
        config, plan = placed
        if auto_ctx:
            config, plan = _grow_context(s, config, plan)
        exact = s.exact(plan)
        if s.prompt_only and _device_bytes(exact) != _device_bytes(plan):
            s.prompt_only = False  # a device's one-token graph is the larger: judge every placement in full
            continue
        over = {name: used - budgets[name] for name, used in _device_bytes(exact).items() if name in budgets}
        if max(over.values()) <= 0:
            return FitResult(True, config, exact, budgets, _expert_layers_on_device(exact), None, ())
        # its own projection is over where its hint was not: search again with that much less room there
        s.budgets = {name: room - max(over.get(name, 0), 0) for name, room in s.budgets.items()}
    s.budgets = budgets
    lightest = _lightest(s, start)
    plan = s.plan(lightest)
    return FitResult(False, lightest, plan, budgets, 0, _over(plan, budgets), _suggestions(s, start, plan, targets_mib))
