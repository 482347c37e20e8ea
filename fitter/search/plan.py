"""The structure a person would use to search: the estimator's verdict on each candidate (cached), the placement
that reads the fewest weight bytes from RAM per token for each batch/KV combination, the first trials (decode
first, prefill first, least VRAM) and the one-parameter neighbours of a trial."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from fitter.errors import FitterError
from fitter.flags import LaunchConfig
from fitter.memory.fit.fit_devices import DeviceSearch
from fitter.memory.plan.estimator import MemoryPlan
from fitter.memory.plan.projected import guessed_kinds
from fitter.search import split
from fitter.search.request import (
    CTX_KEY,
    THREAD_KEYS,
    TRADE_DEFAULTS,
    Candidate,
    TuneRequest,
    _choices,
    _default_choice,
    _default_distance,
    candidate,
    combos,
    is_placement_key,
)
from fitter.search.screen import Budgets, Screen, cpu_bytes_per_token, device_totals, screen
from fitter.search.space import is_valid_combination


class Screener:
    """The estimator's verdicts, cached by launch config (threads never change memory); and the best placement of
    each combo."""

    def __init__(self, req: TuneRequest) -> None:
        self.req = req
        self._cache: dict[object, Screen] = {}
        self._spreads: dict[object, dict[str, Any] | None] = {}  # a multi-device search per context and split
        self.budgets = req.budgets
        self.guessed = guessed_kinds(req.spec, req.devices)

    def learn_margin(self, device: str, margin: int) -> None:
        self.budgets = self.budgets.with_margin(device, margin)
        self._cache.clear()
        self._spreads.clear()

    def __call__(self, cand: Candidate) -> Screen:
        key: object = cand.config if cand.error is None else cand.key
        if key not in self._cache:
            reason = cand.error or is_valid_combination(cand.params)
            if reason is not None:
                self._cache[key] = Screen(None, {}, reason)
            elif self.guessed and self.req.projector is not None:  # what fitter would guess is the build's
                projection = self.req.projector(cand.config)
                s = screen(self.req.spec, cand.config, self.req.devices, self.req.cpu, self.budgets,
                           (projection, self.req.projector.source))
                self._cache[key] = s.with_projection(projection, self.budgets) if s.feasible else s
            else:
                s = screen(self.req.spec, cand.config, self.req.devices, self.req.cpu, self.budgets)
                if s.feasible and self.req.projector is not None:  # the drift guard: ask the build too
                    s = s.with_projection(self.req.projector(cand.config), self.budgets)
                self._cache[key] = s
        return self._cache[key]

    def placement(self, params: dict[str, Any]) -> dict[str, Any] | None:
        """`params` completed with the placement that reads the fewest bytes from RAM and still fits: the smallest
        `-ncmoe` or the largest `-ngl` in the space (memory is monotone in both, so bisection); on several devices
        fitter fit's split (fitter.search.split), or with split-mode tensor the Meta device's (`tensor`). None:
        nothing fits."""
        dists = self.req.distributions
        if split.MODE in dists and params.get(split.MODE, _default_choice(dists[split.MODE], "layer")) == split.TENSOR:
            return self.tensor(params)
        if split.MODE in dists and split.experts_key(0) in dists:
            return self.spread(params)
        if split.ORDER in dists and split.ORDER not in params:  # one GPU: -ncmoe's own order unless told
            params = {**params, split.ORDER: _default_choice(dists[split.ORDER], "first")}
        for key, smallest_first in (("n-cpu-moe", True), ("n-gpu-layers", False)):
            if key in dists:
                values = sorted(_choices(dists[key]), reverse=not smallest_first)
                return self._first_fitting(params, key, values)
        cand = candidate(self.req, self._with_threads(params))
        return params if self(cand).feasible else None

    def spread(self, params: dict[str, Any], counts: tuple[int, ...] | None = None,
               order: str = "last") -> dict[str, Any] | None:
        """On several devices: fitter fit's whole-layer layout (the split in proportion to the budgets and improved
        a layer at a time; `counts`: this split, kept), each device keeping the experts of as many of its layers as
        fit (fitter.memory.fit.fit_devices); `order`: which of a device's layers give theirs to the CPU (the search
        counts them as its last; the first ones, when they do not fit, fall back to the last)."""
        context = {k: v for k, v in params.items() if not split.is_split_key(k)}
        # threads hold no memory; the load mode only moves host buffers (mapped, read in, pinned), and the layout
        # that keeps the most on the devices is also the one that leaves the least on the host, so one device search
        # serves every load mode (each placement is still screened whole below)
        memory = tuple(sorted((k, v) for k, v in context.items() if k not in (*THREAD_KEYS, "load-mode")))
        key = (memory, counts)
        if key not in self._spreads:
            self._spreads[key] = self._spread(context, counts)
        found = self._spreads[key]
        if found is None:
            return None
        for how in dict.fromkeys((order, "last")):
            placed = {**context, **found, split.ORDER: how}
            if self(candidate(self.req, placed)).feasible:
                return placed
        return None

    def _spread(self, context: dict[str, Any], counts: tuple[int, ...] | None) -> dict[str, Any] | None:
        """The split's params, searched by the estimator; where the build's own projection (the drift guard) says
        more than fitter's estimate on a device, searched again with that much less room there (twice at most)."""
        req, budgets = self.req, self.budgets
        base = candidate(req, self._with_threads(context))
        if base.error is not None:
            return None

        room = {name: b - budgets.margins.get(name, 0) for name, b in budgets.devices.items()}
        ngl = base.config.n_gpu_layers
        for _ in range(3):
            within = replace(budgets, devices=dict(room), margins={})

            def judge(config: LaunchConfig, within: Budgets = within) -> MemoryPlan | None:
                s = screen(req.spec, config, req.devices, req.cpu, within)
                return s.plan if s.feasible else None

            search = DeviceSearch(req.spec, req.devices, room, judge, base.config, req.cpu)
            found = search.whole_layers(ngl, None if counts is None else tuple(float(c) for c in counts))
            if found is None:
                return None
            layout = found[0]
            ranges = search.ranges(ngl, layout.counts)
            to_cpu = tuple(len(r) - k for r, k in zip(ranges, layout.keep, strict=True))
            placed = split.Split(tuple(int(c) for c in layout.counts), to_cpu).params()
            s = self(candidate(req, {**context, **placed}))
            if s.feasible:
                return placed
            if s.projection is None or s.plan is None:
                return None
            ours = device_totals(s.plan)
            more = {name: sum(s.projection[name].values()) - ours.get(name, 0) for name in room
                    if name in s.projection}
            if all(v <= 0 for v in more.values()):
                return None
            room = {name: r - max(0, more.get(name, 0)) for name, r in room.items()}
        return None

    def tensor(self, params: dict[str, Any]) -> dict[str, Any] | None:
        """-sm tensor: the GPUs are one Meta device to the model (src/llama-model.cpp `load_tensors`: one split),
        placed as one GPU is (fitter fit does the same): the fewest of the model's expert layers with their experts
        on the CPU, in the order params give (else last, llama.cpp --fit's), or the most layers -ngl offloads."""
        context = {k: v for k, v in params.items() if not split.is_split_key(k)}
        dists = self.req.distributions
        if split.experts_key(0) in dists:
            order = params.get(split.ORDER, "last")
            return self._first_fitting({**context, split.MODE: split.TENSOR, split.ORDER: order}, split.experts_key(0),
                                       list(range(self.req.spec.n_layer + 1)))
        if "n-gpu-layers" in dists:
            return self._first_fitting({**context, split.MODE: split.TENSOR}, "n-gpu-layers",
                                       sorted(_choices(dists["n-gpu-layers"]), reverse=True))
        placed = {**context, split.MODE: split.TENSOR}
        return placed if self(candidate(self.req, self._with_threads(placed))).feasible else None

    def one_device(self, params: dict[str, Any], main: int) -> dict[str, Any] | None:
        """The whole model on device `main` (-sm none -mg main) with its fewest experts on the CPU, or None."""
        context = {k: v for k, v in params.items() if not split.is_split_key(k)}
        key = split.experts_key(main)
        return self._first_fitting({**context, split.MODE: "none", split.MAIN: main, split.ORDER: "last"}, key,
                                   list(range(self.req.spec.n_layer + 1)))

    def _first_fitting(self, params: dict[str, Any], key: str, values: list[int]) -> dict[str, Any] | None:
        def fits(i: int) -> bool:
            return self(candidate(self.req, self._with_threads({**params, key: values[i]}))).feasible

        if not values or not fits(len(values) - 1):
            return None
        lo, hi = 0, len(values) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return {**params, key: values[lo]}

    def _with_threads(self, params: dict[str, Any]) -> dict[str, Any]:
        out = dict(params)
        for key in THREAD_KEYS:
            if key in self.req.distributions and key not in out:
                out[key] = _default_choice(self.req.distributions[key], self.req.default_threads)
        return out


