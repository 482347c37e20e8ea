"""This machine as llama.cpp sees it: one snapshot per command (CPU topology, RAM, NVIDIA GPUs through NVML), the
llama.cpp that llama-cpp-python provides, the NVML peak sampler and a process's peak RSS; `probe` reports them."""

from __future__ import annotations

from fitter.machine.snapshot import MachineSnapshot, machine_record, take_snapshot

__all__ = ["MachineSnapshot", "machine_record", "take_snapshot"]
