"""A llama.cpp build's own projection of a config's memory, beside fitter's estimate.

llama.cpp 0c1e570 offers it as `llama-fit-params --fit-print on` (tools/fit-params/fit-params.cpp → common/fit.cpp
`common_fit_print`): the model is loaded with `no_alloc`, a context is built, and each device's memory is printed
in whole MiB (floored) as `NAME MODEL CONTEXT COMPUTE`, the host last as `Host …`; CONTEXT is the memory's
buffers alone, the KV cache (src/llama-context.cpp `llama_context::memory_breakdown`: the model's, the memory's and
the scheduler's buffers; the output buffer is in none of them). It is the build's answer for the backend it was
built with, so it holds where fitter's rules were never matched: another commit, or a backend without goldens
(Vulkan, ROCm, Metal).

The tool reads flags as its own example (fitter.measure.llama_fit.fit_flags translates llama-server's), so it
projects the config as the program `llama-fit-params` runs it (fitter.flags.consumers): `-np` streams that are
never unified, logits for a whole ubatch. `compare` estimates that same reading, so on the build fitter's rules
were matched against the two agree to the MiB (tests/measure/test_projection.py).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fitter.errors import FitterError
from fitter.flags import parse_launch_flags, split_process_flags
from fitter.gguf.model_spec import ModelSpec
from fitter.measure import process
from fitter.measure.llama_fit import fit_env, fit_flags
from fitter.memory.devices import CpuProfile, Device
from fitter.memory.estimator import CPU, alloc_size, estimate
from fitter.units import MIB

KINDS = ("model", "kv", "compute")  # the tool's model, context (the KV cache), compute


@dataclass(frozen=True)
class Projection:
    command: str
    devices: dict[str, dict[str, int]]  # device name as fitter names it (CPU, CUDA0, RPC0[host:port]) → bytes


def parse_fit_print(stdout: str, rpc: Sequence[str] = ()) -> dict[str, dict[str, int]]:
    """`common_fit_print`'s lines; RPC devices get their server in the name as their buffers do (`RPC0[host:port]`),
    the host is `CPU`."""
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
            name = f"{name}[{rpc[int(rpc_index.group(1))]}]"
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