# -- the structured plan ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedTrial:
    phase: str  # decode-first | prefill-first | max-context | min-vram | neighbour | tpe
    params: dict[str, Any]


def structured_start(req: TuneRequest, screener: Screener) -> list[PlannedTrial]:
    """The first trials a person would run: best decode guess, best prefill guess, the lightest placement."""
    placed = []
    for combo in combos(req):
        params = screener.placement(screener._with_threads(combo))
        if params is not None:
            cand = candidate(req, params)
            plan = screener(cand).plan
            assert plan is not None
            placed.append((params, plan))
    if not placed:
        return []
    # where the weights and the KV cache live is a trade bytes read cannot judge (-nkvo reads fewer weights from RAM
    # but runs attention on the CPU, a hand-off each way per layer): the first guesses keep llama-server's own,
    # except that prefill's reads the CPU's weights from pinned memory (-lm none), which op offload copies faster
    def at(params: dict[str, Any], **trade: Any) -> bool:
        return all(params.get(k, v) == v for k, v in {**TRADE_DEFAULTS, **trade}.items())

    usual = [p for p in placed if at(p[0])] or placed
    decode = min(usual, key=lambda p: (cpu_bytes_per_token(p[1]), _default_distance(p[0])))[0]
    pinned = [p for p in placed if at(p[0], **{"load-mode": "none"})]
    prefill = max(pinned or usual, key=lambda p: (p[0].get("ubatch-size", 0),
                                                  -cpu_bytes_per_token(p[1]), -_default_distance(p[0])))[0]
    out = [PlannedTrial("decode-first", decode), PlannedTrial("prefill-first", prefill)]
    if CTX_KEY in req.distributions:  # the context searched: its other end, the largest that fits, decode first
        largest = max(p[0][CTX_KEY] for p in placed)
        at_largest = [p for p in placed if p[0][CTX_KEY] == largest]
        widest = min([p for p in at_largest if at(p[0])] or at_largest,
                     key=lambda p: (cpu_bytes_per_token(p[1]), _default_distance(p[0])))[0]
        out.append(PlannedTrial("max-context", widest))
    if "vram" in req.objectives and req.devices:
        lightest = _lightest(req, screener, [p for p, _ in placed])
        if lightest is not None:
            out.append(PlannedTrial("min-vram", lightest))
    return out


