"""What this machine's Vulkan devices tell of themselves: the limits ggml-vulkan sizes and places buffers by.

llama.cpp's `--list-devices` names a Vulkan device (`Vulkan0: <deviceName>`) and its memory, nothing more; its
buffer rules come from the device's Vulkan properties, read once per command here from the Vulkan loader
(libvulkan.so.1, which every Vulkan build of llama.cpp links) through ctypes, as ggml-vulkan reads them
(ggml/src/ggml-vulkan/ggml-vulkan.cpp `ggml_vk_get_device`, llama.cpp 0c1e570):

- `minStorageBufferOffsetAlignment`: the device buffer type's alignment (`ggml_backend_vk_buffer_type_get_alignment`);
- `minMemoryMapAlignment`: the pinned host buffer type's (`Vulkan_Host`,
  `ggml_backend_vk_host_buffer_type_get_alignment`);
- `maxStorageBufferRange` and, with VK_KHR_maintenance4, `maxBufferSize`: a tensor larger than either cannot be
  used by the device's ops (`ggml_backend_vk_device_supports_op`: `tensor_size_supported`), so such a weight stays
  on the host and such a KV cache aborts the load;
- `maxMemoryAllocationSize` (VK_KHR_maintenance3, core in 1.1), capped by `maxBufferSize`: the suballocation block
  a buffer type's buffers are split into (`suballocation_block_size`, at most 1 GiB unless
  GGML_VK_SUBALLOCATION_BLOCK_SIZE says otherwise);
- the device type: an integrated GPU shares the host's memory (`uma`; its heaps all count as its memory in
  `ggml_backend_vk_get_device_memory`).

Pure parsing is `limits_of`; `vulkan_devices()` is the I/O (None where no Vulkan loader is installed).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from fitter.memory.backends.devices import VulkanLimits

# VkPhysicalDeviceType
DEVICE_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
_STRUCTURE_TYPE_PROPERTIES_2 = 1000059001
_STRUCTURE_TYPE_MAINTENANCE_3 = 1000168000
_STRUCTURE_TYPE_MAINTENANCE_4 = 1000413001
_API_1_1 = (1 << 22) | (1 << 12)  # VK_MAKE_API_VERSION(0, 1, 1, 0)

_u32, _u64, _f32, _size = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_float, ctypes.c_size_t


class _Limits(ctypes.Structure):
    """VkPhysicalDeviceLimits (Vulkan 1.0, vulkan_core.h), every field in order."""

    _fields_ = [
        *[(n, _u32) for n in ("maxImageDimension1D", "maxImageDimension2D", "maxImageDimension3D",
                              "maxImageDimensionCube", "maxImageArrayLayers", "maxTexelBufferElements",
                              "maxUniformBufferRange", "maxStorageBufferRange", "maxPushConstantsSize",
                              "maxMemoryAllocationCount", "maxSamplerAllocationCount")],
        ("bufferImageGranularity", _u64), ("sparseAddressSpaceSize", _u64),
        *[(n, _u32) for n in (
            "maxBoundDescriptorSets", "maxPerStageDescriptorSamplers", "maxPerStageDescriptorUniformBuffers",
            "maxPerStageDescriptorStorageBuffers", "maxPerStageDescriptorSampledImages",
            "maxPerStageDescriptorStorageImages", "maxPerStageDescriptorInputAttachments", "maxPerStageResources",
            "maxDescriptorSetSamplers", "maxDescriptorSetUniformBuffers", "maxDescriptorSetUniformBuffersDynamic",
            "maxDescriptorSetStorageBuffers", "maxDescriptorSetStorageBuffersDynamic", "maxDescriptorSetSampledImages",
            "maxDescriptorSetStorageImages", "maxDescriptorSetInputAttachments", "maxVertexInputAttributes",
            "maxVertexInputBindings", "maxVertexInputAttributeOffset", "maxVertexInputBindingStride",
            "maxVertexOutputComponents", "maxTessellationGenerationLevel", "maxTessellationPatchSize",
            "maxTessellationControlPerVertexInputComponents", "maxTessellationControlPerVertexOutputComponents",
            "maxTessellationControlPerPatchOutputComponents", "maxTessellationControlTotalOutputComponents",
            "maxTessellationEvaluationInputComponents", "maxTessellationEvaluationOutputComponents",
            "maxGeometryShaderInvocations", "maxGeometryInputComponents", "maxGeometryOutputComponents",
            "maxGeometryOutputVertices", "maxGeometryTotalOutputComponents", "maxFragmentInputComponents",
            "maxFragmentOutputAttachments", "maxFragmentDualSrcAttachments", "maxFragmentCombinedOutputResources",
            "maxComputeSharedMemorySize")],
        ("maxComputeWorkGroupCount", _u32 * 3), ("maxComputeWorkGroupInvocations", _u32),
        ("maxComputeWorkGroupSize", _u32 * 3),
        *[(n, _u32) for n in ("subPixelPrecisionBits", "subTexelPrecisionBits", "mipmapPrecisionBits",
                              "maxDrawIndexedIndexValue", "maxDrawIndirectCount")],
        ("maxSamplerLodBias", _f32), ("maxSamplerAnisotropy", _f32), ("maxViewports", _u32),
        ("maxViewportDimensions", _u32 * 2), ("viewportBoundsRange", _f32 * 2), ("viewportSubPixelBits", _u32),
        ("minMemoryMapAlignment", _size), ("minTexelBufferOffsetAlignment", _u64),
        ("minUniformBufferOffsetAlignment", _u64), ("minStorageBufferOffsetAlignment", _u64),
        ("minTexelOffset", ctypes.c_int32), ("maxTexelOffset", _u32), ("minTexelGatherOffset", ctypes.c_int32),
        ("maxTexelGatherOffset", _u32), ("minInterpolationOffset", _f32), ("maxInterpolationOffset", _f32),
        *[(n, _u32) for n in (
            "subPixelInterpolationOffsetBits", "maxFramebufferWidth", "maxFramebufferHeight", "maxFramebufferLayers",
            "framebufferColorSampleCounts", "framebufferDepthSampleCounts", "framebufferStencilSampleCounts",
            "framebufferNoAttachmentsSampleCounts", "maxColorAttachments", "sampledImageColorSampleCounts",
            "sampledImageIntegerSampleCounts", "sampledImageDepthSampleCounts", "sampledImageStencilSampleCounts",
            "storageImageSampleCounts", "maxSampleMaskWords", "timestampComputeAndGraphics")],
        ("timestampPeriod", _f32),
        *[(n, _u32) for n in ("maxClipDistances", "maxCullDistances", "maxCombinedClipAndCullDistances",
                              "discreteQueuePriorities")],
        ("pointSizeRange", _f32 * 2), ("lineWidthRange", _f32 * 2), ("pointSizeGranularity", _f32),
        ("lineWidthGranularity", _f32), ("strictLines", _u32), ("standardSampleLocations", _u32),
        ("optimalBufferCopyOffsetAlignment", _u64), ("optimalBufferCopyRowPitchAlignment", _u64),
        ("nonCoherentAtomSize", _u64),
    ]


class _Properties(ctypes.Structure):
    _fields_ = [("apiVersion", _u32), ("driverVersion", _u32), ("vendorID", _u32), ("deviceID", _u32),
                ("deviceType", ctypes.c_int32), ("deviceName", ctypes.c_char * 256),
                ("pipelineCacheUUID", ctypes.c_uint8 * 16), ("limits", _Limits), ("sparseProperties", _u32 * 5)]


class _Maintenance4(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int32), ("pNext", ctypes.c_void_p), ("maxBufferSize", _u64)]


class _Maintenance3(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int32), ("pNext", ctypes.c_void_p), ("maxPerSetDescriptors", _u32),
                ("maxMemoryAllocationSize", _u64)]


class _Properties2(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int32), ("pNext", ctypes.c_void_p), ("properties", _Properties)]


class _MemoryHeap(ctypes.Structure):
    _fields_ = [("size", _u64), ("flags", _u32)]


class _MemoryProperties(ctypes.Structure):
    _fields_ = [("memoryTypeCount", _u32), ("memoryTypes", (_u32 * 2) * 32), ("memoryHeapCount", _u32),
                ("memoryHeaps", _MemoryHeap * 16)]


class _AppInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int32), ("pNext", ctypes.c_void_p), ("pApplicationName", ctypes.c_char_p),
                ("applicationVersion", _u32), ("pEngineName", ctypes.c_char_p), ("engineVersion", _u32),
                ("apiVersion", _u32)]


class _InstanceInfo(ctypes.Structure):
    _fields_ = [("sType", ctypes.c_int32), ("pNext", ctypes.c_void_p), ("flags", _u32),
                ("pApplicationInfo", ctypes.POINTER(_AppInfo)), ("enabledLayerCount", _u32),
                ("ppEnabledLayerNames", ctypes.c_void_p), ("enabledExtensionCount", _u32),
                ("ppEnabledExtensionNames", ctypes.c_void_p)]


_DEVICE_LOCAL = 1  # VK_MEMORY_HEAP_DEVICE_LOCAL_BIT


@dataclass(frozen=True)
class VulkanDevice:
    """One physical device as the Vulkan loader describes it (the fields ggml-vulkan sizes buffers by)."""

    name: str  # deviceName: what llama.cpp's --list-devices prints as the description of Vulkan<i>
    device_type: str  # DEVICE_TYPES
    vendor_id: int
    min_storage_buffer_offset_alignment: int
    min_memory_map_alignment: int
    max_storage_buffer_range: int
    max_memory_allocation_size: int
    max_buffer_size: int | None  # VK_KHR_maintenance4 (core in 1.3); None: not reported
    shared_memory: int  # maxComputeSharedMemorySize
    heap_bytes: int  # device-local heaps (every heap of an integrated GPU), as ggml-vulkan totals them

    @property
    def integrated(self) -> bool:
        return self.device_type == "integrated"

    def limits(self) -> VulkanLimits:
        """The limits ggml-vulkan sizes buffers by (`ggml_vk_get_device`): with VK_KHR_maintenance4 the allocation
        size is capped by maxBufferSize, which is also the buffer size; without it both are maxMemoryAllocationSize."""
        max_buffer = self.max_buffer_size or self.max_memory_allocation_size
        return VulkanLimits(self.min_storage_buffer_offset_alignment, self.min_memory_map_alignment,
                            self.max_storage_buffer_range, min(self.max_memory_allocation_size, max_buffer),
                            max_buffer, self.integrated)


def limits_of(props: _Properties, max_alloc: int, max_buffer: int | None, heaps: _MemoryProperties) -> VulkanDevice:
    """A VulkanDevice from the structures the loader filled in."""
    kind = DEVICE_TYPES.get(props.deviceType, "other")
    n = min(int(heaps.memoryHeapCount), 16)
    heap_bytes = sum(int(h.size) for h in heaps.memoryHeaps[:n] if kind == "integrated" or h.flags & _DEVICE_LOCAL)
    limits = props.limits
    return VulkanDevice(
        name=props.deviceName.decode(errors="replace"), device_type=kind, vendor_id=int(props.vendorID),
        min_storage_buffer_offset_alignment=int(limits.minStorageBufferOffsetAlignment),
        min_memory_map_alignment=int(limits.minMemoryMapAlignment),
        max_storage_buffer_range=int(limits.maxStorageBufferRange), max_memory_allocation_size=max_alloc,
        max_buffer_size=max_buffer, shared_memory=int(limits.maxComputeSharedMemorySize), heap_bytes=heap_bytes)


def vulkan_devices(library: str = "libvulkan.so.1") -> tuple[VulkanDevice, ...] | None:
    """Every physical device the Vulkan loader lists (in its order; ggml-vulkan then picks and names them, see
    `match`), or None when no loader can be opened or no instance made."""
    try:
        vk = ctypes.CDLL(library)
    except OSError:
        return None
    vp = ctypes.c_void_p
    vk.vkCreateInstance.argtypes = [ctypes.POINTER(_InstanceInfo), vp, ctypes.POINTER(vp)]
    vk.vkCreateInstance.restype = ctypes.c_int32
    vk.vkEnumeratePhysicalDevices.argtypes = [vp, ctypes.POINTER(_u32), ctypes.POINTER(vp)]
    vk.vkEnumeratePhysicalDevices.restype = ctypes.c_int32
    vk.vkGetPhysicalDeviceProperties2.argtypes = [vp, ctypes.POINTER(_Properties2)]
    vk.vkGetPhysicalDeviceMemoryProperties.argtypes = [vp, ctypes.POINTER(_MemoryProperties)]
    vk.vkDestroyInstance.argtypes = [vp, vp]
    app = _AppInfo(0, None, b"fitter", 1, b"fitter", 1, _API_1_1)  # VK_STRUCTURE_TYPE_APPLICATION_INFO
    info = _InstanceInfo(1, None, 0, ctypes.pointer(app), 0, None, 0, None)  # VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO
    instance = vp()
    if vk.vkCreateInstance(ctypes.byref(info), None, ctypes.byref(instance)) != 0:
        return None
    try:
        count = _u32(0)
        if vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), None) != 0:
            return None
        handles = (vp * count.value)()
        if vk.vkEnumeratePhysicalDevices(instance, ctypes.byref(count), handles) != 0:
            return None
        out = []
        for handle in handles[: count.value]:
            m4 = _Maintenance4(_STRUCTURE_TYPE_MAINTENANCE_4, None, 0)
            m3 = _Maintenance3(_STRUCTURE_TYPE_MAINTENANCE_3, ctypes.cast(ctypes.pointer(m4), vp), 0, 0)
            props = _Properties2(_STRUCTURE_TYPE_PROPERTIES_2, ctypes.cast(ctypes.pointer(m3), vp))
            vk.vkGetPhysicalDeviceProperties2(handle, ctypes.byref(props))
            heaps = _MemoryProperties()
            vk.vkGetPhysicalDeviceMemoryProperties(handle, ctypes.byref(heaps))
            api_1_3 = props.properties.apiVersion >= ((1 << 22) | (3 << 12))
            out.append(limits_of(props.properties, int(m3.maxMemoryAllocationSize),
                                 int(m4.maxBufferSize) if api_1_3 and m4.maxBufferSize else None, heaps))
        return tuple(out)
    finally:
        vk.vkDestroyInstance(instance, None)


def match(devices: tuple[VulkanDevice, ...], description: str) -> VulkanDevice | None:
    """The physical device llama.cpp lists as `Vulkan<i>: <description>`: the first of that name (identical cards
    share their limits)."""
    return next((d for d in devices if d.name == description), None)
