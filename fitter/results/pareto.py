"""A tuning result, `pareto.json` (CONTRACTS.md): typed entries over the JSON as written, with one loader for tune,
export, check and report; each entry's measurement typed once (fitter.results.measurement, with the VRAM rule)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fitter.errors import FitterError
from fitter.noise import tied
from fitter.paths import write_atomic
from fitter.results.measurement import MeasurementRecord, ResultError, finite, shown, speed
from fitter.results.quality_record import QUALITY, record_problem

if TYPE_CHECKING:
    from fitter.gguf.model_spec import ModelSpec

POLICIES = ("max-decode", "max-prefill", "balanced", "min-vram", "max-context")
RESULT_FILE = "pareto.json"


@dataclass(frozen=True)
class Entry:
    """One configuration of the result: a Pareto entry (its confirm run) or the baseline."""

    trial: int | None
    flags: tuple[str, ...] | None  # the pinned llama-server flags (None: the baseline did not run)
    measurement: MeasurementRecord | None  # `fitter bench --json` of its confirm run
    phase: str | None = None
    vram_bytes: int | None = None
    ratios: dict[str, float | None] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict, compare=False)  # the entry as written
    # the 95 % interval of each ratio over the baseline, from the confirm rounds (fitter.noise)
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    ties: tuple[int, ...] = ()  # the entries it cannot be told apart from within noise
    defaults_distance: int = 0  # searched flags off llama-server's defaults (-1: llama.cpp's own choice)
    n_ctx: int | None = None  # the context its cache holds (llama.cpp's n_ctx; results before it: None)
    # its KV class's measured quality (fitter.results.quality_record; None: not measured) and the KV cache's bytes
    # with its types and with f16 ones ({"this": …, "f16": …}; results before them: None)
    quality: dict[str, Any] | None = None
    kv_bytes: dict[str, int] | None = None

    @property
    def ok(self) -> bool:
        return self.measurement is not None and self.measurement.ok

    def speed(self, key: str) -> float | None:
        return self.measurement.speed(key) if self.measurement is not None else None

    @property
    def rounds(self) -> dict[str, list[float]]:
        return self.measurement.rounds if self.measurement is not None else {}

    @staticmethod
    def from_json(data: dict[str, Any], source: str) -> Entry:
        flags = data.get("flags")
        trial = data.get("trial")
        if flags is not None and (not isinstance(flags, list) or not all(isinstance(f, str) for f in flags)):
            raise ResultError(source, f"trial {trial}: \"flags\" must be a list of strings, got {flags!r}")
        m = data.get("measurement")
        measurement = MeasurementRecord.from_json(m, f"trial {trial}", source) if isinstance(m, dict) else None
        vram = data.get("vram_bytes")
        if vram is not None and not finite(vram):
            raise ResultError(source, f"trial {trial}: \"vram_bytes\" must be a number of bytes, got {shown(vram)}")
        ratios = data.get("ratios") or {}
        if not isinstance(ratios, dict) or not all(v is None or finite(v) for v in ratios.values()):
            raise ResultError(source, f"trial {trial}: \"ratios\" must map tg/pp to a number, got {shown(ratios)}")
        intervals = data.get("intervals") or {}
        if not isinstance(intervals, dict) or not all(
                isinstance(v, list) and len(v) == 2 and all(isinstance(x, int | float) for x in v)
                for v in intervals.values()):
            raise ResultError(source, f"trial {trial}: \"intervals\" must map tg/pp to [low, high], got {intervals!r}")
        ties = data.get("ties") or []
        if not isinstance(ties, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ties):
            raise ResultError(source, f"trial {trial}: \"ties\" must be a list of trial numbers, got {ties!r}")
        distance = data.get("defaults_distance", -1 if data.get("phase") == "baseline" else 0)
        n_ctx = data.get("n_ctx")
        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 1):
            raise ResultError(source, f"trial {trial}: \"n_ctx\" must be a context of 1 or more cells, got "
                              f"{shown(n_ctx)}")
        quality = data.get(QUALITY)
        if quality is not None and (problem := record_problem(quality)) is not None:
            raise ResultError(source, f"trial {trial}: \"{QUALITY}\" {problem}")
        kv = data.get("kv_bytes")
        if kv is not None and (not isinstance(kv, dict) or set(kv) != {"this", "f16"} or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in kv.values())):
            raise ResultError(source, f"trial {trial}: \"kv_bytes\" must map this and f16 to bytes, got {kv!r}")
        return Entry(trial if isinstance(trial, int) else None, tuple(flags) if flags is not None else None,
                     measurement, data.get("phase"),
                     int(vram) if vram is not None else None, dict(ratios), data,
                     {k: (float(v[0]), float(v[1])) for k, v in intervals.items()}, tuple(ties),
                     int(distance) if isinstance(distance, int) else 0, n_ctx, quality, kv)


@dataclass(frozen=True)
class ParetoDoc:
    """pareto.json, read once: its typed parts, and the document as written (`data`)."""

    source: str  # the file it was read from (for every error message)
    data: dict[str, Any]
    pareto: tuple[Entry, ...]
    baseline: Entry
    picks: dict[str, int]

    @property
    def model(self) -> dict[str, Any]:
        return dict(self.data.get("model") or {})

    @property
    def machine(self) -> dict[str, Any]:
        return dict(self.data.get("machine") or {})

    @property
    def llama_cpp(self) -> dict[str, Any]:
        return dict(self.data.get("llama_cpp") or {})

    @property
    def consumer(self) -> str:
        """The program the result was tuned for (`--for`); results written before it existed: llama-server."""
        from fitter.flags.consumers import DEFAULT_CONSUMER, consumer

        name = self.data.get("for", DEFAULT_CONSUMER)
        if not isinstance(name, str):
            raise ResultError(self.source, f"\"for\" must be a program name, got {name!r}")
        try:
            return consumer(name).name
        except FitterError as e:
            raise ResultError(self.source, str(e)) from None

    @property
    def emulated(self) -> bool:
        return bool(self.data.get("emulated"))

    @property
    def objectives(self) -> tuple[str, ...]:
        return tuple(self.data.get("objectives") or ())

    @property
    def dropped(self) -> list[dict[str, Any]]:
        return list(self.data.get("dropped") or [])

    @property
    def study(self) -> dict[str, Any]:
        return dict(self.data.get("study") or {})

    def fit_targets(self) -> tuple[int, ...]:
        raw = self.data.get("fit_target_mib")
        if raw is None:
            return ()
        if not isinstance(raw, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            raise ResultError(self.source, f"\"fit_target_mib\" must be a list of integers (MiB), got {raw!r}")
        return tuple(raw)

    @staticmethod
    def from_json(data: Any, source: str) -> ParetoDoc:
        if not isinstance(data, dict):
            raise ResultError(source, "expected a JSON object written by `fitter tune`")
        for key, kind in (("model", dict), ("machine", dict), ("llama_cpp", dict), ("study", dict), ("drift", dict),
                          ("confirm", dict), ("objectives", list), ("dropped", list)):
            if data.get(key) is not None and not isinstance(data[key], kind):
                raise ResultError(source, f"\"{key}\" must be {'an object' if kind is dict else 'a list'}, got "
                                          f"{shown(data[key])}")
        if not all(isinstance(d, dict) for d in data.get("dropped") or []):
            raise ResultError(source, f"\"dropped\" must be a list of objects, got {shown(data['dropped'])}")
        pareto = data.get("pareto")
        if not isinstance(pareto, list):
            raise ResultError(source, f"no \"pareto\" list; is this a {RESULT_FILE} written by `fitter tune`?")
        entries = tuple(Entry.from_json(e, source) for e in pareto if isinstance(e, dict))
        base = data.get("baseline")
        picks = data.get("picks")
        return ParetoDoc(source, data, entries, Entry.from_json(base if isinstance(base, dict) else {}, source),
                         {k: v for k, v in picks.items() if isinstance(v, int)} if isinstance(picks, dict) else {})

    def entry(self, policy: str, purpose: str = "export") -> Entry:
        """The Pareto entry the `policy` pick names; errors name the file, the pick and what to do."""
        if policy not in POLICIES:
            raise FitterError(f"--policy {policy!r}: unknown policy; choose one of {', '.join(POLICIES)}")
        if not self.picks:
            raise ResultError(self.source, f"no \"picks\" (the tune found no confirmed configuration?); nothing "
                              f"to {purpose}")
        trial = self.picks.get(policy)
        if trial is None:
            listing = ", ".join(f"{k}={v}" for k, v in sorted(self.picks.items()))
            raise ResultError(self.source, f"no {policy} pick (picks: {listing}); choose another --policy")
        for e in self.pareto:
            if e.trial == trial:
                return e
        trials = ", ".join(str(e.trial) for e in self.pareto) or "none"
        raise ResultError(self.source, f"the {policy} pick is trial {trial}, which is not in \"pareto\" "
                                       f"(trials: {trials})")


def result_file(path: Path) -> Path:
    """RESULT as commands take it: the results folder, or its pareto.json."""
    return path / RESULT_FILE if path.is_dir() else path


def load_result(path: str | Path) -> ParetoDoc:
    """Read a tuning result (the folder or its pareto.json); one-line errors name the file."""
    file = result_file(Path(path))
    try:
        data = json.loads(file.read_text())
    except OSError as e:
        raise ResultError(str(file), f"cannot read the tuning result: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ResultError(str(file), f"not valid JSON ({e})") from None
    except ValueError:  # json's int() of a literal past Python's limit on integer digits
        raise ResultError(str(file), f"not a result fitter can read (an integer of more than "
                                     f"{sys.get_int_max_str_digits()} digits)") from None
    except RecursionError:  # json descends one call per level of nesting
        raise ResultError(str(file), "not a result fitter can read (arrays or objects nested too deeply)") from None
    return ParetoDoc.from_json(data, str(file))


def write_result(folder: Path, data: dict[str, Any]) -> Path:
    """pareto.json, whole or not at all (fitter.paths.write_atomic): never a half-written result."""
    return write_atomic(folder / RESULT_FILE, json.dumps(data, indent=1) + "\n")


# -- picks and ratios --------------------------------------------------------------------------------------------


def fastest(entries: list[Entry], policy: str) -> Entry:
    """The entry with the best estimate for a speed policy, before ties are resolved: max-decode the highest decode,
    max-prefill the highest prefill, balanced the highest min(pp/pp_best, tg/tg_best) (never a sum)."""
    def tg(e: Entry) -> float:
        return e.speed("tg") or 0.0

    def pp(e: Entry) -> float:
        return e.speed("pp") or 0.0

    if policy == "max-decode":
        return max(entries, key=tg)
    if policy == "max-prefill":
        return max(entries, key=pp)
    tg_best, pp_best = max(map(tg, entries)), max(map(pp, entries))
    return max(entries, key=lambda e: min(pp(e) / pp_best if pp_best else 0.0, tg(e) / tg_best if tg_best else 0.0))


def picks(entries: list[Entry]) -> dict[str, int]:
    """max-decode, max-prefill, balanced (`fastest`), min-vram (least VRAM within 5 % of the best decode) and, where
    the context was searched, max-context (the largest context within 5 % of the best decode), over confirmed
    Pareto entries, by trial number.

    Configs the confirm rounds cannot tell apart from a pick (fitter.noise: the interval of their ratio
    contains 1) are a tie, resolved toward the least quality lost (where it was measured), then less VRAM, then
    toward llama.cpp's defaults (its own choice first, then
    the fewest searched flags off llama-server's defaults), then the faster estimate."""
    if not entries:
        return {}

    def tg(e: Entry) -> float:
        return e.speed("tg") or 0.0

    def pp(e: Entry) -> float:
        return e.speed("pp") or 0.0

    def tied_with(best: Entry, speeds: tuple[str, ...]) -> list[Entry]:
        return [e for e in entries if e is best or tied(best.rounds, e.rounds, speeds)]

    def chosen(group: list[Entry], faster: Callable[[Entry], float], least_vram: bool = False) -> int:
        # with quality measured (--objectives ...,quality), the config that costs the least of it first (min-vram:
        # after the VRAM it is for)
        def key(e: Entry) -> tuple[float, ...]:
            kld, vram = float(e.quality["kld"]) if e.quality else 0.0, float(e.vram_bytes or 0)
            first = (vram, kld) if least_vram else (kld, vram)
            return (*first, e.defaults_distance, -faster(e))

        e = min(group, key=key)
        assert e.trial is not None
        return e.trial

    def both(e: Entry) -> float:
        return tg(e) + pp(e)

    out = {policy: chosen(tied_with(fastest(entries, policy), speeds), faster)
           for policy, speeds, faster in (("max-decode", ("tg",), both), ("max-prefill", ("pp",), pp),
                                          ("balanced", ("tg", "pp"), both))}
    top = fastest(entries, "max-decode")
    tied_top = {id(e) for e in tied_with(top, ("tg",))}
    near_top = [e for e in entries if tg(e) >= 0.95 * tg(top) or id(e) in tied_top]
    out["min-vram"] = chosen(near_top, tg, least_vram=True)
    if len({e.n_ctx for e in entries if e.n_ctx}) > 1:  # the context was searched (--min-ctx)
        # the largest context within 5 % of the best decode: what a larger context costs nothing noticeable for
        e = max(near_top, key=lambda e: (e.n_ctx or 0, tg(e), -(e.vram_bytes or 0)))
        assert e.trial is not None
        out["max-context"] = e.trial
    return out


