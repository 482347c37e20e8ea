"""The memory estimate: a pure function of (model spec, launch config, devices) → every buffer llama.cpp allocates
(`estimate`), with the devices' buffer rules, the compute-graph replay behind compute buffers, the budgets a plan
must fit, and `fit`, the placement that uses the most device memory within them."""

from __future__ import annotations

from fitter.memory.backends.devices import CUDA, RPC, CpuProfile, Device, DeviceProfile, rpc_devices
from fitter.memory.backends.registry import parse_devices
from fitter.memory.fit.budgets import DEFAULT_FIT_TARGET_MIB, device_budgets, parse_fit_targets
from fitter.memory.fit.fit import FitResult, fit
from fitter.memory.plan.estimator import Buffer, DeviceTotals, MemoryPlan, estimate

__all__ = ["CUDA", "DEFAULT_FIT_TARGET_MIB", "RPC", "Buffer", "CpuProfile", "Device", "DeviceProfile", "DeviceTotals",
           "FitResult", "MemoryPlan", "device_budgets", "estimate", "fit", "parse_devices", "parse_fit_targets",
           "rpc_devices"]
