"""fitter.machine.vulkan: a Vulkan device's limits, read as ggml-vulkan reads them."""

from __future__ import annotations

import ctypes

import pytest

from fitter.machine import vulkan
from fitter.memory.backends.devices import VulkanLimits
from fitter.units import MIB


def _lavapipe_structs() -> tuple[vulkan._Properties, vulkan._MemoryProperties]:
    props = vulkan._Properties()
    props.deviceType = 4  # VK_PHYSICAL_DEVICE_TYPE_CPU
    props.deviceName = b"llvmpipe (LLVM 15.0.6, 256 bits)"
    props.vendorID = 0x10005
    props.limits.maxStorageBufferRange = 128 * MIB
    props.limits.minStorageBufferOffsetAlignment = 16
    props.limits.minMemoryMapAlignment = 64
    props.limits.maxComputeSharedMemorySize = 32768
    heaps = vulkan._MemoryProperties()
    heaps.memoryHeapCount = 2
    heaps.memoryHeaps[0].size, heaps.memoryHeaps[0].flags = 2048 * MIB, 1  # device-local
    heaps.memoryHeaps[1].size, heaps.memoryHeaps[1].flags = 8192 * MIB, 0  # host
    return props, heaps


def test_the_limits_ggml_vulkan_sizes_buffers_by() -> None:
    props, heaps = _lavapipe_structs()
    dev = vulkan.limits_of(props, 2048 * MIB, 4096 * MIB - 1, heaps)
    assert dev.name == "llvmpipe (LLVM 15.0.6, 256 bits)" and dev.device_type == "cpu" and not dev.integrated
    assert dev.heap_bytes == 2048 * MIB  # only the device-local heap counts for a discrete (or CPU) device
    assert dev.limits() == VulkanLimits(16, 64, 128 * MIB, 2048 * MIB, 4096 * MIB - 1)
    # without VK_KHR_maintenance4 the allocation size is also the largest buffer
    assert vulkan.limits_of(props, 2048 * MIB, None, heaps).limits().max_buffer == 2048 * MIB
    # an integrated GPU: every heap is its memory, and it is the host's
    props.deviceType = 1
    igpu = vulkan.limits_of(props, 2048 * MIB, None, heaps)
    assert igpu.heap_bytes == 10240 * MIB and igpu.limits().integrated


def test_the_structures_have_the_registrys_layout() -> None:
    # vulkan_core.h compiled on x86-64 (sizeof/offsetof, checked with gcc against Debian 12's 1.3.239 headers)
    assert ctypes.sizeof(vulkan._Limits) == 504 and ctypes.sizeof(vulkan._Properties) == 824
    assert vulkan._Limits.maxStorageBufferRange.offset == 28
    assert vulkan._Limits.minMemoryMapAlignment.offset == 304
    assert vulkan._Limits.minStorageBufferOffsetAlignment.offset == 328


def test_a_device_is_matched_by_the_description_llama_cpp_lists() -> None:
    props, heaps = _lavapipe_structs()
    dev = vulkan.limits_of(props, 2048 * MIB, None, heaps)
    assert vulkan.match((dev,), "llvmpipe (LLVM 15.0.6, 256 bits)") is dev
    assert vulkan.match((dev,), "AMD Radeon RX 7900 XTX (RADV NAVI31)") is None


def test_this_machines_devices_when_it_has_a_vulkan_loader() -> None:
    devices = vulkan.vulkan_devices()
    if devices is None:
        pytest.skip("no Vulkan loader (libvulkan.so.1) here")
    for d in devices:
        assert d.min_storage_buffer_offset_alignment > 0 and d.max_storage_buffer_range > 0 and d.heap_bytes > 0
