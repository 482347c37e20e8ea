"""Which NVIDIA GPU llama.cpp calls CUDA0, CUDA1, …: NVML lists the GPUs in an order of its own, the CUDA runtime
numbers them as `CUDA_DEVICE_ORDER` and `CUDA_VISIBLE_DEVICES` say, and llama.cpp names CUDA device i `CUDA{i}`
(ggml/src/ggml-cuda/ggml-cuda.cu `ggml_backend_cuda_reg`: `GGML_CUDA_NAME + std::to_string(i)` for each device
`cudaGetDeviceCount` gives, its props' `device_id` the bus id from `cudaDeviceGetPCIBusId`, lower-cased;
`ggml_cuda_init` logs "Device i: NAME, compute capability X.Y, VMM: yes, VRAM: N MiB", no bus id; `--list-devices`,
common/arg.cpp, prints "CUDA{i}: NAME (TOTAL MiB, FREE MiB free)", no bus id either).

The CUDA runtime's rules (CUDA C Programming Guide, "CUDA Environment Variables"):
- `CUDA_DEVICE_ORDER=PCI_BUS_ID`: ascending PCI bus id. `FASTEST_FIRST`, the default: fastest to slowest "using a
  simple heuristic", documented no further. Identical GPUs tie under any speed heuristic; fitter assumes CUDA then
  keeps their PCI bus order (what multi-GPU servers of one model show: CUDA i is nvidia-smi's i). GPUs that differ
  are not ordered by fitter at all: it refuses, unless a llama.cpp build's own listing tells them apart.
- `CUDA_VISIBLE_DEVICES`: only the devices named, in the order named, numbered from 0. Indices count in the
  `CUDA_DEVICE_ORDER` order; `GPU-<uuid>` (or a prefix that names one GPU) names a GPU whatever the order. The first
  invalid entry ends the list. The fine print (`1gpu2` is 1, a repeated entry leaves no device, a UUID list ends at
  its first entry without `GPU-`) follows PyTorch's reading of the same variable (torch/cuda/__init__.py
  `_parse_visible_devices`, `_transform_uuid_to_ordinals`), which is tested against the runtime.

`cuda_order` is pure: NVML's GPUs and the environment in, the CUDA order out, or one line saying why it cannot be
known.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fitter.errors import FitterError
from fitter.machine.nvidia import GpuInfo
from fitter.units import GIB, MIB

DEVICE_ORDER_ENV = "CUDA_DEVICE_ORDER"
VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
CUDA_ENV = (DEVICE_ORDER_ENV, VISIBLE_ENV)
PCI_BUS_ID = "PCI_BUS_ID"
PCI_REMEDY = "set CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA then numbers the GPUs in PCI bus order, as nvidia-smi lists them)"
REMEDY = f"{PCI_REMEDY}, or tune with --llama-cpp DIR so fitter reads your build's own device list"
# llama.cpp lists cudaMemGetInfo's total: the framebuffer less what the driver reserves (a few hundred MiB); NVML's
# total is the whole framebuffer. Wide enough for that, narrow enough to tell 8 from 12 GB, 40 from 80 GB.
LISTED_MEMORY_SLACK = (GIB, 0.05)


class GpuOrderError(FitterError):
    """The CUDA order of this machine's GPUs cannot be known (or llama.cpp's own listing contradicts it)."""


@dataclass(frozen=True)
class CudaGpu:
    """One GPU as llama.cpp numbers it: `CUDA{index}`, and NVML's reading of it (its NVML index, free memory)."""

    index: int
    gpu: GpuInfo

    @property
    def device(self) -> str:
        return f"CUDA{self.index}"

    @property
    def pci_bus_id(self) -> str | None:
        return normal_bus_id(self.gpu.pci_bus_id)

    def record(self) -> dict[str, Any]:
        """The JSON of `machine.gpu_map` (CONTRACTS.md)."""
        return {"device": self.device, "pci_bus_id": self.pci_bus_id, "name": self.gpu.name,
                "memory_total": self.gpu.memory_total}


