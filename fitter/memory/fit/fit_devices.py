"""`fitter fit` on two or more GPUs: how many layers each device holds (`-ts` as layer counts, as llama.cpp's own
`--fit` writes it) and, per device, which of its layers keep their experts there, so every GPU is filled.

llama.cpp's default split follows free memory and knows nothing of experts: with `-ncmoe` or `--fit`'s last-N order
the layers whose experts go to the CPU are all on one device, and the other GPU stays mostly empty (llama.cpp
issues #15263, #15136). Here each device is filled on its own:

1. for a count of offloaded layers (`-ngl`, from the top as llama.cpp offloads), the layers are split over the
   devices in proportion to their budgets, then moved one at a time off any device whose dense part alone (every
   expert of its layers on the CPU) is over its budget;
2. each device keeps the experts of as many of its layers as fit (bisection per device, the others held; a few
   passes, since compute buffers depend a little on the whole graph), the rest go to the CPU (`-ot …=CPU`, the
   highest-numbered layers of each device's range, as llama.cpp's `--fit` orders them);
3. the split is improved by moving one layer between two devices while that puts more bytes on the devices;
4. on each device the next layer's expert tensors that still fit come back (up, gate, down: a partial layer);
5. the split is improved again a layer at a time, each split now judged with its partial layers: a layer's dense
   part moved to another device can free just the room one more expert tensor needs;
6. a device's partial layer may leave the rest of its experts on another device instead of the CPU (llama.cpp's
   `--fit` overflow to the next device, its patterns), which fills a device with room but no layer of its own to
   fill it with (e.g. one holding only the output layer).

So after the fit each GPU's free memory is at most its target plus about one layer's experts, unless it holds
every expert of its layers. Every candidate is judged by the estimator alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from fitter.flags import LaunchConfig, TensorOverride
from fitter.flags.overrides import EXPERT_KINDS, layer_experts_rule
from fitter.gguf.model_spec import ModelSpec, Role
from fitter.memory.backends.devices import CpuProfile, Device
from fitter.memory.plan.estimator import MemoryPlan, estimate, layer_devices, model_devices, place

# A plan when the config fits every device's budget, else None (fitter.memory.fit.fit._Search.fits).
Judge = Callable[[LaunchConfig], MemoryPlan | None]
_FILL_PASSES = 3
_MOVES = 64  # split improvements tried at most, per -ngl


# llama.cpp's --fit overflow of a device's partial layer to the next device (common/fit.cpp get_overflow_pattern):
# the expert kinds that stay on the device → the pattern of the layer's tensors that go (router included with gate).
_OVERFLOW = {(): "ffn_(gate|up|gate_up|down).*", ("up",): "ffn_(gate|gate_up|down).*", ("up", "gate"): "ffn_down.*"}


@dataclass(frozen=True)
class Layout:
    """One placement on N devices: layers per device (-ts), how many of each device's expert layers keep their
    experts there (the first ones of its range), on each device the expert kinds of the next layer that stay, and
    where the rest of that layer's experts go: the CPU, or another device (`spill`, llama.cpp's overflow)."""

    counts: tuple[float, ...]  # -ts: layer counts (the user's own values when given)
    keep: tuple[int, ...]
    partial: tuple[tuple[str, ...], ...]
    spill: tuple[int, ...] = ()  # per device: the device index the rest of its partial layer goes to, -1 the CPU


def split_by_budget(n: int, budgets: list[int]) -> tuple[int, ...]:
    """n layers in proportion to the budgets (largest remainder; a device without budget gets none)."""
    weights = [max(b, 0) for b in budgets]
    total = sum(weights) or 1
    exact = [n * w / total for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)[: n - sum(counts)]:
        counts[i] += 1
    return tuple(counts)


Found = tuple[LaunchConfig, MemoryPlan]


class DeviceSearch:
    """The search on N devices. Bisections judge a layout by its model and KV buffers (exact, no graph replay)
    plus the compute buffers of the last fully estimated layout with the same -ngl and split: a layout's compute
    buffers barely move with which experts it keeps. Every layout the search returns was then estimated in full
    and fits (`judge`)."""

    def __init__(self, spec: ModelSpec, devices: tuple[Device, ...], budgets: dict[str, int], judge: Judge,
                 base: LaunchConfig, cpu: CpuProfile,
                 planner: Callable[[LaunchConfig], MemoryPlan] | None = None) -> None:
        self.spec, self.devices, self.budgets, self.judge, self.base = spec, devices, budgets, judge, base
        self.cpu = cpu
        # a layout's full estimate, fitting or not (fit's own, which asks llama.cpp where fitter guesses)
        self.planner = planner or (lambda config: estimate(spec, config, devices, cpu))
        self.expert_layers = expert_layers(spec)
        self._judged: dict[tuple[int, Layout], Found | None] = {}
        self._compute: dict[tuple[int, tuple[float, ...]], dict[str, int]] = {}  # last full estimate's compute
        self._ranges: dict[tuple[int, tuple[float, ...]], list[list[int]]] = {}  # every judgment writes rules
        self._partial_splits: dict[tuple[int, tuple[float, ...]], tuple[Layout, Found] | None] = {}

    # -- a layout as llama.cpp flags -------------------------------------------------------------------------

    def ranges(self, ngl: int, counts: tuple[float, ...]) -> list[list[int]]:
        """Each device's expert layers under this -ngl and -ts, as the estimator assigns layers (load_tensors)."""
        key = (ngl, counts)
        if key not in self._ranges:
            self._ranges[key] = self._assign(ngl, counts)
        return self._ranges[key]

    def _assign(self, ngl: int, counts: tuple[float, ...]) -> list[list[int]]:
        config = replace(self.base, n_gpu_layers=ngl, tensor_split=tuple(float(c) for c in counts), overrides=())
        return expert_ranges(self.spec, self.devices, config, self.expert_layers)

    def config(self, ngl: int, layout: Layout) -> LaunchConfig:
        rules: list[TensorOverride] = []
        spill = layout.spill or (-1,) * len(layout.counts)
        for layers, keep, kinds, to in zip(self.ranges(ngl, layout.counts), layout.keep, layout.partial, spill,
                                           strict=True):
            to_cpu = layers[keep:]
            if to >= 0 and to_cpu:  # these kinds stay, the rest of the layer's experts go to device `to`
                rules.append(TensorOverride(rf"blk\.{to_cpu[0]}\.{_OVERFLOW[kinds]}", self.devices[to].name))
                to_cpu = to_cpu[1:]
            elif kinds and to_cpu:  # the first layer sent to the CPU keeps these expert tensors on its device
                gone = [k for k in EXPERT_KINDS if k not in kinds]
                rules.append(TensorOverride(rf"blk\.{to_cpu[0]}\.ffn_({'|'.join(gone)})_(ch|)exps", "CPU"))
                to_cpu = to_cpu[1:]
            rules += [layer_experts_rule(il) for il in to_cpu]
        return replace(self.base, n_gpu_layers=ngl, tensor_split=tuple(float(c) for c in layout.counts),
                       overrides=tuple(rules))

    # -- judging ---------------------------------------------------------------------------------------------

    def judged(self, ngl: int, layout: Layout) -> Found | None:
        """The full estimate, when the layout fits."""
        key = (ngl, layout)
        if key not in self._judged:  # the split's moves come back to layouts judged before
            config = self.config(ngl, layout)
            plan = self.judge(config)
            self._judged[key] = (config, plan) if plan is not None else None
            if plan is not None:
                totals = plan.totals()
                self._compute[(ngl, layout.counts)] = {d.name: totals[d.name].compute for d in self.devices}
        return self._judged[key]

    def _bytes(self, ngl: int, layout: Layout) -> list[int] | None:
        """Each device's bytes as the bisections judge them: model and KV exact, compute as last estimated."""
        compute = self._compute.get((ngl, layout.counts))
        if compute is None:
            found = self.judged(ngl, layout)
            if found is None:
                return None
            totals = found[1].totals()
            return [totals[d.name].total for d in self.devices]
        static = place(self.spec, self.config(ngl, layout), self.devices, self.cpu).device_bytes()
        return [static.get(d.name, 0) + compute[d.name] for d in self.devices]

    def _within(self, used: list[int] | None) -> bool:
        return used is not None and all(u <= self.budgets[d.name] for u, d in zip(used, self.devices, strict=True))

    def _fits(self, ngl: int, layout: Layout) -> bool:
        return self._within(self._bytes(ngl, layout))

    # -- the search ------------------------------------------------------------------------------------------

    def place(self, ngl: int, counts: tuple[float, ...] | None = None) -> Found | None:
        """The best layout with this -ngl (`counts`: the user's -ts, kept), or None when even the dense parts do
        not fit."""
        best = self.whole_layers(ngl, counts)
        if best is None:
            return None
        best = self._partials(ngl, best)
        if counts is None:  # step 5: the split improved again, each split judged with its partial layers
            best = self._improve_split(ngl, best, self._with_partials)
        return self._spills(ngl, best)[1]

    def _with_partials(self, ngl: int, counts: tuple[float, ...]) -> tuple[Layout, Found] | None:
        """A split's experts per device (_fill), then its partial layers (_partials). A layer moved to another
        device takes its dense part with it, which can free just the room one more expert tensor needs (gpt-oss-20b
        on 6144+6144 MiB, -fitt 1024, llama-fit-params' outputs: -ts 12,13 and a partial layer on device 0 hold one
        expert tensor more than -ts 13,12, where neither device has room for one)."""
        key = (ngl, counts)
        if key not in self._partial_splits:
            found = self._fill(ngl, counts)
            self._partial_splits[key] = None if found is None else self._partials(ngl, found)
        return self._partial_splits[key]

    def whole_layers(self, ngl: int, counts: tuple[float, ...] | None = None) -> tuple[Layout, Found] | None:
        """The best layout of whole layers (no partial layer): steps 1-3. `counts`: a split kept as it is."""
        n_on = self.spec.n_layer + 1 if ngl < 0 else min(ngl, self.spec.n_layer + 1)
        fixed_split = counts is not None
        if counts is None:
            counts = self._dense_fit(ngl, split_by_budget(n_on, [self.budgets[d.name] for d in self.devices]))
            if counts is None:
                return None
        best = self._fill(ngl, counts)
        if best is None:
            return None
        return best if fixed_split else self._improve_split(ngl, best)

    def _empty(self, counts: tuple[float, ...]) -> Layout:
        return Layout(counts, (0,) * len(counts), ((),) * len(counts))

    def _dense_fit(self, ngl: int, counts: tuple[float, ...]) -> tuple[float, ...] | None:
        """Move layers off devices whose dense part is over budget (to the device with the most budget left)."""
        for _ in range(int(sum(counts)) + 1):
            if self.judged(ngl, self._empty(counts)) is not None:
                return counts
            plan = _estimate(self, ngl, self._empty(counts))
            over = _slack(plan, self.devices, self.budgets)
            worst = min(range(len(counts)), key=lambda i: over[i])
            roomiest = max((i for i in range(len(counts)) if i != worst), key=lambda i: over[i])
            if counts[worst] < 1 or over[roomiest] <= 0:
                return None
            counts = tuple(c - (i == worst) + (i == roomiest) for i, c in enumerate(counts))
        return None

    def _fill(self, ngl: int, counts: tuple[float, ...]) -> tuple[Layout, Found] | None:
        """Each device keeps the experts of as many of its layers as fit, the others held (bisection), then the
        layout is estimated in full; while that is over a budget, the device most over keeps one layer fewer."""
        empty = self._empty(counts)
        start = self.judged(ngl, empty)
        if start is None:
            return None
        ranges = self.ranges(ngl, counts)
        keep = [0] * len(counts)
        for _ in range(_FILL_PASSES):
            changed = False
            used = self._bytes(ngl, Layout(counts, tuple(keep), empty.partial)) or []
            slack = [self.budgets[d.name] - u for d, u in zip(self.devices, used, strict=True)]
            for d in sorted(range(len(counts)), key=lambda i: -slack[i]):
                lo, hi = keep[d], len(ranges[d])  # the largest count that fits lies in [lo, hi]
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if self._fits(ngl, Layout(counts, tuple(mid if i == d else k for i, k in enumerate(keep)),
                                              empty.partial)):
                        lo = mid
                    else:
                        hi = mid - 1
                if lo != keep[d]:
                    keep[d], changed = lo, True
            if not changed:
                break
        while True:
            layout = Layout(counts, tuple(keep), empty.partial)
            found = self.judged(ngl, layout)
            if found is not None:
                return self._one_more(ngl, layout, found, ranges)
            plan = _estimate(self, ngl, layout)
            over = _slack(plan, self.devices, self.budgets)
            worst = min((i for i in range(len(keep)) if keep[i]), key=lambda i: over[i], default=None)
            if worst is None:
                return empty, start
            keep[worst] -= 1

    def _one_more(self, ngl: int, layout: Layout, found: Found, ranges: list[list[int]]) -> tuple[Layout, Found]:
        """Fully estimated, one more layer's experts on a device may still fit: the judged compute was high."""
        for d in range(len(layout.keep)):
            while layout.keep[d] < len(ranges[d]):
                more = replace(layout, keep=tuple(k + (i == d) for i, k in enumerate(layout.keep)))
                more_found = self.judged(ngl, more)
                if more_found is None:
                    break
                layout, found = more, more_found
        return layout, found

    def _improve_split(self, ngl: int, best: tuple[Layout, Found],
                       fill: Callable[[int, tuple[float, ...]], tuple[Layout, Found] | None] | None = None,
                       ) -> tuple[Layout, Found]:
        """Move one layer from device i to device j while that puts more on the devices; each split judged by `fill`
        (default: whole layers, _fill)."""
        fill = fill or self._fill
        n = len(best[0].counts)
        for _ in range(_MOVES):
            improved = False
            for i in range(n):
                for j in range(n):
                    counts = best[0].counts
                    if i == j or counts[i] < 1:
                        continue
                    moved = tuple(c - (k == i) + (k == j) for k, c in enumerate(counts))
                    found = fill(ngl, moved)
                    if found is not None and better(found[1][1], best[1][1]):
                        best, improved = found, True
            if not improved:
                break
        return best

    def _partials(self, ngl: int, best: tuple[Layout, Found]) -> tuple[Layout, Found]:
        """On each device the next layer's expert tensors that still fit come back: of the kinds whose model and KV
        buffers fit, the fullest is estimated first, until one fits in full."""
        ranges = self.ranges(ngl, best[0].counts)
        for d in range(len(best[0].counts)):
            if best[0].keep[d] >= len(ranges[d]):
                continue
            options = []
            for kinds in [*((a, b) for i, a in enumerate(EXPERT_KINDS) for b in EXPERT_KINDS[i + 1:]),
                          *((k,) for k in EXPERT_KINDS)]:
                layout = replace(best[0], partial=tuple(kinds if i == d else p for i, p in enumerate(best[0].partial)))
                used = self._bytes(ngl, layout)
                if used is not None and self._within(used):
                    options.append((sum(used), layout))
            for _, layout in sorted(options, key=lambda o: -o[0]):
                found = self.judged(ngl, layout)
                if found is not None:
                    if better(found[1], best[1][1]):
                        best = (layout, found)
                    break
        return best

    def _spills(self, ngl: int, best: tuple[Layout, Found]) -> tuple[Layout, Found]:
        """Step 6, llama.cpp's overflow: a device's partial layer split with another device instead of the CPU
        (llama.cpp's --fit writes it for the next device, e.g. -ts 8,1 with `blk.0.ffn_(gate|gate_up|down).*` on
        the second GPU, which holds only the output layer). For each device and each other device (the next one
        first): the up kind staying and the rest going, then up and gate staying, else every expert kind going
        (llama.cpp's order); a layout that fits and puts more on the devices is kept."""
        n = len(best[0].counts)
        ranges = self.ranges(ngl, best[0].counts)
        for d in range(n):
            if best[0].keep[d] >= len(ranges[d]):
                continue
            for e in sorted((e for e in range(n) if e != d), key=lambda e: (e != d + 1, e)):
                found = self._spilled(ngl, best[0], d, e, ("up",))
                if found is not None:
                    found = self._spilled(ngl, best[0], d, e, ("up", "gate")) or found
                else:
                    found = self._spilled(ngl, best[0], d, e, ())
                if found is not None and better(found[1][1], best[1][1]):
                    best = found
                    break
        return best

    def _spilled(self, ngl: int, layout: Layout, d: int, e: int, kinds: tuple[str, ...]) -> tuple[Layout, Found] | None:
        """`layout` with device d's partial layer keeping `kinds` and the rest of its experts on device e, when it
        fits."""
        spill = tuple(e if i == d else s for i, s in enumerate(layout.spill or (-1,) * len(layout.counts)))
        partial = tuple(kinds if i == d else p for i, p in enumerate(layout.partial))
        variant = replace(layout, spill=spill, partial=partial)
        found = self.judged(ngl, variant)
        return None if found is None else (variant, found)


