"""A llama.cpp build's own projection of a config's memory, beside fitter's estimate.

llama.cpp 0c1e570 offers it as `llama-fit-params --fit-print on` (tools/fit-params/fit-params.cpp → common/fit.cpp
`common_fit_print`): the model is loaded with `no_alloc`, a context is built, and each device's memory is printed
in whole MiB (floored) as `NAME MODEL CONTEXT COMPUTE`, the host last as `Host …`; CONTEXT is the memory's
buffers alone, the KV cache (src/llama-context.cpp `llama_context::memory_breakdown`: the model's, the memory's and
the scheduler's buffers; the output buffer is in none of them). It is the build's answer for the backend it was
built with, so it holds where fitter's rules were never matched: another commit, or a backend without goldens
(Vulkan, ROCm, Metal).

The tool reads flags as its own example (fitter.measure.llamacpp.fit_params.fit_flags translates llama-server's), so it
projects the config as the program `llama-fit-params` runs it (fitter.flags.consumers): `-np` streams that are
never unified, logits for a whole ubatch. `compare` estimates that same reading, so on the build fitter's rules
were matched against the two agree to the MiB (tests/measure/llamacpp/test_projection.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from fitter import process
from fitter.errors import FitterError
from fitter.flags import LaunchConfig, parse_launch_flags, pin, split_process_flags
from fitter.gguf.model_spec import ModelSpec
from fitter.measure.llamacpp.fit_params import find_llama_fit_params, fit_env, fit_flags
from fitter.memory.backends.devices import CpuProfile, Device, rpc_device_name
from fitter.memory.plan.estimator import CPU, MemoryPlan, alloc_size, estimate
from fitter.memory.plan.projected import guessed_kinds, unruled, with_projection
from fitter.paths import fitter_home, write_atomic
from fitter.units import MIB

KINDS = ("model", "kv", "compute")  # the tool's model, context (the KV cache), compute


@dataclass(frozen=True)
class Projection:
    command: str
    devices: dict[str, dict[str, int]]  # device name as fitter names it (CPU, CUDA0, RPC0[host:port]) → bytes


def parse_fit_print(stdout: str, rpc: Sequence[str] = ()) -> dict[str, dict[str, int]]:
    """`common_fit_print`'s lines; the host is `CPU`. The tool prints an RPC device by its ggml name, RPC<i> for
    the i-th server of --rpc; fitter names it as its buffers are named
    (fitter.memory.backends.devices.rpc_device_name)."""
    out: dict[str, dict[str, int]] = {}
    for line in stdout.splitlines():
        m = re.fullmatch(r"\s*(\S+) (\d+) (\d+) (\d+)\s*", line)
        if not m:
            continue
        name = m.group(1)
        rpc_index = re.fullmatch(r"RPC(\d+)", name)
        if name == "Host":
            name = CPU
        elif rpc_index and int(rpc_index.group(1)) < len(rpc):
            name = rpc_device_name(rpc[int(rpc_index.group(1))])
        out[name] = {kind: int(v) * MIB for kind, v in zip(KINDS, m.groups()[1:], strict=True)}
    return out


def project(tool: str | Path, model: str | Path, flags: Sequence[str], timeout: float = 600.0) -> Projection:
    """The build's projection of a llama-server flag list (its --rpc servers included) for `model`."""
    launch, _ = split_process_flags(list(flags), "the flags")
    rpc = parse_launch_flags(launch).rpc
    argv = [str(tool), "--model", str(model), *fit_flags(launch), "--fit-print", "on", "-lv", "1"]
    try:
        rc, stdout, stderr = process.run(argv, timeout, env=fit_env(os.environ))
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FitterError(f"{Path(tool).name} --fit-print could not run ({shlex.join(argv)}): {e}") from None
    devices = parse_fit_print(stdout, rpc)
    if rc != 0 or CPU not in devices:
        tail = (stderr.strip() or stdout.strip())[-600:]
        raise FitterError(f"{Path(tool).name} --fit-print failed (exit {rc}): {tail}")
    return Projection(shlex.join(argv), devices)


def tool_estimate(spec: ModelSpec, flags: Sequence[str], devices: tuple[Device, ...],
                  cpu: CpuProfile) -> dict[str, dict[str, int]]:
    """fitter's estimate of the config as the tool reads it, in the tool's kinds (context: the KV cache only, as
    llama.cpp's breakdown counts it; fitter's output buffer is left out)."""
    launch, _ = split_process_flags(list(flags), "the flags")
    config = parse_launch_flags(fit_flags(launch), "llama-fit-params")
    plan = estimate(spec, config, devices, cpu)
    out = {name: {"model": t.model, "kv": t.kv, "compute": t.compute} for name, t in plan.totals().items()}
    if config.mmap:
        # The dry run maps nothing: its host model is the CPU tensors' aligned sizes (llama_model::memory_breakdown,
        # no_alloc: ggml_backend_alloc_ctx_tensors_from_buft_size), where a real load's CPU_Mapped buffer is the
        # byte range spanning them, tensors on the GPUs and a skipped NextN block between them included
        mapped = sum(b.bytes for b in plan.buffers if b.buft == "CPU_Mapped")
        tensors = sum(alloc_size(None, p.tensor.type, p.tensor.ne, p.tensor.n_bytes) for p in plan.placements
                      if p.buft == CPU)
        out[CPU]["model"] += tensors - mapped
    return out