class Listed(Protocol):
    """A device as a llama.cpp build lists it (fitter.measure.llamacpp.builds.ListedDevice)."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def total_bytes(self) -> int: ...


_BUS_ID = re.compile(r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])")


def pci_address(bus_id: str | None) -> tuple[int, int, int, int] | None:
    """NVML's `00000000:19:00.0` or CUDA's `0000:19:00.0` as (domain, bus, device, function); None if neither."""
    m = _BUS_ID.fullmatch((bus_id or "").strip())
    return None if m is None else (int(m[1], 16), int(m[2], 16), int(m[3], 16), int(m[4], 16))


def normal_bus_id(bus_id: str | None) -> str | None:
    """A bus id as llama.cpp records it (cudaDeviceGetPCIBusId, lower-cased): `0000:19:00.0`."""
    a = pci_address(bus_id)
    return None if a is None else f"{a[0]:04x}:{a[1]:02x}:{a[2]:02x}.{a[3]:x}"


def _strtoul(text: str) -> int:
    """The number an entry starts with (an optional sign, then digits), else -1: `1gpu2` is 1."""
    m = re.match(r"[+-]?\d+", text)
    return int(m[0]) if m else -1


def parse_visible(value: str | None) -> tuple[int, ...] | tuple[str, ...] | None:
    """CUDA_VISIBLE_DEVICES as the runtime reads it: None when unset (every GPU), else the ordinals or the UUID
    prefixes up to the first invalid entry; a repeated entry leaves none. MIG devices are refused: NVML's GPU list
    does not hold them, so fitter cannot give them a budget."""
    if value is None:
        return None
    if value.startswith("MIG-"):
        raise GpuOrderError(f"{VISIBLE_ENV}={value}: MIG devices are not mapped by fitter (NVML lists their parent "
                            "GPUs, whose memory is not theirs); name whole GPUs by index or GPU-UUID")
    if value.startswith("GPU-"):
        uuids: list[str] = []
        for entry in value.split(","):
            if entry in uuids:
                return ()
            if not entry.startswith("GPU-"):
                break
            uuids.append(entry)
        return tuple(uuids)
    ordinals: list[int] = []
    for entry in value.split(","):
        n = _strtoul(entry.strip())
        if n in ordinals:
            return ()
        if n < 0:
            break
        ordinals.append(n)
    return tuple(ordinals)


def _label(g: GpuInfo) -> str:
    return f"{normal_bus_id(g.pci_bus_id) or f'NVML {g.index}'} {g.name}"


def pci_order(gpus: Sequence[GpuInfo]) -> list[GpuInfo]:
    """The GPUs by ascending PCI bus id: NVML does not promise that order for its indices."""
    if len(gpus) < 2:
        return list(gpus)
    missing = [g for g in gpus if pci_address(g.pci_bus_id) is None]
    if missing:
        raise GpuOrderError(f"NVML gave no PCI bus id for {', '.join(f'GPU {g.index} {g.name}' for g in missing)} "
                            f"({missing[0].pci_bus_id!r}): fitter cannot tell which GPU llama.cpp calls CUDA0")
    return sorted(gpus, key=lambda g: pci_address(g.pci_bus_id) or (0, 0, 0, 0))


def _model(g: GpuInfo) -> tuple[Any, ...]:
    """What a speed heuristic could tell two GPUs apart by."""
    return g.name, g.memory_total, g.compute_capability, g.cuda_cores


def _by_uuid(gpus: list[GpuInfo], prefixes: tuple[str, ...]) -> list[GpuInfo]:
    """The GPUs the UUID prefixes name, up to the first that names none or several; a repeated one leaves none."""
    unknown = [g for g in gpus if not g.uuid]
    if unknown:
        raise GpuOrderError(f"{VISIBLE_ENV} names GPUs by UUID but NVML gave none for {_label(unknown[0])}: fitter "
                            "cannot tell which GPUs it makes visible")
    out: list[GpuInfo] = []
    for prefix in prefixes:
        hits = [g for g in gpus if (g.uuid or "").startswith(prefix)]
        if len(hits) != 1:
            break
        if any(hits[0] is o for o in out):
            return []
        out.append(hits[0])
    return out


def _close(nvml_total: int | None, listed_total: int) -> bool:
    if nvml_total is None:
        return True
    floor, share = LISTED_MEMORY_SLACK
    return abs(nvml_total - listed_total) <= max(floor, share * nvml_total)


def _matches(g: GpuInfo, d: Listed) -> bool:
    return d.description.strip() == g.name.strip() and _close(g.memory_total, d.total_bytes)


def _listed(d: Listed) -> str:
    return f"{d.name}={d.description} ({d.total_bytes // MIB} MiB)"


def _confirm(order: list[GpuInfo], listed: list[Listed], why: str) -> None:
    """llama.cpp's own listing must name the same GPUs in the same order (by name and total memory)."""
    if len(listed) != len(order):
        raise GpuOrderError(f"llama.cpp lists {len(listed)} CUDA devices ({', '.join(map(_listed, listed))}), fitter "
                            f"expects {len(order)} ({why}: {', '.join(map(_label, order)) or 'none'}); check "
                            f"{VISIBLE_ENV} and that the build supports every GPU")
    for i, (g, d) in enumerate(zip(order, listed, strict=True)):
        if not _matches(g, d):
            raise GpuOrderError(f"llama.cpp lists {_listed(d)}, fitter expects CUDA{i}={_label(g)} "
                                f"({(g.memory_total or 0) // MIB} MiB) ({why}): fitter would budget another GPU than "
                                "llama.cpp uses")