def expert_layers(spec: ModelSpec) -> list[int]:
    """The layers that have expert tensors, in order."""
    return sorted({t.layer for t in spec.tensors if t.role is Role.EXPERT and t.layer is not None})


def expert_ranges(spec: ModelSpec, devices: tuple[Device, ...], config: LaunchConfig,
                  layers: list[int] | None = None) -> list[list[int]]:
    """Each device's layers that have experts (`layers`, else the spec's), in order, as llama.cpp assigns layers
    (load_tensors); under -sm none only -mg's device holds any."""
    layer_dev = layer_devices(spec, config, model_devices(config, devices))
    index = {d.name: i for i, d in enumerate(devices)}
    out: list[list[int]] = [[] for _ in devices]
    for il in expert_layers(spec) if layers is None else layers:
        dev = layer_dev[il]
        if dev is not None:
            out[index[dev.name]].append(il)
    return out


def _estimate(search: DeviceSearch, ngl: int, layout: Layout) -> MemoryPlan:
    """A layout's full estimate, fitting or not: which device is over, and by how much."""
    return search.planner(search.config(ngl, layout))


def _slack(plan: MemoryPlan, devices: tuple[Device, ...], budgets: dict[str, int]) -> list[int]:
    totals = plan.totals()
    return [budgets[d.name] - totals[d.name].total for d in devices]


def better(a: MemoryPlan, b: MemoryPlan) -> bool:
    """More device memory put to use, then more weights on the devices."""
    def key(p: MemoryPlan) -> tuple[int, int]:
        totals = p.totals()
        return (sum(totals[d.name].total for d in p.devices), sum(totals[d.name].model for d in p.devices))
    return key(a) > key(b)