def _lightest(req: TuneRequest, screener: Screener, placed: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The feasible config with the least predicted device memory: each combo with its lightest placement."""
    best: tuple[int, dict[str, Any]] | None = None
    for params in placed:
        light = dict(params)
        for i in range(len(req.devices)):
            if split.experts_key(i) in light:
                light[split.experts_key(i)] = req.spec.n_layer
        if "n-cpu-moe" in req.distributions:
            light["n-cpu-moe"] = max(_choices(req.distributions["n-cpu-moe"]))
        if "n-gpu-layers" in req.distributions:
            light["n-gpu-layers"] = min(_choices(req.distributions["n-gpu-layers"]))
        s = screener(candidate(req, light))
        if s.feasible and s.plan is not None:
            used = sum(v for k, v in device_totals(s.plan).items() if k != "CPU")
            if best is None or used < best[0]:
                best = (used, light)
    return best[1] if best else None


def neighbours(req: TuneRequest, screener: Screener, params: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Configs one context-level or thread choice away from `params`, each at its own best placement, most
    promising first (fewest CPU bytes per token, then closest to llama-server's defaults)."""
    found = [(cpu_bytes_per_token(plan), _default_distance(placed), placed)
             for placed, plan in _split_moves(req, screener, params)]
    for key, dist in req.distributions.items():
        if is_placement_key(key):
            continue
        for value in _choices(dist):
            if value == params.get(key):
                continue
            base = {k: v for k, v in params.items() if not is_placement_key(k)}
            base[key] = value
            if key == "batch-size" and "ubatch-size" in base and base["ubatch-size"] > value:
                continue
            if key == "batch-size" and min(value, params.get(key, value)) >= req.bench.n_prompt:
                continue  # both batches take the whole prompt at once: the measurement cannot tell them apart
            if key in THREAD_KEYS:
                placed = {**params, key: value}
            else:
                placed_or_none = _placed_alike(screener, base, params)
                if placed_or_none is None:
                    continue
                placed = {**placed_or_none, **{k: params[k] for k in THREAD_KEYS if k in params and k != key}}
            s = screener(candidate(req, placed))
            if s.feasible and s.plan is not None:
                found.append((cpu_bytes_per_token(s.plan), _default_distance(placed), placed))
    for _, _, placed in sorted(found, key=lambda f: (f[0], f[1])):
        yield placed


def _current_split(req: TuneRequest, params: dict[str, Any]) -> split.Split | None:
    """The split `params` stand for when the space has one (several devices), else None; None too for a split llama.cpp
    would refuse."""
    if split.MODE not in req.distributions:
        return None
    try:
        return split.read_split(params, len(req.devices), req.spec.n_layer)
    except FitterError:
        return None


def _placed_alike(screener: Screener, context: dict[str, Any], params: dict[str, Any]) -> dict[str, Any] | None:
    """`context` at its best placement of the same shape as `params`': on several devices the same split (or the
    same one device), each device keeping the experts that fit; else the best placement."""
    current = _current_split(screener.req, params)
    if current is not None and current.tensor:
        return screener.tensor({**context, split.ORDER: current.order})
    if current is None or split.experts_key(0) not in screener.req.distributions:  # one GPU: the same expert order
        return screener.placement({**context, split.ORDER: params[split.ORDER]} if split.ORDER in params else context)
    if current.main is not None:
        return screener.one_device(context, current.main)
    return screener.spread(context, current.counts, current.order)


def _split_moves(req: TuneRequest, screener: Screener, params: dict[str, Any]) -> \
        Iterator[tuple[dict[str, Any], MemoryPlan]]:
    """On several devices, the placement's own neighbours, each feasible: the other split mode (layer or tensor,
    where the space has tensor) at its own best placement, a few layers moved from one device to the next or the one
    before (each then keeping the experts that fit), the other expert order, the whole model on one device. Which is
    faster is the GPUs' speeds' (and link's) to say: these are measured, not judged by bytes alone."""
    current = _current_split(req, params)
    if current is None:
        yield from _order_moves(req, screener, params)
        return
    modes = _choices(req.distributions[split.MODE])
    context = {k: v for k, v in params.items() if not split.is_split_key(k)}
    # -sm tensor against the layers' split: the same context in the other mode, each at its own best placement
    other = ["layer" if current.tensor else split.TENSOR] if split.TENSOR in modes else []
    order = {split.ORDER: current.order} if split.ORDER in req.distributions else {}
    moves: list[dict[str, Any] | None] = [screener.placement({**context, split.MODE: m, **order}) for m in other
                                          if m in modes]
    if split.experts_key(0) not in req.distributions:  # a dense model: the mode is the whole placement
        yield from _feasible(req, screener, moves)
        return
    n_devices, n_layer = len(req.devices), req.spec.n_layer
    moves.append({**params, split.ORDER: "first" if current.order == "last" else "last"})
    if current.tensor:
        moves += [screener.one_device(params, g) for g in range(n_devices)] if "none" in modes else []
        yield from _feasible(req, screener, moves)
        return
    if current.main is None and current.counts is not None:
        step = max(1, (n_layer + 1) // 8)
        for i in range(n_devices):
            for j in (i - 1, i + 1):  # to a device beside it in the split: N devices, 2(N-1) moves
                if 0 <= j < n_devices and current.counts[i] >= step:
                    counts = tuple(c - step * (k == i) + step * (k == j) for k, c in enumerate(current.counts))
                    moves.append(screener.spread(params, counts, current.order))
    moves += [screener.one_device(params, g) for g in range(n_devices) if g != current.main]
    yield from _feasible(req, screener, moves)


def _feasible(req: TuneRequest, screener: Screener, moves: list[dict[str, Any] | None]) -> \
        Iterator[tuple[dict[str, Any], MemoryPlan]]:
    for move in moves:
        if move is not None:
            s = screener(candidate(req, move))
            if s.feasible and s.plan is not None:
                yield move, s.plan


def _order_moves(req: TuneRequest, screener: Screener, params: dict[str, Any]) -> \
        Iterator[tuple[dict[str, Any], MemoryPlan]]:
    """On one GPU whose space orders the experts: the other order, with as many expert layers on the CPU if that
    fits (about the same VRAM), else at its own fewest."""
    if split.ORDER not in req.distributions or "n-cpu-moe" not in params:
        return
    current = params.get(split.ORDER, "first")
    for order in _choices(req.distributions[split.ORDER]):
        if order == current:
            continue
        move = {**params, split.ORDER: order}
        s = screener(candidate(req, move))
        if not s.feasible:  # that count does not fit in this order: the order's own fewest
            alike = _placed_alike(screener, {k: v for k, v in params.items() if not is_placement_key(k)}, move)
            if alike is None:
                continue
            move, s = alike, screener(candidate(req, alike))
        if s.feasible and s.plan is not None:
            yield move, s.plan
