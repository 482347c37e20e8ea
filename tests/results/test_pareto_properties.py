"""Property tests: pareto.json as the commands that read it read it. A result as `fitter tune` writes it (gpt-oss-tiny
on the emulated GPU, three confirmed entries and the baseline, measurements in `fitter bench --json`'s shape) is
mutated (a node replaced by a hostile value, a key dropped or added, the text cut or spliced), then read by
`fitter export` (each policy and format, a re-plan for another program included), `fitter check` (on a fake runner,
and choosing its runner) and `fitter report` (its loader and the front's table). Each succeeds or fails with one
line of FitterError naming the file; nothing else escapes."""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fitter.check.run import run_check, runner_factory_for
from fitter.cli.results import cmd_export
from fitter.errors import FitterError
from fitter.export.launchers import FORMATS
from fitter.flags import LaunchConfig, ProcessFlags, parse_launch_flags, pin
from fitter.gguf.model_spec import load_model_spec
from fitter.machine.snapshot import take_snapshot
from fitter.measure.types import BenchSpec, LoggedBuffer, Measurement, SpeedStats, TrialResult
from fitter.memory.backends.devices import RPC, Device, rpc_devices
from fitter.memory.plan.estimator import estimate
from fitter.report.load import _read_pareto
from fitter.report.tables import pareto_frame, pareto_text
from fitter.results.measurement import measurement_json
from fitter.results.pareto import POLICIES, Entry, picks, ratios
from fitter.results.table import front_of
from tests.models import model_file
from tests.properties import assert_one_line_naming, bounded, examples

MIB = 1024 * 1024
MODEL = model_file("gpt-oss-tiny")
SPEC = load_model_spec(str(MODEL))
OLD, FRESH = "127.0.0.1:39999", "127.0.0.1:40001"  # the tune's emulated GPU, and the fake runner's fresh one
BENCH = BenchSpec(n_prompt=32, n_gen=8, repetitions=3, threads=2, threads_batch=2)


def _measurement(launch: list[str], pp: float, tg: float, endpoint: str = OLD) -> dict[str, Any]:
    """A confirm run as pareto.json records it: bench JSON with the estimate's devices and the emulator's peak."""
    plan = estimate(SPEC, parse_launch_flags([*launch, "--rpc", endpoint]), rpc_devices([endpoint]))
    logged = tuple(LoggedBuffer(b.buft, b.kind, b.bytes / MIB) for b in plan.buffers)  # as llama.cpp logs them
    m = Measurement("ok", "", BENCH, (), SpeedStats(32, 0, (1, 1, 1), (pp,) * 3, pp, pp / 50),
                    SpeedStats(8, 0, (1, 1, 1), (tg,) * 3, tg, tg / 30), buffers=logged,
                    llama_cpp={"commit": "0c1e570"})
    out = measurement_json(TrialResult(m, {f"RPC0[{endpoint}]": {"bytes": 5 * MIB, "source": "emulator"}}),
                           "llama-cpp-python", plan, True)
    out["confirm"] = {"rounds": 3, "repetitions": 3, "round_avg_ts": {"pp": [pp, pp * 1.01, pp * 0.99],
                                                                      "tg": [tg, tg * 1.02, tg * 0.98]}}
    return out


def _entry(trial: int, launch: list[str], pp: float, tg: float, base: dict[str, Any]) -> dict[str, Any]:
    m = _measurement(launch, pp, tg)
    return {"trial": trial, "phase": "tpe", "flags": pin(parse_launch_flags([*launch, "--rpc", OLD]),
                                                         process=ProcessFlags(2, 2)),
            "measurement": m, "vram_bytes": 5 * MIB + trial, "ratios": ratios(m, base),
            "intervals": {"pp": [0.9, 1.3], "tg": [0.95, 1.2]}, "ties": [], "defaults_distance": 2}


