"""A recorded real landscape (`fitter grid`): every config of a search space measured on one machine, K times.

The file (JSON, `"landscape": 1`) holds what the recording depended on (the model's header hash, the machine record,
the llama.cpp build, the devices and budgets, the bench settings, the resolved space and the fixed flags) and one
point per config: its search-space params, the flags of its trial, why the estimator screened it out (`screened`,
never launched) or its runs, each the `fitter bench --json` shape (every repetition in `samples_ts`) plus the round
it ran in (`round`), when (`at`, unix time) and the machine's load average then (`loadavg`: 1, 5, 15 min). The
baseline (llama.cpp's own `--fit` choice, usually outside the space) is one more point with `"baseline": true`.

`load_landscape` reads and checks a file (a bad one is one FitterError line naming the file, the rule and the
value), `write_landscape` writes one atomically; `best_within_noise` says which configs the recorded noise cannot
tell apart from the best. fitter.grid.replay replays a landscape as a TrialRunner.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fitter.errors import FitterError
from fitter.measure.types import OUTCOMES
from fitter.memory.backends.devices import CUDA, RPC, CpuProfile, Device
from fitter.memory.backends.overhead import Overhead
from fitter.noise import tied
from fitter.paths import write_atomic

FORMAT = 1
BASELINE_KEY = "baseline"
OBJECTIVES = ("tg", "pp")


class LandscapeError(FitterError):
    """A landscape file that cannot be read: the message names the file, the rule and the value."""


def param_key(params: dict[str, Any]) -> str:
    """A config of the space as one string (its params, keys sorted): how landscapes and benchmarks name configs."""
    return json.dumps(params, sort_keys=True)


@dataclass(frozen=True)
class DeviceRecord:
    """A device the recording planned for, as the estimator saw it (free memory, rules, overhead)."""

    name: str
    kind: str  # "cuda" | "rpc": the buffer rules (an emulated CUDA-shaped GPU is an RPC device with CUDA's)
    total_bytes: int | None
    free_bytes: int | None
    offload_min_batch: int = CUDA.offload_min_batch
    overhead_bytes: int | None = None
    overhead_source: str = ""

    @staticmethod
    def of(d: Device) -> DeviceRecord:
        return DeviceRecord(d.name, d.profile.kind, d.total_bytes, d.free_bytes, d.profile.offload_min_batch,
                            d.overhead.bytes if d.overhead else None, d.overhead.source if d.overhead else "")

    def device(self) -> Device:
        profile = replace(CUDA if self.kind == "cuda" else RPC, offload_min_batch=self.offload_min_batch)
        overhead = Overhead(self.overhead_bytes, self.overhead_source) if self.overhead_bytes is not None else None
        return Device(self.name, profile, self.total_bytes, self.free_bytes, overhead)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "total_bytes": self.total_bytes, "free_bytes": self.free_bytes,
                "offload_min_batch": self.offload_min_batch, "overhead_bytes": self.overhead_bytes,
                "overhead_source": self.overhead_source}


@dataclass(frozen=True)
class Point:
    """One config: its params (`{}` for the baseline), its trial's flags, and its screen verdict or its runs."""

    params: dict[str, Any]
    flags: tuple[str, ...]
    screened: str | None = None  # why the estimator kept it from running; None: it runs
    baseline: bool = False
    runs: tuple[dict[str, Any], ...] = ()

    @property
    def key(self) -> str:
        return BASELINE_KEY if self.baseline else param_key(self.params)

    def ok_runs(self) -> list[dict[str, Any]]:
        return [r for r in self.runs if r["outcome"] == "ok"]

    def run_means(self, objective: str = "tg") -> list[float]:
        """Each ok run's mean over its repetitions (`avg_ts`), in recording order."""
        return [float(r[objective]["avg_ts"]) for r in self.ok_runs()]

    def rounds_done(self) -> set[int]:
        return {int(r["round"]) for r in self.runs}

    def to_json(self) -> dict[str, Any]:
        return {"params": self.params, "flags": list(self.flags), "screened": self.screened,
                "baseline": self.baseline, "runs": list(self.runs)}


