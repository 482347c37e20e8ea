"""`fitter serve`: read the devices' free memory now, choose (fitter.serve.choice), start llama-server with the
chosen line, forward SIGINT/SIGTERM to it and end with its exit status.

The devices are read as the build that serves sees them: a result measured on fitter's emulated GPU is served on a
fresh one of the recorded cap (or on the RPC devices `rpc` names), its free memory as llama-server lists it
(`--list-devices`: the RPC server's answer, less what another process holds there); a result tuned through a build
(`--llama-cpp DIR`) on that build's devices; a result of this machine's NVIDIA GPUs on NVML's free memory now.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from fitter import process
from fitter.errors import FitterError
from fitter.memory.backends.devices import Device
from fitter.memory.fit.budgets import DEFAULT_FIT_CTX
from fitter.results.pareto import ParetoDoc, load_result
from fitter.serve.choice import Plan, passed_through, plan_serve, recorded_caps, server_binary, tuned_model


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: its exit code, or 128 + the signal that killed it."""
    return returncode if returncode >= 0 else 128 - returncode


def run_forwarding(argv: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run `argv` in a session of its own (fitter.process.spawn), SIGINT and SIGTERM sent to fitter passed on to it
    (fitter.process.signals_passed_on: llama-server shuts down on the first and stops at once on the second,
    tools/server/server.cpp `signal_handler`), until it exits; its exit status (`exit_status`)."""
    child: list[int] = []
    with process.signals_passed_on(lambda: child[0] if child else None) as early:
        proc = process.spawn(argv, env=env if env is not None else dict(os.environ), stdin=None)
        child.append(proc.pid)
        for signum in early:  # came before it existed
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)
        rc = proc.wait()  # a handler's run does not end the wait (PEP 475)
        process.kill_group(proc)  # whatever it left in its group; forgets it
    return exit_status(rc)


def machine_devices(doc: ParetoDoc, binary: str) -> tuple[Device, ...]:
    """The devices a result not measured on the emulated GPU runs on now, with their free memory; refused when
    they are not those it was tuned on."""
    from fitter.check.run import gpu_change
    from fitter.measure.llamacpp.builds import listed_by, recorded_build_devices

    if "build_devices" in doc.machine:  # tuned through a build: its devices, as it lists them now
        return recorded_build_devices(doc.machine, doc.llama_cpp, binary, doc.source)
    if not isinstance(doc.machine.get("gpu_map"), list) or not doc.machine.get("gpu_map"):
        return ()  # tuned without a GPU: nothing to judge, the pick runs as recorded
    from fitter.machine.snapshot import gpus_now, take_snapshot

    snapshot = listed_by(take_snapshot(), binary)
    changed = gpu_change(doc.machine, snapshot.record()["gpu_map"])
    if changed:  # check's words, for serve
        raise FitterError(f"{doc.source} {changed.replace('run the check with', 'serve it with')}")
    return gpus_now(snapshot) or snapshot.devices()


def listed_rpc_devices(binary: str, endpoints: tuple[str, ...]) -> tuple[Device, ...]:
    """The RPC devices at `endpoints` with the free memory llama-server lists for them (common/arg.cpp
    --list-devices: ggml_backend_dev_memory, which the RPC server answers)."""
    from fitter.measure.llamacpp.builds import LlamaCppBuild, build_devices, list_devices

    path = Path(binary)
    listed = list_devices(LlamaCppBuild(path.parent, path, None, None), endpoints)
    devices, _ = build_devices(tuple(d for d in listed if d.name.startswith("RPC")))
    names = {f"RPC0[{e}]" for e in endpoints}
    if {d.name for d in devices} != names:
        raise FitterError(f"--rpc {','.join(endpoints)}: {binary} --list-devices lists "
                          f"{', '.join(d.name for d in devices) or 'none of them'}: is every RPC server running?")
    return tuple(sorted(devices, key=lambda d: [f"RPC0[{e}]" for e in endpoints].index(d.name)))


@contextlib.contextmanager
def emulated_endpoints(caps: tuple[int, ...] | None, rpc: tuple[str, ...], binary: str,
                       source: str) -> Iterator[tuple[str, ...]]:
    """The RPC endpoints a result measured on the emulated GPU is served on: `rpc` when given (one per recorded
    GPU), else fresh emulated GPUs of the recorded caps, stopped when the block ends; () for other results."""
    if caps is None:
        if rpc:
            raise FitterError(f"--rpc {','.join(rpc)}: {source} was not measured on the emulated GPU; serve it "
                              "on the devices it was tuned on")
        yield ()
        return
    if rpc:
        if len(rpc) != len(caps):
            raise FitterError(f"--rpc {','.join(rpc)}: {len(rpc)} endpoints, {source} was measured on "
                              f"{len(caps)} emulated GPU(s)")
        yield rpc
        return
    from fitter.measure.emulator.emulated_gpu import EmulatedGpus

    with EmulatedGpus(caps, beside=binary) as gpus:
        yield gpus.endpoints


def serve(result: str | Path, policy: str, say: Callable[[str], None], *, dry_run: bool = False,
          extra: Sequence[str] = (), build_dir: str | None = None, rpc: tuple[str, ...] = (),
          model: str | None = None, min_ctx: int | None = None,
          show: Callable[[str], None] | None = None) -> int:
    """Choose and (unless `dry_run`) serve; `say` gets the reason line, `show` (dry run) the line to run. The exit
    status: llama-server's; 0 for a dry run that found a line; a FitterError when nothing fits (nothing started)."""
    doc = load_result(result)
    extra = passed_through(extra)
    model_path, spec = tuned_model(doc, model)
    caps = recorded_caps(doc)
    binary = server_binary(doc, build_dir)
    with emulated_endpoints(caps, rpc, binary, doc.source) as endpoints:
        devices = listed_rpc_devices(binary, endpoints) if endpoints else machine_devices(doc, binary)
        plan: Plan = plan_serve(doc, policy, spec, binary, model_path, devices, endpoints, extra,
                                min_ctx=min_ctx if min_ctx is not None else DEFAULT_FIT_CTX)
        if not plan.argv:
            raise FitterError(plan.choice.reason)
        say(plan.choice.reason)
        if caps is not None and not rpc:
            say(f"on a fresh emulated GPU of {'+'.join(map(str, caps))} MiB at {', '.join(endpoints)} (the recorded "
                "one is gone), CPU speed")
        if dry_run:
            (show or say)(shlex.join(plan.argv))
            return 0
        say(f"starting {shlex.join(plan.argv)}")
        return run_forwarding(plan.argv)