def seed_result() -> dict[str, Any]:
    base = _measurement(["-c", "1024", "-fa", "on", "-ngl", "all"], 400.0, 80.0)
    front = [_entry(3, ["-c", "1024", "-np", "1", "-fa", "on", "-ngl", "all", "-ub", "256"], 500.0, 100.0, base),
             _entry(5, ["-c", "1024", "-np", "1", "-fa", "off", "-ngl", "all", "-ctk", "q8_0"], 520.0, 90.0, base),
             _entry(8, ["-c", "1024", "-np", "1", "-fa", "on", "-ngl", "1", "-ncmoe", "1"], 300.0, 70.0, base)]
    return {
        "for": "llama-server",
        "model": {"path": str(MODEL), "name": MODEL.stem, "arch": SPEC.arch, "identity": SPEC.identity,
                  "n_params": SPEC.n_params, "tensor_bytes": SPEC.tensor_bytes},
        "machine": {"cpu": "test", "fingerprint": "f", "gpus": [], "emulated_gpu_mib": 16},
        "llama_cpp": {"commit": "0c1e570", "source": "llama-cpp-python 0.3.36"},
        "objectives": ["tg", "pp", "vram"], "fit_target_mib": [4], "emulated": True,
        "budgets": {"devices": {f"RPC0[{OLD}]": 12 * MIB}, "host": 8 << 30},
        "baseline": {"name": "llama.cpp --fit", "trial": 0, "phase": "baseline", "flags": ["-fit", "on"],
                     "measurement": base, "intervals": {"pp": [1.0, 1.0], "tg": [1.0, 1.0]}, "ties": []},
        "pareto": front,
        "dropped": [{"trial": 4, "outcome": "dominated", "reason": "trial 3 is faster with less VRAM"},
                    {"trial": 6, "outcome": "oom", "reason": "RPC0: failed to allocate"}],
        "picks": picks([Entry.from_json(e, "seed") for e in front]),
        "confirm": {"rounds": 3, "repetitions": 3, "interleaved": True, "interval": "95 %"},
        "drift": {"baseline": [], "spread": {"tg": 0.0, "pp": 0.0}, "differences": {"tg": 0.2, "pp": 0.3},
                  "exceeds_differences": False, "note": "no drift monitor: the baseline was measured once"},
        "study": {"storage": "sqlite:///study.db", "trials": 9, "launched": 7, "screened_out": 1,
                  "answered_from_storage": 1, "pooled": 0, "model_loads_this_run": 7, "wall_s": 12.5,
                  "margins": {}},
    }


SEED = seed_result()


class _Runner:
    """The runner interface, answering every run at the recorded speeds on a fresh emulated GPU."""

    emulated, rpc, backend = True, (FRESH,), "fake"

    def __init__(self, **kwargs: Any) -> None:
        self.cap = kwargs.get("emulated_gpu_mib") or 16

    def devices(self) -> tuple[Device, ...]:
        return (Device(f"RPC0[{FRESH}]", RPC, self.cap * MIB, self.cap * MIB),)

    def cpu_profile(self) -> None:
        return None

    def run(self, model: str, config: LaunchConfig, spec: BenchSpec, timeout: float | None, plan: Any) -> TrialResult:
        stats = (SpeedStats(n, spec.n_depth, (1,), (100.0,), 100.0, 1.0) for n in (spec.n_prompt, spec.n_gen))
        return TrialResult(Measurement("ok", "", spec, (), *stats), {})

    def __enter__(self) -> _Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


SNAPSHOT = take_snapshot()


def commands_read(path: Path, policy: str, fmt: str) -> list[FitterError]:
    """What export (in `fmt`, and in the python format, which re-plans for llama-cpp-python), check and report do with
    the file, each on its own: a failure of one does not skip the others. Their errors, each one line naming it."""
    def export(fmt: str) -> Callable[[], None]:
        def run() -> None:
            ns = argparse.Namespace(result=str(path), policy=policy, format=fmt, consumer=None, model=None,
                                    force=True)
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                cmd_export(ns)
        return run

    def check() -> None:
        runner_factory_for(path, SNAPSHOT)
        run_check(path, policy, 0.05, _Runner)

    def report() -> None:
        doc = _read_pareto(path)
        assert doc is not None
        front = front_of(doc)
        pareto_text(front)
        pareto_frame(front)

    errors = []
    for read in (export(fmt), export("python"), check, report):
        with bounded():
            try:
                read()
            except FitterError as e:
                assert_one_line_naming(e, str(path))
                errors.append(e)
    return errors


@pytest.fixture(scope="module")
def result_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("result") / "pareto.json"


def test_the_seed_result_is_read_by_every_command(result_file: Path) -> None:
    result_file.write_text(json.dumps(SEED))
    assert SEED["picks"] == {"max-decode": 3, "max-prefill": 5, "balanced": 3, "min-vram": 3}
    assert set(SEED["pareto"][0]["measurement"]["devices"]) == {"CPU", f"RPC0[{OLD}]"}  # the re-plan's devices
    for policy in POLICIES:
        for fmt in FORMATS:
            if policy in SEED["picks"]:
                assert commands_read(result_file, policy, fmt) == []
            else:  # max-context: picked only where the context was searched; export (twice) and check say so
                assert [str(e) for e in commands_read(result_file, policy, fmt)] == \
                    [f"{result_file}: no {policy} pick (picks: balanced=3, max-decode=3, max-prefill=5, min-vram=3); "
                     "choose another --policy"] * 3


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _field(path: tuple[Any, ...]) -> str:
    """What kind of node a path leads to: its key, or its list's key with [] (every pareto entry's "flags" alike)."""
    named = [k for k in path if isinstance(k, str)]
    return (named[-1] if named else "") + ("[]" if isinstance(path[-1], int) else "")


PATHS = _paths(SEED)[1:]
BY_FIELD: dict[str, list[tuple[Any, ...]]] = {}
for _p in PATHS:
    BY_FIELD.setdefault(_field(_p), []).append(_p)