def compare(ours: dict[str, dict[str, int]], theirs: dict[str, dict[str, int]]) -> list[str]:
    """One line per device and kind: fitter's figure, the build's, the difference (MiB; the build's are floored)."""
    lines = [f"{'device':<28}{'kind':<9}{'fitter':>10}{'build':>10}{'diff':>10}"]
    for name in sorted(set(ours) | set(theirs), key=lambda n: (n == CPU, n)):
        for kind in KINDS:
            a, b = ours.get(name, {}).get(kind), theirs.get(name, {}).get(kind)
            cells = [f"{x / MIB:10.2f}" if x is not None else f"{'-':>10}" for x in (a, b)]
            diff = f"{(a - b) / MIB:+10.2f}" if a is not None and b is not None else f"{'-':>10}"
            lines.append(f"{name:<28}{kind:<9}{cells[0]}{cells[1]}{diff}")
    return lines


def _stat_key(path: Path) -> list[object]:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


class Projector:
    """One build's projection of one model's configs, each config's pinned flags projected once: remembered in
    memory and, where the flags name no RPC server (an emulated GPU's port is new every run), on disk under fitter's
    home, keyed by the tool's and the model files' identity. `seconds` and `runs` say what the projections cost."""

    def __init__(self, tool: str | Path, spec: ModelSpec, rpc: tuple[str, ...] = (), timeout: float = 600.0) -> None:
        self.tool, self.spec, self.rpc, self.timeout = Path(tool), spec, rpc, timeout
        self.source = f"{self.tool.name} --fit-print on of {self.tool.parent}"
        # the header's identity (every shard's header bytes and size) and the tool's file
        self._identity = [_stat_key(self.tool), spec.identity, str(Path(spec.path).resolve())]
        self._memo: dict[tuple[str, ...], dict[str, dict[str, int]]] = {}
        self.runs, self.seconds, self.cached = 0, 0.0, 0
        # called before the tool runs (not for a remembered projection): an emulated GPU's server serves one client at
        # a time (ggml-rpc.cpp ggml_backend_rpc_start_server: a serial accept loop), so a runner whose process holds
        # its connection between trials lets go first, else the tool waits for it forever
        self.before_run: Callable[[], None] | None = None

    def __call__(self, config: LaunchConfig) -> dict[str, dict[str, int]]:
        """The projection of `config`; on the RPC servers given (an emulated GPU's) where it names none."""
        flags = tuple(pin(replace(config, rpc=config.rpc or self.rpc)))
        if flags not in self._memo:
            self._memo[flags] = self._cached(flags)
        return self._memo[flags]

    def plan(self, plan: MemoryPlan) -> MemoryPlan:
        """`plan` with the kinds fitter guesses for its model taken from this build's projection of its config."""
        if not guessed_kinds(plan.model, plan.devices):
            return plan
        return with_projection(plan, self(plan.config), self.source)

    def summary(self) -> str:
        return (f"{self.runs + self.cached} config(s) projected by {self.source} ({self.runs} run in "
                f"{self.seconds:.2f} s, {self.cached} from fitter's cache)")

    def _cached(self, flags: tuple[str, ...]) -> dict[str, dict[str, int]]:
        key = hashlib.sha256(json.dumps([self._identity, flags]).encode()).hexdigest()[:24]
        path = fitter_home() / "projections" / f"{key}.json"
        keep = "--rpc" not in flags
        if keep and path.is_file():
            try:
                kept = json.loads(path.read_text())
                devices = {d: {k: int(v) for k, v in kinds.items()} for d, kinds in kept.items()}
                self.cached += 1
                return devices
            except (OSError, ValueError, AttributeError):
                pass  # a damaged cache entry is projected again and rewritten
        if self.before_run is not None and "--rpc" in flags:
            self.before_run()
        t0 = time.perf_counter()
        devices = project(self.tool, self.spec.path, list(flags), self.timeout).devices
        self.runs, self.seconds = self.runs + 1, self.seconds + time.perf_counter() - t0
        if keep:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(devices, sort_keys=True) + "\n")
        return devices


def projector_for(spec: ModelSpec, llama_cpp: str | None = None, never: bool = False,
                  rpc: tuple[str, ...] = (), devices: Sequence[Device] = ()) -> Projector | None:
    """The projector a command screens with where fitter guesses a kind for the model (an architecture without
    rules, a graph it does not rebuild), None where it guesses nothing or `--projection never` takes the guess; the
    build is `--llama-cpp DIR`'s, else the one tune's baseline finds (the pinned tools', else PATH's). Without one
    fitter refuses rather than guess."""
    if never or not guessed_kinds(spec, devices):
        return None
    if llama_cpp is not None:
        from fitter.measure.llamacpp.builds import find_build

        build = find_build(llama_cpp)
        return guess_projector(spec, build.llama_fit_params, f"{build.folder} has no llama-fit-params", rpc, devices)
    return guess_projector(spec, find_llama_fit_params(), "none is in the pinned tools or on PATH", rpc, devices)


def guess_projector(spec: ModelSpec, tool: Path | None, why_none: str, rpc: tuple[str, ...] = (),
                    devices: Sequence[Device] = ()) -> Projector:
    """`tool`'s projector for a model (or devices) fitter guesses a kind for; without a tool the refusal, saying how
    to get one."""
    if tool is None:
        kinds = guessed_kinds(spec, devices)
        none = unruled(devices)
        what = (f"the {', '.join(d.name for d in none)} device(s), whose backend it has no rules for" if none else
                f"architecture {spec.arch!r}")
        raise FitterError(f"{spec.path}: fitter has no rules for the {' and '.join(kinds)} memory of {what} "
                          f"and will not guess it; llama.cpp's own projection needs its "
                          f"llama-fit-params, and {why_none}: build the pinned tools (python -m "
                          "fitter.measure.llamacpp.tools, a few minutes once), give --llama-cpp DIR, or take fitter's "
                          "guess with --projection never")
    return Projector(tool, spec, rpc)
