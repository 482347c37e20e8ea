"""Every backend llama.cpp 0c1e570 ships, one row each: how it names its devices and buffers, and which of fitter's
rules its devices get.

A device llama.cpp lists (`llama-server --list-devices`: `NAME: DESCRIPTION (TOTAL MiB, FREE MiB free)`) is
matched to its backend by its name (`backend_of`); `device_profile` gives the estimator its rules:

- exact: the CPU, RPC (ggml-rpc forwards to the remote CPU backend), CUDA (its rules checked against fitter's
  CUDA-shaped emulated GPU), Vulkan (checked against ggml-vulkan itself on Mesa's lavapipe; a device's own limits
  from its driver, fitter.machine.vulkan);
- CUDA's code for another vendor: ROCm (HIP) and MUSA compile ggml-cuda (ggml/src/ggml-hip, ggml-musa), whose
  buffers and op offload are CUDA's under their own names (ggml/include/ggml-cuda.h GGML_CUDA_NAME); labelled as
  not validated on that hardware (its flash-attention kernels differ: not modelled);
- projected: every other backend (Metal, SYCL, OpenCL, CANN, WebGPU, OpenVINO, Hexagon, …): fitter has no rules for
  its buffers, and every memory figure of a plan on such a device comes from the build's own projection
  (`llama-fit-params --fit-print on`, fitter.memory.plan.projected), said so in one line. An unknown name is
  projected alike.

Device-type facts llama.cpp acts on (src/llama.cpp `llama_model_load_from_file_impl`): ACCEL devices (BLAS,
zDNN, ZenDNN) are never the model's devices and `--list-devices` shows them (everything but the CPU); integrated GPUs
are used only when no discrete one is; RPC devices come first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from fitter.errors import LaunchConfigError
from fitter.memory.backends.devices import (
    CPU_ALIGNMENT,
    CUDA,
    DISCRETE_VULKAN,
    RPC,
    Device,
    DeviceProfile,
    VulkanLimits,
    rpc_devices,
    vulkan_profile,
)
from fitter.memory.backends.overhead import default_overhead
from fitter.units import MIB

EXACT, CUDA_CODE, PROJECTED = "exact", "cuda-code", "projected"


@dataclass(frozen=True)
class Backend:
    name: str  # as fitter and the docs say it
    prefix: str  # its devices' names are prefix + index (CUDA0, ROCm0, Vulkan0, MTL0): a hypothetical card's name
    host_buft: str | None  # its pinned host buffer type (ggml_backend_dev_host_buffer_type), the CPU list's first
    rules: str  # EXACT | CUDA_CODE | PROJECTED
    source: str  # where llama.cpp names the device and the host buffer type
    device_type: str = "gpu"  # ggml_backend_dev_type: "gpu", "igpu" (by device: Vulkan's integrated ones), "accel"
    unified: bool = False  # its devices share the host's memory (Metal: Apple silicon)
    pattern: str = ""  # its devices' names as a regular expression, where not prefix + index

    def matches(self, name: str) -> bool:
        pattern = self.pattern or re.escape(self.prefix) + r"\d+"
        return re.fullmatch(pattern, name) is not None


# Device names at 0c1e570 (each backend's ggml_backend_*_device_get_name; ggml/include/ggml-<backend>.h's NAME)
BACKENDS: tuple[Backend, ...] = (
    Backend("CUDA", "CUDA", "CUDA_Host", EXACT, "ggml/include/ggml-cuda.h GGML_CUDA_NAME; ggml-cuda.cu "
            "ggml_backend_cuda_host_buffer_type_name"),
    Backend("ROCm", "ROCm", "ROCm_Host", CUDA_CODE, "ggml-cuda compiled by ggml/src/ggml-hip (GGML_USE_HIP): "
            "ggml-cuda.h GGML_CUDA_NAME \"ROCm\""),
    Backend("MUSA", "MUSA", "MUSA_Host", CUDA_CODE, "ggml-cuda compiled by ggml/src/ggml-musa (GGML_USE_MUSA): "
            "ggml-cuda.h GGML_CUDA_NAME \"MUSA\""),
    Backend("Vulkan", "Vulkan", "Vulkan_Host", EXACT, "ggml/include/ggml-vulkan.h GGML_VK_NAME; ggml-vulkan.cpp "
            "ggml_backend_vk_host_buffer_type_name"),
    Backend("RPC", "RPC", None, EXACT, "ggml/src/ggml-rpc/ggml-rpc.cpp: devices RPC<i>, buffers RPC<i on its "
            "server>[HOST:PORT], no host buffer type", pattern=r"RPC\d+(\[.*\])?"),
    Backend("Metal", "MTL", None, PROJECTED, "ggml/src/ggml-metal/ggml-metal.cpp GGML_METAL_NAME; no host buffer type",
            unified=True),
    Backend("SYCL", "SYCL", "SYCL_Host", PROJECTED, "ggml/include/ggml-sycl.h GGML_SYCL_NAME; ggml-sycl.cpp "
            "ggml_backend_sycl_host_buffer_type_name"),
    Backend("OpenCL", "GPUOpenCL", None, PROJECTED, "ggml/src/ggml-opencl/ggml-opencl.cpp "
            "ggml_backend_opencl_device_get_name: every device is GPUOpenCL", pattern="GPUOpenCL"),
    Backend("CANN", "CANN", "CANN_Host", PROJECTED, "ggml/src/ggml-cann/ggml-cann.cpp GGML_CANN_NAME, "
            "ggml_backend_cann_host_buffer_type_name"),
    Backend("WebGPU", "WebGPU", None, PROJECTED, "ggml/include/ggml-webgpu.h GGML_WEBGPU_NAME: one device",
            pattern="WebGPU"),
    Backend("OpenVINO", "OPENVINO", "OPENVINO0_HOST", PROJECTED, "ggml/include/ggml-openvino.h GGML_OPENVINO_NAME; "
            "one device, its host buffer type OPENVINO0_HOST"),
    Backend("Hexagon", "HTP", None, PROJECTED, "ggml/src/ggml-hexagon/ggml-hexagon.cpp: HTP<i>, virtual devices "
            "HTP<i>:<j> (GGML_HEXAGON_DEVICES)", pattern=r"HTP\d+(:\d+)?"),
    Backend("ET", "ET", None, PROJECTED, "ggml/include/ggml-et.h GGML_ET_NAME"),
    Backend("virtgpu", "ggml-virtgpu", None, PROJECTED, "ggml/src/ggml-virtgpu: \"[virtgpu] \" and the remote "
            "device's name", pattern=r"\[virtgpu\] .*"),
    Backend("zDNN", "zDNN", None, PROJECTED, "ggml/src/ggml-zdnn/common.hpp GGML_ZDNN_NAME", device_type="accel",
            pattern="zDNN"),
    Backend("ZenDNN", "ZenDNN", None, PROJECTED, "ggml/src/ggml-zendnn/ggml-zendnn.cpp", device_type="accel",
            pattern="ZenDNN"),
    Backend("BLAS", "BLAS", None, PROJECTED, "ggml/src/ggml-blas/ggml-blas.cpp", device_type="accel",
            pattern="BLAS"),
)
UNKNOWN = Backend("unknown", "", None, PROJECTED, "not among the backends of llama.cpp 0c1e570 fitter knows")

# `--devices KIND:MiB[,MiB…]`: the backends a hypothetical card can be asked about
HYPOTHETICAL = {"cuda": "CUDA", "vulkan": "Vulkan", "rocm": "ROCm", "musa": "MUSA", "metal": "Metal", "sycl": "SYCL"}


def backend_of(name: str) -> Backend:
    """The backend of a device llama.cpp names `name` (CUDA0, Vulkan1, RPC0[127.0.0.1:50052], MTL0, …)."""
    return next((b for b in BACKENDS if b.matches(name)), UNKNOWN)


def by_name(backend: str) -> Backend:
    return next(b for b in BACKENDS if b.name == backend)


def device_profile(backend: Backend, vulkan: VulkanLimits | None = None) -> DeviceProfile:
    """The estimator's rules for a device of `backend`; a Vulkan device with its driver's limits (`vulkan`), else
    those of a typical discrete card, said so in its `validated` line."""
    if backend.name == "CUDA":
        return CUDA
    if backend.name == "RPC":
        return RPC
    if backend.rules == CUDA_CODE:
        return replace(CUDA, kind=backend.name.lower(), host_buft=backend.host_buft,
                       validated=f"CUDA's rules: {backend.name} builds compile ggml-cuda ({backend.source}); not "
                       f"validated on {backend.name} hardware (its flash-attention kernels differ)")
    if backend.name == "Vulkan":
        if vulkan is None:
            return vulkan_profile(DISCRETE_VULKAN, "Vulkan's rules, validated on lavapipe (tests/golden/vulkan-emulated"
                                  ".json), with the limits of a typical discrete card (alignment 16, buffer range "
                                  "4 GiB): this device's own were not read")
        return vulkan_profile(vulkan)
    return DeviceProfile(backend.name.lower(), CPU_ALIGNMENT, 0, backend.host_buft, False,
                         f"no rules for {backend.name} in fitter: its buffers come from the build's own projection "
                         "(llama-fit-params --fit-print on)", unified=backend.unified, projected=True)


def parse_devices(spec: str) -> tuple[Device, ...]:
    """`--devices none | KIND:MiB[,MiB...] | rpc:HOST:PORT[,...]` (CONTRACTS.md): hypothetical cards of a backend
    (`HYPOTHETICAL`: cuda, vulkan, rocm, musa, metal, sycl), each with all its memory free, named as llama.cpp names
    that backend's devices, with its rules (a Vulkan card: a typical discrete one's limits; a CUDA card: the default
    overhead of a GPU of unknown class; Metal and SYCL: no rules, their figures only from a build's projection)."""
    spec = spec.strip()
    if spec == "none":
        return ()
    kind, sep, rest = spec.partition(":")
    if kind == "rpc" and sep:
        return rpc_devices(rest.split(","), flag="--devices")
    if kind in HYPOTHETICAL and sep:
        backend = by_name(HYPOTHETICAL[kind])
        profile = device_profile(backend, DISCRETE_VULKAN if backend.name == "Vulkan" else None)
        if backend.name == "Vulkan":
            profile = replace(profile, validated="Vulkan's rules, validated on lavapipe (tests/golden/vulkan-emulated"
                              ".json), with the limits of a typical discrete card (alignment 16, buffer range 4 GiB)")
        devices = []
        for i, mib in enumerate(rest.split(",")):
            if not re.fullmatch(r"\d+", mib) or int(mib) <= 0:
                raise LaunchConfigError(f"--devices {spec!r}: {mib!r} is not a positive number of MiB")
            size = int(mib) * MIB
            overhead = default_overhead() if kind == "cuda" else None
            devices.append(Device(f"{backend.prefix}{i}", profile, size, size, overhead))
        return tuple(devices)
    kinds = ", ".join(f"{k}:MiB[,MiB...]" for k in HYPOTHETICAL)
    raise LaunchConfigError(f"--devices {spec!r}: {kind!r} is not a kind fitter knows; expected none, {kinds} or "
                            "rpc:HOST:PORT[,...]")