# every kind of field as likely as any other: a device's name as likely as a speed, though speeds are many more
NODES = st.sampled_from(sorted(BY_FIELD)).flatmap(lambda f: st.sampled_from(BY_FIELD[f]))
HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(-(2**70), 2**70),
    st.sampled_from([2**63, 10**100, float("nan"), float("inf"), -float("inf"), -0.0, 1e308]), st.floats(),
    st.text(max_size=10), st.sampled_from(["", "a\nb", "\x00", "-fa", "--rpc", "auto", "max-decode", "llama-cli",
                                           "RPC0[x]", "CUDA0", "1e999"]),
    st.lists(st.integers(-2, 2) | st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(-2, 2) | st.none(), max_size=3),
    st.just([[1.0, 2.0, 3.0]]), st.just({"bytes": "x", "source": 1}),
)

pytestmark = pytest.mark.properties  # all their examples: FITTER_ALL_EXAMPLES=1 (tests/properties.py)


def _has(node: Any, key: Any) -> bool:
    if isinstance(node, list):
        return isinstance(key, int) and -len(node) <= key < len(node)
    return isinstance(node, dict) and key in node


def _set(doc: Any, path: tuple[Any, ...], op: str, value: Any, key: str) -> None:
    """Replace, delete, rename or add beside the node at `path` (nothing when an earlier mutation removed the way
    there)."""
    node = doc
    for k in path[:-1]:
        if not _has(node, k):
            return
        node = node[k]
    last = path[-1]
    if op == "add" and isinstance(node, dict):
        node[key] = value
    elif op == "add" and _has(node, last):
        node.insert(last, value)
    elif op == "delete" and _has(node, last):
        del node[last]
    elif op == "rename" and isinstance(node, dict) and last in node:
        node[key] = node.pop(last)
    elif _has(node, last):
        node[last] = value


# keys a mutation may add or rename to: ones some command reads (a simulated machine, a build, a device by its name)
KEYS = ["for", "budgets", "sim", "profile", "llama_server", "emulated_gpu_kind", "emulated_gpu_mib", "peak_vram",
        "confirm", "devices", "path", "identity", "x"]
DEVICE_KEYS = ["RPC0[x]", "RPC1[127.0.0.1:1]", "RPC0[]", "CUDA0", "CUDA", "CPU", "x", ""]


@st.composite
def mutated(draw: st.DrawFn) -> dict[str, Any]:
    doc = copy.deepcopy(SEED)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(NODES)
        keys = DEVICE_KEYS if any(k in ("devices", "peak_vram") for k in path) else KEYS
        _set(doc, path, draw(st.sampled_from(["replace", "replace", "delete", "rename", "add"])), draw(HOSTILE),
             draw(st.sampled_from(keys)))
    return doc


@settings(max_examples=examples(400))
@given(mutated(), st.sampled_from(POLICIES), st.sampled_from(FORMATS))
def test_mutated_documents(result_file: Path, doc: dict[str, Any], policy: str, fmt: str) -> None:
    result_file.write_text(json.dumps(doc))
    commands_read(result_file, policy, fmt)


SEED_TEXT = json.dumps(SEED).encode()


@st.composite
def spliced(draw: st.DrawFn) -> bytes:
    """The JSON text cut short or with a few pieces put in: broken syntax, bad UTF-8, nesting and huge numbers."""
    text = SEED_TEXT
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        piece = draw(st.one_of(st.binary(max_size=6), st.sampled_from(
            [b"", b"[" * 100_000, b"9" * 5000, b"NaN", b"-Infinity", b"\xff\xfe", b'"\\ud800"', b"{}", b"null,"])))
        text = text[:at] + piece + text[at + draw(st.integers(0, 30)):]
    return text[: draw(st.integers(0, len(text)))] if draw(st.booleans()) else text


@settings(max_examples=examples(200))
@given(spliced(), st.sampled_from(POLICIES), st.sampled_from(FORMATS))
def test_spliced_text(result_file: Path, text: bytes, policy: str, fmt: str) -> None:
    result_file.write_bytes(text)
    commands_read(result_file, policy, fmt)


def _renamed_device(node: Any, old: str, new: str) -> Any:
    """The document with every key `old` (the emulated GPU's name in devices, peak_vram and budgets) renamed."""
    if isinstance(node, dict):
        return {(new if k == old else k): _renamed_device(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [_renamed_device(v, old, new) for v in node]
    return node


@settings(max_examples=examples(100))
@given(st.sampled_from(DEVICE_KEYS) | st.text(max_size=12), st.sampled_from(POLICIES), st.sampled_from(FORMATS))
def test_renamed_devices(result_file: Path, name: str, policy: str, fmt: str) -> None:
    """Device names are the measurement's keys, read back as llama.cpp's (RPC0[host:port], CUDA0): a re-plan
    rebuilds the devices from them."""
    result_file.write_text(json.dumps(_renamed_device(SEED, f"RPC0[{OLD}]", name)))
    commands_read(result_file, policy, fmt)