def ratios(measurement: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, float | None]:
    """Speed over the baseline's (None when the baseline did not run or failed)."""
    out: dict[str, float | None] = {}
    ok = baseline is not None and baseline.get("outcome") == "ok"
    for k in ("pp", "tg"):
        base = speed(baseline, k) if ok else None
        value = speed(measurement, k)
        out[k] = round(value / base, 3) if base and value is not None else None
    return out


def recorded_model(doc: ParetoDoc, override: str | None, why: str) -> tuple[str, ModelSpec]:
    """The model a result was tuned on (its recorded path, or `override`: the same file elsewhere), refused when its
    header identity is not the one recorded; `why` ends that refusal (what the caller would compare or run)."""
    from fitter.gguf.model_spec import load_model_spec

    path = override or doc.model.get("path")
    if not isinstance(path, str) or not path:
        raise FitterError(f"{doc.source}: no model.path; give the GGUF file with --model")
    try:
        spec = load_model_spec(path)
    except FitterError as e:
        raise FitterError(f"{e} (the model {doc.source} was tuned on; give it with --model PATH)") from None
    identity = doc.model.get("identity")
    if identity and spec.identity != identity:
        raise FitterError(f"{path}: not the model {doc.source} was tuned on (header identity {spec.identity} != "
                          f"{identity}){why}")
    return path, spec
