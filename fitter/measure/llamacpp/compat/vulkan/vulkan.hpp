// fitter's compatibility shim for building llama.cpp 0c1e570's Vulkan backend against older Vulkan headers.
//
// ggml/src/ggml-vulkan/ggml-vulkan.cpp (`ggml_vk_instance_init`) always chains a vk::LayerSettingsCreateInfoEXT
// (VK_EXT_layer_settings, Vulkan-Headers 1.3.272 and later) into its instance create info; Debian 12's headers
// (1.3.239) predate it, and the file fails to compile. fitter's Vulkan build puts this folder first on the include
// path (fitter/measure/llamacpp/tools.py): the real <vulkan/vulkan.hpp> is included as it is, and only where it lacks
// the extension are its two structures and its enum declared, with the layout and values of the Vulkan registry
// (vk.xml: VkLayerSettingEXT, VkLayerSettingsCreateInfoEXT, VK_STRUCTURE_TYPE_LAYER_SETTINGS_CREATE_INFO_EXT =
// 1000496000), so the instance is created as with newer headers. The vendored llama.cpp stays untouched: the build
// reports its commit, clean.
#pragma once
#include_next <vulkan/vulkan.hpp>

#ifndef VK_EXT_layer_settings
#define VK_EXT_layer_settings 1
#define VK_EXT_LAYER_SETTINGS_EXTENSION_NAME "VK_EXT_layer_settings"

typedef enum VkLayerSettingTypeEXT {
    VK_LAYER_SETTING_TYPE_BOOL32_EXT = 0,
    VK_LAYER_SETTING_TYPE_INT32_EXT = 1,
    VK_LAYER_SETTING_TYPE_INT64_EXT = 2,
    VK_LAYER_SETTING_TYPE_UINT32_EXT = 3,
    VK_LAYER_SETTING_TYPE_UINT64_EXT = 4,
    VK_LAYER_SETTING_TYPE_FLOAT32_EXT = 5,
    VK_LAYER_SETTING_TYPE_FLOAT64_EXT = 6,
    VK_LAYER_SETTING_TYPE_STRING_EXT = 7,
    VK_LAYER_SETTING_TYPE_MAX_ENUM_EXT = 0x7FFFFFFF
} VkLayerSettingTypeEXT;

typedef struct VkLayerSettingEXT {
    const char * pLayerName;
    const char * pSettingName;
    VkLayerSettingTypeEXT type;
    uint32_t valueCount;
    const void * pValues;
} VkLayerSettingEXT;

typedef struct VkLayerSettingsCreateInfoEXT {
    VkStructureType sType;
    const void * pNext;
    uint32_t settingCount;
    const VkLayerSettingEXT * pSettings;
} VkLayerSettingsCreateInfoEXT;

namespace VULKAN_HPP_NAMESPACE {
enum class LayerSettingTypeEXT {
    eBool32 = VK_LAYER_SETTING_TYPE_BOOL32_EXT,
    eInt32 = VK_LAYER_SETTING_TYPE_INT32_EXT,
    eInt64 = VK_LAYER_SETTING_TYPE_INT64_EXT,
    eUint32 = VK_LAYER_SETTING_TYPE_UINT32_EXT,
    eUint64 = VK_LAYER_SETTING_TYPE_UINT64_EXT,
    eFloat32 = VK_LAYER_SETTING_TYPE_FLOAT32_EXT,
    eFloat64 = VK_LAYER_SETTING_TYPE_FLOAT64_EXT,
    eString = VK_LAYER_SETTING_TYPE_STRING_EXT,
};

struct LayerSettingEXT {
    const char * pLayerName = nullptr;
    const char * pSettingName = nullptr;
    LayerSettingTypeEXT type = LayerSettingTypeEXT::eBool32;
    uint32_t valueCount = 0;
    const void * pValues = nullptr;
};
static_assert(sizeof(LayerSettingEXT) == sizeof(VkLayerSettingEXT), "layout of VkLayerSettingEXT");

struct LayerSettingsCreateInfoEXT {
    StructureType sType = static_cast<StructureType>(1000496000);  // VK_STRUCTURE_TYPE_LAYER_SETTINGS_CREATE_INFO_EXT
    const void * pNext = nullptr;
    uint32_t settingCount = 0;
    const LayerSettingEXT * pSettings = nullptr;

    LayerSettingsCreateInfoEXT(const std::vector<LayerSettingEXT> & settings)
        : settingCount(static_cast<uint32_t>(settings.size())), pSettings(settings.data()) {}
};
static_assert(sizeof(LayerSettingsCreateInfoEXT) == sizeof(VkLayerSettingsCreateInfoEXT),
              "layout of VkLayerSettingsCreateInfoEXT");
}  // namespace VULKAN_HPP_NAMESPACE
#endif