def _from_listing(gpus: list[GpuInfo], listed: list[Listed], ties_in_pci_order: bool) -> list[GpuInfo]:
    """The order llama.cpp's listing shows: each listed device is the NVML GPU of its name and total memory. Identical
    GPUs tie; when every GPU is visible they take PCI order, else which of them is visible cannot be known."""
    out: list[GpuInfo] = []
    for d in listed:
        hits = [g for g in gpus if all(g is not o for o in out) and _matches(g, d)]
        if not hits:
            raise GpuOrderError(f"llama.cpp lists {_listed(d)}, which matches no NVIDIA GPU NVML lists "
                                f"({', '.join(map(_label, gpus))}) by name and total memory; {PCI_REMEDY}")
        if len(hits) > 1 and not ties_in_pci_order:
            raise GpuOrderError(f"llama.cpp lists {_listed(d)}, which could be any of {', '.join(map(_label, hits))} "
                                f"under {VISIBLE_ENV} by index; {PCI_REMEDY}")
        out.append(hits[0])
    return out


def cuda_order(gpus: Sequence[GpuInfo], env: Mapping[str, str],
               listed: Sequence[Listed] | None = None) -> tuple[CudaGpu, ...]:
    """llama.cpp's CUDA devices as NVML's GPUs, CUDA0 first, under `env` (CUDA_DEVICE_ORDER, CUDA_VISIBLE_DEVICES).
    `listed`: a llama.cpp build's `--list-devices`, when one was asked; it confirms the order, or gives it where CUDA's
    rules alone do not (GPUs that differ, numbered fastest-first). GpuOrderError with the reason otherwise."""
    pci = pci_order(gpus)
    visible = parse_visible(env.get(VISIBLE_ENV))
    by_bus = env.get(DEVICE_ORDER_ENV) == PCI_BUS_ID
    identical = len({_model(g) for g in pci}) <= 1
    cuda = [d for d in listed or () if re.fullmatch(r"CUDA\d+", d.name)]
    order: list[GpuInfo] | None = None
    why = f"{VISIBLE_ENV}={env.get(VISIBLE_ENV)}"
    if visible == ():
        order = []  # no device visible
    elif visible is not None and isinstance(visible[0], str):
        order = _by_uuid(pci, tuple(str(v) for v in visible))  # by UUID: the order named, whatever the device order
    elif by_bus or identical:
        base = pci  # PCI order: asked for, or identical GPUs tied (see the module docstring)
        order = base if visible is None else _take(base, visible)
        why = (f"{DEVICE_ORDER_ENV}={PCI_BUS_ID}" if by_bus else "identical GPUs, in PCI order") + (
            f", {VISIBLE_ENV}={env[VISIBLE_ENV]}" if visible is not None else "")
    if order is not None:
        if cuda:
            _confirm(order, cuda, why)
        return tuple(CudaGpu(i, g) for i, g in enumerate(order))
    if not cuda:
        raise GpuOrderError(f"{DEVICE_ORDER_ENV} is {env.get(DEVICE_ORDER_ENV) or 'unset (FASTEST_FIRST)'} and the "
                            f"GPUs differ ({', '.join(map(_label, pci))}): CUDA then numbers them fastest-first by an "
                            f"undocumented heuristic, so fitter cannot tell which one llama.cpp calls CUDA0; {REMEDY}")
    return tuple(CudaGpu(i, g) for i, g in enumerate(_from_listing(pci, cuda, ties_in_pci_order=visible is None)))


def _take(base: list[GpuInfo], ordinals: tuple[int, ...] | tuple[str, ...]) -> list[GpuInfo]:
    """The GPUs the ordinals name in `base`, up to the first beyond it (invalid: it ends the list)."""
    out: list[GpuInfo] = []
    for n in ordinals:
        if not isinstance(n, int) or n >= len(base):
            break
        out.append(base[n])
    return out


def cuda_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that decide how CUDA numbers the GPUs, as set here (fitter's children inherit them)."""
    source = os.environ if env is None else env
    return {k: source[k] for k in CUDA_ENV if k in source}


def gpu_map(order: Sequence[CudaGpu]) -> list[dict[str, Any]]:
    """`machine.gpu_map`: each CUDA device's PCI bus id, name and total memory, CUDA0 first."""
    return [c.record() for c in order]


def gpu_map_text(gpus: Sequence[Mapping[str, Any]]) -> str:
    """`CUDA0=NVIDIA GeForce RTX 3090 (0000:01:00.0, 24576 MiB), …`, or `no GPU`."""
    def one(g: Mapping[str, Any]) -> str:
        memory = g.get("memory_total")
        mib = f", {memory // MIB} MiB" if isinstance(memory, int) else ""
        return f"{g.get('device')}={g.get('name')} ({g.get('pci_bus_id') or 'no PCI bus id'}{mib})"

    return ", ".join(map(one, gpus)) or "no GPU"