@dataclass(frozen=True)
class Landscape:
    path: str
    model: dict[str, Any]  # name, identity (the header hash tune keys studies by), arch, path
    machine: dict[str, Any]  # the machine record (fingerprint included), as tune's results name it
    llama_cpp: dict[str, Any]  # the build that measured: commit, source
    emulated_gpu_mib: int | None
    emulated_cuda: bool  # kept for landscapes recorded before `emulated_kind`
    devices: tuple[DeviceRecord, ...]
    rpc: tuple[str, ...]  # the endpoints every trial carried (the emulated GPU's)
    fit_target_mib: tuple[int, ...]
    bench: dict[str, int]  # p, n, d, r
    threads: dict[str, int | None]  # -t/-tb given to fitter grid (None: searched, or the target's default)
    target: dict[str, int]  # physical_cores, performance_cores, default_threads, host_budget
    cpu_profile: CpuProfile
    space: str  # the search space's source (a file, or shipped:<name>)
    distributions: dict[str, list[Any]]  # the resolved space, llama.cpp long flag names, in space order
    optuna: dict[str, str]  # the study's distributions as Optuna writes them (distribution_to_json)
    fixed_flags: tuple[str, ...]
    consumer: str  # --for
    rounds: int
    seed: int
    points: tuple[Point, ...]
    baseline_reason: str | None = None  # why there is no baseline point
    emulated_kind: str = "rpc"  # the emulated GPU's kind: rpc, cuda (emulated_cuda) or vulkan
    wall_s: float = 0.0  # recording time over every session that wrote the file

    def point(self, params: dict[str, Any]) -> Point | None:
        """The config of the space with exactly these params (threads included when the space searches them)."""
        key = param_key(params)
        return next((p for p in self.points if not p.baseline and p.key == key), None)

    @property
    def baseline(self) -> Point | None:
        return next((p for p in self.points if p.baseline), None)

    def summary(self, objective: str = "tg") -> dict[str, tuple[float, list[float]]]:
        """Every config with an ok run: key → (the mean over its runs of each run's avg_ts, those per-run avg_ts)."""
        out = {}
        for p in self.points:
            means = p.run_means(objective)
            if means:
                out[p.key] = (statistics.fmean(means), means)
        return out

    def device_objects(self) -> tuple[Device, ...]:
        return tuple(d.device() for d in self.devices)

    def to_json(self) -> dict[str, Any]:
        return {
            "landscape": FORMAT, "model": self.model, "machine": self.machine, "llama_cpp": self.llama_cpp,
            "emulated_gpu_mib": self.emulated_gpu_mib, "emulated_cuda": self.emulated_cuda,
            "emulated_kind": self.emulated_kind,
            "devices": [d.to_json() for d in self.devices], "rpc": list(self.rpc),
            "fit_target_mib": list(self.fit_target_mib), "bench": self.bench, "threads": self.threads,
            "target": self.target,
            "cpu_profile": {"repack_types": [list(t) for t in self.cpu_profile.repack_types],
                            "description": self.cpu_profile.description},
            "space": self.space, "distributions": self.distributions, "optuna": self.optuna,
            "fixed_flags": list(self.fixed_flags),
            "for": self.consumer, "rounds": self.rounds, "seed": self.seed, "wall_s": round(self.wall_s, 1),
            "baseline_reason": self.baseline_reason, "points": [p.to_json() for p in self.points],
        }


def write_landscape(path: str | Path, landscape: Landscape) -> None:
    """Write atomically (fitter.paths.write_atomic): a killed recording leaves the last whole file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    doc = landscape.to_json()
    # one line per point keeps the file diffable and well under a MiB
    points = doc.pop("points")
    head = json.dumps(doc, indent=1)[:-2]
    body = ",\n".join("  " + json.dumps(pt, separators=(",", ":")) for pt in points)
    write_atomic(p, f'{head},\n "points": [\n{body}\n ]\n}}\n')


# -- reading ----------------------------------------------------------------------------------------------------


class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, rule: str, value: Any) -> LandscapeError:
        shown = json.dumps(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return LandscapeError(f"{self.source}: {where} {rule} (got {shown})")

    def get(self, d: dict[str, Any], key: str, where: str, check: Callable[[Any], bool], rule: str,
            default: Any = ...) -> Any:
        if key not in d:
            if default is not ...:
                return default
            raise LandscapeError(f"{self.source}: {where}{key} is missing")
        value = d[key]
        if not check(value):
            raise self.fail(f"{where}{key}", rule, value)
        return value


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_num(v: Any) -> bool:
    return type(v) in (int, float)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_dict(v: Any) -> bool:
    return isinstance(v, dict)


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _opt_int(v: Any) -> bool:
    return v is None or type(v) is int


def load_landscape(path: str | Path) -> Landscape:
    """Read and check a landscape file; a bad one is one LandscapeError line (file, rule, value)."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise LandscapeError(f"{source}: cannot read the landscape: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise LandscapeError(f"{source}: not a UTF-8 text file, so not a landscape") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise LandscapeError(f"{source}: not valid JSON: {e}") from None
    return parse_landscape(data, source)


