"""The environment fitter's commands pass on to the llama.cpp they start, as it changes the devices it sees."""

from __future__ import annotations

import os

from fitter.memory.backends.devices import OFFLOAD_MIN_BATCH_ENV, Device, with_offload_min_batch


def with_environment(devices: tuple[Device, ...]) -> tuple[Device, ...]:
    """`devices` as the llama.cpp fitter starts will see them: its children inherit this environment, and ggml-cuda
    reads GGML_OP_OFFLOAD_MIN_BATCH from it (the estimator itself reads no environment)."""
    return with_offload_min_batch(devices, os.environ.get(OFFLOAD_MIN_BATCH_ENV))
