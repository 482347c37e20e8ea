"""Devices an estimate reasons about: their buffer rules (pure data), and the targets `--devices` names.

Buffer rules mirror ggml's backends: CUDA buffers align to 128 bytes and pad the last row of quantized matrices to
512 elements (ggml/src/ggml-cuda/ggml-cuda.cu `ggml_backend_cuda_buffer_type_get_alloc_size`, MATRIX_ROW_PADDING
in common.cuh) and own a pinned host buffer type `CUDA_Host`; an RPC device forwards to the remote CPU backend
(32-byte alignment, TENSOR_ALIGNMENT in ggml-impl.h) and has no host buffer type (ggml/src/ggml-rpc/ggml-rpc.cpp).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from fitter.errors import LaunchConfigError
from fitter.memory.backends.overhead import Overhead

CPU_ALIGNMENT = 32  # TENSOR_ALIGNMENT, ggml/src/ggml-impl.h
OFFLOAD_MIN_BATCH_ENV = "GGML_OP_OFFLOAD_MIN_BATCH"  # ggml-cuda.cu: read once when the CUDA backend registers
OFFLOAD_MIN_BATCH = 32  # its value when unset


@dataclass(frozen=True)
class DeviceProfile:
    """A device's buffer rules: what its backend does with the tensors, buffers and ops llama.cpp gives it."""

    kind: str  # the backend (fitter.memory.backends.registry): "cuda" | "rpc" | "vulkan" | "rocm" | "musa" | ...
    alignment: int
    row_padding: int  # elements the last row of a quantized matrix is padded to; 0 = none
    host_buft: str | None  # pinned host buffer type offered to the CPU buffer list
    op_offload: bool  # does the scheduler copy CPU weights over for large batches (ggml-backend.cpp)
    validated: str  # how this profile was checked against llama.cpp
    # which ops the device runs and the bytes it gives a tensor in the compute graph: "cpu" (every op, ggml_nbytes:
    # the CPU's and RPC's), "cuda" (fitter.memory.graph.cuda_ops), "vulkan" (fitter.memory.graph.vulkan_ops)
    ops: str = "cpu"
    # the batch from which op offload takes an op with a host weight: ggml-cuda.cu and ggml-vulkan.cpp read
    # GGML_OP_OFFLOAD_MIN_BATCH once, default 32 (fitter.machine.environment.with_environment applies the environment
    # at a command's edge)
    offload_min_batch: int = OFFLOAD_MIN_BATCH
    max_op_bytes: int | None = None  # the largest tensor its ops take (Vulkan: maxStorageBufferRange); None: any
    max_alloc: int | None = None  # its buffer type's maximum size: larger buffers are split (None: no maximum)
    host_alignment: int = CPU_ALIGNMENT  # the host buffer type's alignment
    host_extra: int = 0  # bytes the host buffer type adds to each buffer it makes
    host_max_alloc: int | None = None  # the host buffer type's maximum size
    graph_optimize: bool = True  # Vulkan: each split reordered before it is allocated (GGML_VK_DISABLE_GRAPH_OPTIMIZE)
    unified: bool = False  # the device's memory is the host's (an integrated GPU, Apple silicon): one budget
    integrated: bool = False  # ggml_backend_dev_type IGPU: llama.cpp uses it only when no discrete GPU is there
    mmap: bool = True  # caps.mmap_support: false turns `-lm auto`'s mmap off (ggml-vulkan: an integrated GPU)
    projected: bool = False  # fitter has no rules for its backend: its buffers come from the build's projection

    @property
    def cuda_rules(self) -> bool:
        """CUDA's allocation sizes and flash-attention support (fitter.memory.graph.cuda_ops)."""
        return self.ops == "cuda"


CUDA = DeviceProfile("cuda", 128, 512, "CUDA_Host", True,
                     "validated against fitter's CUDA-shaped emulated GPU (tests/golden/cuda-emulated.json), not yet "
                     "against a CUDA build", ops="cuda")
RPC = DeviceProfile("rpc", CPU_ALIGNMENT, 0, None, False, "validated against llama.cpp's RPC backend")

VULKAN_SUBALLOCATION = 1 << 30  # ggml-vulkan.cpp ggml_vk_get_device: suballocation_block_size, 1 GiB by default
VULKAN_HOST_EXTRA = 32  # ggml_backend_vk_host_buffer_type_alloc_buffer: "size += 32; // Behave like the CPU buffer…"
VULKAN_VALIDATED = ("validated against llama.cpp's Vulkan backend on Mesa's lavapipe "
                    "(tests/golden/vulkan-emulated.json)")


@dataclass(frozen=True)
class VulkanLimits:
    """What ggml-vulkan reads from a Vulkan device to size and place buffers (ggml-vulkan.cpp `ggml_vk_get_device`,
    llama.cpp 0c1e570); fitter.machine.vulkan reads them from this machine's devices."""

    storage_alignment: int  # minStorageBufferOffsetAlignment: the device buffer type's alignment
    map_alignment: int  # minMemoryMapAlignment: the pinned host buffer type's (Vulkan_Host)
    max_storage_range: int  # maxStorageBufferRange: the largest tensor the device's ops take
    max_allocation: int  # maxMemoryAllocationSize, capped by maxBufferSize (VK_KHR_maintenance4)
    max_buffer: int  # maxBufferSize (maintenance4), else maxMemoryAllocationSize
    integrated: bool = False  # an integrated GPU: its memory is the host's (uma)