def parse_landscape(data: Any, source: str) -> Landscape:
    r = _Reader(source)
    if not isinstance(data, dict):
        raise r.fail("the document", "must be a JSON object", type(data).__name__)
    version = r.get(data, "landscape", "", _is_int, "must be the format number 1")
    if version != FORMAT:
        raise r.fail("landscape", f"must be {FORMAT} (this fitter reads format {FORMAT})", version)
    model = r.get(data, "model", "", _is_dict, "must be an object")
    r.get(model, "identity", "model.", _is_str, "must be a string (the model's header hash)")
    machine = r.get(data, "machine", "", _is_dict, "must be an object")
    r.get(machine, "fingerprint", "machine.", _is_str, "must be a string")
    llama_cpp = r.get(data, "llama_cpp", "", _is_dict, "must be an object")
    r.get(llama_cpp, "commit", "llama_cpp.", _is_str, "must be a string")
    devices = tuple(_device(r, d, i) for i, d in enumerate(
        r.get(data, "devices", "", lambda v: isinstance(v, list), "must be a list")))
    bench = r.get(data, "bench", "", lambda v: isinstance(v, dict) and set(v) == {"p", "n", "d", "r"}
                  and all(type(x) is int and x >= 0 for x in v.values()) and v["r"] >= 1,
                  "must be {p, n, d, r}: integers >= 0, r >= 1")
    target = r.get(data, "target", "", lambda v: isinstance(v, dict) and all(type(x) is int for x in v.values())
                   and {"physical_cores", "performance_cores", "default_threads", "host_budget"} <= set(v),
                   "must hold integers physical_cores, performance_cores, default_threads, host_budget")
    threads = r.get(data, "threads", "", lambda v: isinstance(v, dict) and set(v) == {"t", "tb"}
                    and all(_opt_int(x) for x in v.values()), "must be {t, tb}: integers or null")
    cpu = r.get(data, "cpu_profile", "", lambda v: isinstance(v, dict) and isinstance(v.get("description"), str)
                and isinstance(v.get("repack_types"), list) and all(
                    isinstance(t, list) and len(t) == 2 and isinstance(t[0], str) and type(t[1]) is int
                    for t in v["repack_types"]), "must be {repack_types: [[type, rows]], description}")
    dists = r.get(data, "distributions", "", lambda v: isinstance(v, dict) and all(
        isinstance(c, list) and c for c in v.values()), "must map each searched flag to a non-empty list of choices")
    points = tuple(_point(r, p, i) for i, p in enumerate(
        r.get(data, "points", "", lambda v: isinstance(v, list), "must be a list")))
    keys = [p.key for p in points]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise r.fail("points", "must name each config once", dup)
    emulated_cuda = r.get(data, "emulated_cuda", "", lambda v: isinstance(v, bool), "must be true or false", False)
    return Landscape(
        path=source, model=model, machine=machine, llama_cpp=llama_cpp,
        emulated_gpu_mib=r.get(data, "emulated_gpu_mib", "", _opt_int, "must be MiB (an integer) or null"),
        emulated_cuda=emulated_cuda,
        emulated_kind=r.get(data, "emulated_kind", "", lambda v: v in ("rpc", "cuda", "vulkan"),
                            "must be rpc, cuda or vulkan", "cuda" if emulated_cuda else "rpc"),
        devices=devices, rpc=tuple(r.get(data, "rpc", "", _str_list, "must be a list of endpoints", [])),
        fit_target_mib=tuple(r.get(data, "fit_target_mib", "", lambda v: isinstance(v, list) and all(
            type(x) is int and x >= 0 for x in v), "must be a list of MiB (integers >= 0)")),
        bench=bench, threads=threads, target=target,
        cpu_profile=CpuProfile(tuple((t, n) for t, n in cpu["repack_types"]), cpu["description"]),
        space=r.get(data, "space", "", _is_str, "must be the search space's source (a string)"),
        distributions=dists,
        optuna=r.get(data, "optuna", "", lambda v: isinstance(v, dict) and set(v) <= set(dists) and all(
            isinstance(x, str) for x in v.values()), "must map searched flags to Optuna distributions (JSON text)", {}),
        fixed_flags=tuple(r.get(data, "fixed_flags", "", _str_list, "must be a list of strings")),
        consumer=r.get(data, "for", "", _is_str, "must be the program's name (a string)", "llama-server"),
        rounds=r.get(data, "rounds", "", lambda v: type(v) is int and v >= 1, "must be an integer >= 1"),
        seed=r.get(data, "seed", "", _is_int, "must be an integer", 0),
        points=points,
        baseline_reason=r.get(data, "baseline_reason", "", lambda v: v is None or isinstance(v, str),
                              "must be a string or null", None),
        wall_s=float(r.get(data, "wall_s", "", _is_num, "must be seconds (a number)", 0.0)),
    )


