"""`fitter export --format launcher`: a POSIX sh script that makes `fitter serve`'s choice on a machine without fitter.

It holds the policy's candidate lines in order (fitter.export.candidates: the measured configs, then the pick
re-planned with more experts on the CPU or a smaller context, unmeasured), each with the bytes it needs free on each
GPU: what its plan allocates there plus the fit target the result was tuned with (llama.cpp's own --fit leaves that
much for what it allocates outside its buffers: the CUDA context, cuBLAS, pools; common/fit.cpp). At start it reads
each GPU's free memory (`nvidia-smi --query-gpu=pci.bus_id,memory.free`), finds each device by the PCI bus id the
result recorded (else by nvidia-smi's order, with CUDA_DEVICE_ORDER=PCI_BUS_ID so llama.cpp numbers them alike), and
execs the first line that fits, saying which on stderr; its own arguments go to llama-server (`--port ${PORT}` from
llama-swap). Without nvidia-smi it runs the pick as recorded. Pure: text out.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import replace

from fitter.errors import FitterError
from fitter.export.candidates import LaunchLine, Option, measured_line, policy_order, replans, size
from fitter.export.launchers import comment, pick
from fitter.export.replan import measured_devices
from fitter.flags import ProcessFlags
from fitter.flags.parse import flag_value
from fitter.gguf.model_spec import ModelSpec
from fitter.memory.backends.devices import CPU_AVX2, CpuProfile, Device, emulated_gpu_names
from fitter.memory.fit.budgets import DEFAULT_FIT_CTX, DEFAULT_FIT_TARGET_MIB, target_of
from fitter.results.pareto import ParetoDoc
from fitter.units import MIB

# nvidia-smi's CSV, one GPU a line: "00000000:01:00.0, 7012". A device's key is its bus id's last "BB:DD.F" (the
# domain is written with 4 or 8 digits by different tools), or "#i": the i-th line.
_FREE_OF = r"""free_of() {
  printf '%s\n' "$gpus" | awk -F', *' -v k="$1" '{ n = split(tolower($1), p, ":"); short = p[n-1] ":" p[n]
    if (short == k || ("#" (NR - 1)) == k) { print $2 + 0; exit } }'
}
fits() {
  while [ $# -gt 1 ]; do
    f=$(free_of "$1")
    [ -n "$f" ] && [ $((f * 1048576)) -ge "$2" ] || return 1
    shift 2
  done
}"""


def _keys(doc: ParetoDoc, devices: Sequence[Device]) -> tuple[dict[str, str], bool]:
    """Each device's key in nvidia-smi's listing (fitter's CUDA<i> by its recorded PCI bus id, else "#i"), and
    whether the script must number CUDA devices in PCI order for the "#i" keys to name them."""
    recorded = {g.get("device"): g.get("pci_bus_id") for g in doc.machine.get("gpu_map") or [] if isinstance(g, dict)}
    keys, by_order = {}, False
    for i, d in enumerate(devices):
        bus = recorded.get(d.name)
        if isinstance(bus, str) and bus.count(":") >= 1:
            parts = bus.lower().split(":")
            keys[d.name] = f"{parts[-2][-2:]}:{parts[-1]}"
        else:
            keys[d.name], by_order = f"#{i}", True
    return keys, by_order


def _where(key: str) -> str:
    return f"GPU {key[1:]}" if key.startswith("#") else f"GPU at bus {key}"


def launcher_candidates(doc: ParetoDoc, policy: str, spec: ModelSpec, cpu: CpuProfile = CPU_AVX2,
                        min_ctx: int = DEFAULT_FIT_CTX) -> tuple[list[LaunchLine], tuple[Device, ...], str]:
    """The lines in the order the script tries them, the devices they are planned on (named as the exported flags
    name them: an emulated GPU as the CUDA<i> it stands for, with the rules it was measured under), and the model."""
    first = pick(doc, policy)
    rpc = [x for x in (flag_value(list(first.entry.flags or ()), "rpc") or "").split(",") if x]
    named = emulated_gpu_names(rpc) if rpc else {}
    devices = tuple(replace(d, name=named.get(d.name, d.name))
                    for d in measured_devices(first.entry, doc, first.config.device_names))
    options = []
    for entry in policy_order(doc, policy):
        try:
            p = pick(doc, policy, entry)
        except FitterError:  # an entry the export cannot pin (not the pick: that one raised above)
            continue
        process = ProcessFlags(p.threads, p.threads_batch, p.cpu_mask, p.cpu_range)
        options.append(Option(p.trial, p.config, process, {k: v for k in ("tg", "pp")
                                                           if (v := entry.speed(k)) is not None}))
    measured = [c for o in options if (c := measured_line(o, spec, devices, cpu)) is not None]
    replanned = list(replans(options[0], spec, devices, cpu, min_ctx)) if devices else []
    kept: list[LaunchLine] = []
    for c in (*measured, *replanned):  # one that needs as much as an earlier one everywhere can never run
        if not any(all(c.need.get(d.name, 0) >= k.need.get(d.name, 0) for d in devices) for k in kept):
            kept.append(c)
    return kept, devices, first.model_path


def render_launcher(doc: ParetoDoc, policy: str, spec: ModelSpec, cpu: CpuProfile = CPU_AVX2,
                    min_ctx: int = DEFAULT_FIT_CTX) -> str:
    """The script (text ending with a newline)."""
    cands, devices, model = launcher_candidates(doc, policy, spec, cpu, min_ctx)
    first = pick(doc, policy)
    targets = doc.fit_targets() or (DEFAULT_FIT_TARGET_MIB,)
    keys, by_order = _keys(doc, devices)
    binary = first.binary
    out = ["#!/bin/sh", *(f"# {comment(line)}" for line in (
        f"fitter export --format launcher --policy {policy}: {doc.source}",
        "the first line that fits the GPUs' free memory at start is run (nvidia-smi); arguments go to llama-server",
        *([first.warning] if first.warning else []),
        *(f"{d.name}: nvidia-smi's {_where(keys[d.name])}; each line needs its plan plus the "
          f"{target_of(targets, i)} MiB fit target free" for i, d in enumerate(devices))))]
    out.append("set -u")
    if by_order:
        out.append("export CUDA_DEVICE_ORDER=PCI_BUS_ID  # CUDA<i> is nvidia-smi's i-th GPU")
    out.append("gpus=$(nvidia-smi --query-gpu=pci.bus_id,memory.free --format=csv,noheader,nounits 2>/dev/null) "
               "|| gpus=")
    out.append(_FREE_OF)

    def line(c: LaunchLine) -> str:
        return shlex.join([binary, "-m", model, *c.flags]) + ' "$@"'

    def say(text: str) -> str:
        return f"  echo {shlex.quote('launcher: ' + comment(text))} >&2"

    out += ['if [ -z "$gpus" ]; then', say(f"nvidia-smi reads no GPU here: running the {policy} pick "
                                               f"(trial {first.trial}) as recorded"), f"  exec {line(cands[0])}", "fi"]
    for c in cands:
        need = [(keys[d.name], c.need.get(d.name, 0) + target_of(targets, i) * MIB) for i, d in enumerate(devices)]
        what = ", ".join(f"{size(c.need.get(d.name, 0))} on {d.name}" for d in devices)
        out += [f"if fits {' '.join(f'{shlex.quote(k)} {b}' for k, b in need)}; then",
                say(f"serving {c.label()}: needs {what} and the fit target free"), f"  exec {line(c)}", "fi"]
    out += [say(f"no config fits the GPUs' free memory now; the least needs "
                f"{', '.join(f'{size(min(c.need.get(d.name, 0) for c in cands))} on {d.name}' for d in devices)} "
                "and the fit target free: nothing started").strip(), "exit 1"]
    return "\n".join(out) + "\n"