# A discrete GPU of unknown make (`--devices vulkan:MiB`): the limits RADV reports for an AMD card (alignment 4 rounded
# up to NVIDIA's 16, storage range 4 GiB - 1, 4 GiB allocations, Vulkan_Host at 64), the most common among cards
# people run Vulkan builds on; an actual card is read from its driver (fitter.machine.vulkan).
DISCRETE_VULKAN = VulkanLimits(16, 64, (1 << 32) - 1, 1 << 32, 1 << 32)


def vulkan_profile(limits: VulkanLimits, validated: str = VULKAN_VALIDATED) -> DeviceProfile:
    """The buffer rules of a Vulkan device with these limits (ggml/src/ggml-vulkan/ggml-vulkan.cpp): buffers aligned
    to minStorageBufferOffsetAlignment at ggml_nbytes (`ggml_backend_vk_buffer_type_get_alloc_size`), split into
    suballocation blocks of at most 1 GiB (`_get_max_size`); the pinned host type `Vulkan_Host` aligned to
    minMemoryMapAlignment, 32 bytes over each buffer; op offload as CUDA's (`ggml_backend_vk_device_offload_op`);
    no tensor past the buffer range in an op (`ggml_backend_vk_device_supports_op`)."""
    block = min(VULKAN_SUBALLOCATION, limits.max_allocation)
    return DeviceProfile("vulkan", limits.storage_alignment, 0, "Vulkan_Host", True, validated, ops="vulkan",
                         max_op_bytes=min(limits.max_storage_range, limits.max_buffer), max_alloc=block,
                         host_alignment=limits.map_alignment, host_extra=VULKAN_HOST_EXTRA, host_max_alloc=block,
                         unified=limits.integrated, integrated=limits.integrated, mmap=not limits.integrated)


@dataclass(frozen=True)
class Device:
    name: str  # as llama.cpp names its buffer type: "CUDA0", "RPC0[127.0.0.1:50052]"
    profile: DeviceProfile
    total_bytes: int | None = None
    free_bytes: int | None = None
    overhead: Overhead | None = None  # memory it uses outside llama.cpp's buffers (fitter.memory.backends.overhead)


@dataclass(frozen=True)
class CpuProfile:
    """What decides CPU_REPACK (ggml/src/ggml-cpu/repack.cpp `ggml_repack_get_optimal_repack_type`)."""

    # Which weight types the CPU backend repacks, with the row multiple (ne[1] % n == 0) each requires.
    repack_types: tuple[tuple[str, int], ...]
    description: str


# x86-64 with AVX2 and without AVX-512 (llama-cpp-python built with GGML_NATIVE=OFF compiles AVX2 in).
CPU_AVX2 = CpuProfile((("Q4_0", 8), ("Q4_K", 8), ("IQ4_NL", 8), ("MXFP4", 8)), "x86-64 AVX2")
CPU_AVX512 = CpuProfile((*CPU_AVX2.repack_types, ("Q2_K", 8)), "x86-64 AVX-512")
CPU_NO_REPACK = CpuProfile((), "no repacking kernels")


def rpc_device_name(endpoint: str) -> str:
    """The device of the RPC server at `endpoint`, as ggml-rpc.cpp names a server's devices `RPC<index on that
    server>[HOST:PORT]`: each server fitter meets serves one, so `RPC0[…]` whatever its place in `--rpc`."""
    return f"RPC0[{endpoint}]"


def emulated_gpu_names(endpoints: Sequence[str]) -> dict[str, str]:
    """Emulated GPUs (their RPC device names, in `--rpc` order) → the CUDA<i> devices they stand for."""
    return {rpc_device_name(e): f"CUDA{i}" for i, e in enumerate(endpoints)}


def rpc_devices(endpoints: list[str], flag: str = "--rpc") -> tuple[Device, ...]:
    """One device per RPC server, named as ggml-rpc.cpp names a server's devices, `RPC<index on that
    server>[HOST:PORT]`: each server's (only) device is `RPC0[…]` whatever its place in the list."""
    devices = []
    for endpoint in endpoints:
        if not re.fullmatch(r"[\w.\-\[\]:]+:\d+", endpoint):
            raise LaunchConfigError(f"{flag} {endpoint!r}: expected HOST:PORT")
        devices.append(Device(rpc_device_name(endpoint), RPC))
    if len({d.name for d in devices}) < len(devices):
        raise LaunchConfigError(f"{flag} {','.join(endpoints)}: an RPC server is named twice")
    return tuple(devices)


def c_atoi(text: str) -> int:
    """C's atoi: optional blanks and sign, then digits; anything else (or nothing) is 0."""
    m = re.match(r"\s*([+-]?\d+)", text)
    return int(m.group(1)) if m else 0


def offload_min_batch(value: str | None) -> int:
    """GGML_OP_OFFLOAD_MIN_BATCH as ggml-cuda.cu reads it: `getenv(...) ? atoi(getenv(...)) : 32`."""
    return OFFLOAD_MIN_BATCH if value is None else c_atoi(value)


def with_offload_min_batch(devices: tuple[Device, ...], value: str | None) -> tuple[Device, ...]:
    """The CUDA devices with GGML_OP_OFFLOAD_MIN_BATCH (`value`, the environment's) applied."""
    if value is None:
        return devices
    n = offload_min_batch(value)
    return tuple(replace(d, profile=replace(d.profile, offload_min_batch=n)) if d.profile.op_offload else d
                 for d in devices)


def cpu_profile_for(isa_flags: frozenset[str] | set[str]) -> CpuProfile:
    """The repack rules of a CPU with these ISA flags (/proc/cpuinfo spellings). The pinned wheel is built with
    GGML_NATIVE=OFF: AVX2 kernels are compiled in, AVX-512 ones are not."""
    return CPU_AVX2 if "avx2" in isa_flags else CPU_NO_REPACK
