"""This machine as llama.cpp sees it: one snapshot per command (CPU topology, RAM, NVIDIA GPUs through NVML), the
llama.cpp that llama-cpp-python provides, the NVML peak sampler and a process's peak RSS; `probe` reports them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fitter.machine.snapshot import MachineSnapshot, machine_record, take_snapshot

__all__ = ["MachineSnapshot", "machine_record", "take_snapshot"]


def __getattr__(name: str) -> Any:
    """The snapshot's names, imported on first use: `fitter estimate` reads fitter.machine.cpu alone, without the
    snapshot's NVML and llama-cpp-python modules."""
    if name in __all__:
        from fitter.machine import snapshot

        return getattr(snapshot, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
