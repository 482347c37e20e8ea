"""The buffers a memory plan lists and the sizes llama.cpp gives a tensor in one (ggml's row sizes, alignment and
CUDA's row padding): shared by the estimator's placement and its KV cache."""

from __future__ import annotations

from dataclasses import dataclass

from fitter.gguf._constants import GGML_QUANT_SIZES, GGMLQuantizationType
from fitter.gguf.model_spec import TensorSpec
from fitter.memory.backends.devices import CPU_ALIGNMENT, Device

CPU = "CPU"
KINDS = ("model", "kv", "compute", "output")


@dataclass(frozen=True)
class Buffer:
    buft: str  # as llama.cpp logs it: CPU_Mapped, CPU_REPACK, CPU, CUDA_Host, CUDA0, RPC0[...]
    kind: str  # model | kv | compute | output
    device: str  # "CPU" for every host buffer type, else the device name
    bytes: int
    model: str = ""  # whose buffer: "" the model's, "draft" the draft model's (-md)


@dataclass(frozen=True)
class Placement:
    tensor: TensorSpec
    buft: str


def pad_to(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def row_bytes(type_name: str, n: int) -> int:
    """ggml_row_size: bytes of n elements of a type."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]]
    return n // block * size


def alloc_size(device: Device | None, type_name: str, ne: tuple[int, ...], n_bytes: int) -> int:
    """ggml_backend_buft_get_alloc_size padded to the buffer's alignment (ggml-alloc.c)."""
    if device is None:
        return pad_to(n_bytes, CPU_ALIGNMENT)
    size = n_bytes
    quantized = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]][0] > 1
    pad = device.profile.row_padding
    if pad and quantized and ne[0] % pad:
        size += row_bytes(type_name, pad - ne[0] % pad)  # [TAG_ALLOC_SIZE_EXPAND] in ggml-cuda.cu
    return pad_to(size, device.profile.alignment)
