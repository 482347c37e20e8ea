"""How much of each device a plan may use: its free memory less the memory it uses outside llama.cpp's buffers
(fitter.memory.backends.overhead) less the fit target (llama.cpp's `--fit-target`, MiB to leave free per device;
common/common.h `fit_params_target`, default 1024). One function for fit, tune and check."""

from __future__ import annotations

import math
from collections.abc import Sequence

from fitter.errors import FitterError
from fitter.memory.backends.devices import Device
from fitter.units import MIB

DEFAULT_FIT_TARGET_MIB = 1024  # common/common.h fit_params_target
DEFAULT_FIT_CTX = 4096  # common/common.h fit_params_min_ctx: with -c 0, the context a placement is first found at


def parse_fit_targets(text: str, flag: str = "--fit-target") -> tuple[int, ...]:
    """`MiB[,MiB…]` as non-negative integers."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise FitterError(f"{flag} {text!r}: expected MiB[,MiB...] as integers") from None
    if not values or any(v < 0 for v in values):
        raise FitterError(f"{flag} {text!r}: expected non-negative MiB[,MiB...]")
    return values


def check_target_count(devices: Sequence[str], targets_mib: Sequence[int], source: str = "--fit-target") -> None:
    """One target for every device, or exactly one per device (common/arg.cpp -fitt); else an error naming both
    counts and the devices, in the order the values apply to them."""
    if not targets_mib:
        raise FitterError(f"{source}: no value; give MiB to leave free (one for every GPU, or one per GPU)")
    n_devices = len(devices)
    if len(targets_mib) not in (1, n_devices):
        plural = "s" if n_devices != 1 else ""
        raise FitterError(f"{source} {','.join(map(str, targets_mib))}: {len(targets_mib)} values for {n_devices} "
                          f"GPU{plural} ({', '.join(devices)}); give one value for every GPU or exactly one per GPU")


def device_budgets(devices: Sequence[Device], targets_mib: Sequence[int],
                   source: str = "--fit-target") -> dict[str, int | None]:
    """Each device's budget in bytes: its free memory (else its total) less its overhead and its fit target; None
    where neither is known (an RPC server fitter cannot ask). `source` names where the targets come from."""
    check_target_count([d.name for d in devices], targets_mib, source)
    out: dict[str, int | None] = {}
    for i, d in enumerate(devices):
        free = d.free_bytes if d.free_bytes is not None else d.total_bytes
        target = targets_mib[i if len(targets_mib) > 1 else 0]
        overhead = d.overhead.bytes if d.overhead is not None else 0
        out[d.name] = None if free is None else free - overhead - target * MIB
    return out


def target_of(targets_mib: Sequence[int], index: int) -> int:
    """The fit target (MiB) of device `index`: its own, or the one for every device."""
    return targets_mib[index if len(targets_mib) > 1 else 0]


def lowered_targets(over_mib: Sequence[float], targets_mib: Sequence[int]) -> tuple[int, ...] | None:
    """The fit targets (MiB) under which a plan over its budgets by `over_mib` (per device, in order) fits: each
    device's target less what it is over by, rounded up to a MiB; None where a device is over by more than its target
    (no target makes room). One value when they are all alike, as --fit-target is written."""
    out = [target_of(targets_mib, i) - max(0, math.ceil(over)) for i, over in enumerate(over_mib)]
    if any(v < 0 for v in out):
        return None
    return tuple(out) if len(set(out)) > 1 else tuple(out[:1])