def _device(r: _Reader, d: Any, i: int) -> DeviceRecord:
    where = f"devices[{i}]."
    if not isinstance(d, dict):
        raise r.fail(f"devices[{i}]", "must be an object", d)
    return DeviceRecord(
        name=r.get(d, "name", where, _is_str, "must be a string"),
        kind=r.get(d, "kind", where, lambda v: v in ("cuda", "rpc"), 'must be "cuda" or "rpc"'),
        total_bytes=r.get(d, "total_bytes", where, _opt_int, "must be bytes (an integer) or null"),
        free_bytes=r.get(d, "free_bytes", where, _opt_int, "must be bytes (an integer) or null"),
        offload_min_batch=r.get(d, "offload_min_batch", where, _is_int, "must be an integer",
                                CUDA.offload_min_batch),
        overhead_bytes=r.get(d, "overhead_bytes", where, _opt_int, "must be bytes (an integer) or null", None),
        overhead_source=r.get(d, "overhead_source", where, _is_str, "must be a string", ""))


def _point(r: _Reader, p: Any, i: int) -> Point:
    where = f"points[{i}]."
    if not isinstance(p, dict):
        raise r.fail(f"points[{i}]", "must be an object", p)
    runs = r.get(p, "runs", where, lambda v: isinstance(v, list), "must be a list")
    for j, run in enumerate(runs):
        _run(r, run, f"{where}runs[{j}]")
    screened = r.get(p, "screened", where, lambda v: v is None or isinstance(v, str), "must be a reason or null")
    if screened is not None and runs:
        raise r.fail(f"{where}runs", "must be empty for a screened config (it was never launched)", len(runs))
    return Point(params=r.get(p, "params", where, _is_dict, "must be an object"),
                 flags=tuple(r.get(p, "flags", where, _str_list, "must be a list of strings")),
                 screened=screened,
                 baseline=r.get(p, "baseline", where, lambda v: isinstance(v, bool), "must be true or false", False),
                 runs=tuple(runs))


def _run(r: _Reader, run: Any, where: str) -> None:
    if not isinstance(run, dict):
        raise r.fail(where, "must be an object (a fitter bench --json result)", run)
    outcome = r.get(run, "outcome", f"{where}.", lambda v: v in OUTCOMES, f"must be one of {', '.join(OUTCOMES)}")
    r.get(run, "round", f"{where}.", lambda v: type(v) is int and v >= 0, "must be an integer >= 0")
    r.get(run, "at", f"{where}.", _is_num, "must be a unix time")
    if outcome != "ok":
        return
    for test in OBJECTIVES:
        s = r.get(run, test, f"{where}.", _is_dict, "must be an object on an ok run")
        r.get(s, "samples_ts", f"{where}.{test}.", lambda v: isinstance(v, list) and bool(v) and all(
            _is_num(x) and x > 0 for x in v), "must be a non-empty list of speeds > 0")
        r.get(s, "avg_ts", f"{where}.{test}.", lambda v: _is_num(v) and v > 0, "must be a speed > 0")


# -- noise ------------------------------------------------------------------------------------------------------


def best_within_noise(landscape: Landscape, objective: str = "tg", include_baseline: bool = False) -> set[str]:
    """The configs (param keys, fitter.grid.landscape.param_key) the recorded noise cannot tell apart from the best:
    the best (highest mean over runs of each run's avg_ts) and every config tied with it as `fitter tune` ties its
    confirm runs (fitter.noise.tied): a grid's rounds are interleaved like confirm rounds, so runs pair by
    round and the 95 % t interval of the paired log ratios must contain 1. Only the rounds both configs ran ok in
    are paired. Read a tie as "not shown different", never as "shown equal". The baseline is left out unless
    `include_baseline`."""
    points = {p.key: p for p in landscape.points if p.ok_runs() and (include_baseline or not p.baseline)}
    if not points:
        return set()

    def by_round(p: Point) -> dict[int, float]:
        return {int(r["round"]): float(r[objective]["avg_ts"]) for r in p.ok_runs()}

    summary = {k: statistics.fmean(by_round(p).values()) for k, p in points.items()}
    best_key = max(summary, key=lambda k: summary[k])
    best = by_round(points[best_key])
    out = {best_key}
    for key, p in points.items():
        mine = by_round(p)
        common = sorted(set(mine) & set(best))
        if key != best_key and tied({objective: [mine[k] for k in common]}, {objective: [best[k] for k in common]},
                                    (objective,)):
            out.add(key)
    return out
