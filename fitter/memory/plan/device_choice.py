"""Which devices a model uses and which layers go to each (src/llama.cpp `llama_model_load_from_file_impl`,
src/llama-model.cpp `llama_model_base::load_tensors`), and whether the scheduler pipelines across them."""

from __future__ import annotations

import bisect
import re

from fitter.errors import LaunchConfigError
from fitter.flags import LaunchConfig
from fitter.gguf.model_spec import ModelSpec
from fitter.memory.backends.devices import Device


def _device_list(devices: tuple[Device, ...]) -> str:
    return ", ".join(d.name for d in devices) or "none"


def named_device(name: str, devices: tuple[Device, ...]) -> Device | None:
    """The device `-dev` names: by its name, or an RPC server's device by ggml's name for it (`RPC<i>`: the i-th
    server's, which llama.cpp lists as `RPC<i>: HOST:PORT` and names its buffers `RPC0[HOST:PORT]` after)."""
    found = next((d for d in devices if d.name == name), None)
    rpc = re.fullmatch(r"RPC(\d+)", name)
    if found is None and rpc is not None:
        servers = [d for d in devices if d.profile.kind == "rpc"]
        found = servers[int(rpc.group(1))] if int(rpc.group(1)) < len(servers) else None
    return found


def default_devices(devices: tuple[Device, ...]) -> tuple[Device, ...]:
    """The devices llama.cpp gives a model unasked (src/llama.cpp `llama_model_load_from_file_impl`): RPC servers
    first ("to minimize network transfers"), then the GPUs, and integrated GPUs only when no discrete one is there.
    (A card that two backends of one build both list is kept once there, by its PCI id, which no listing shows:
    name one with -dev.)"""
    rpc = tuple(d for d in devices if d.profile.kind == "rpc")
    gpus = tuple(d for d in devices if d.profile.kind != "rpc" and not d.profile.integrated)
    igpus = tuple(d for d in devices if d.profile.kind != "rpc" and d.profile.integrated)
    return rpc + gpus + (igpus if not gpus else ())


def tensor_devices(devices: tuple[Device, ...]) -> tuple[Device, ...]:
    """The devices -sm tensor gives the Meta device unasked (src/llama.cpp `llama_prepare_model_devices`): every
    registered device whose buffer type is not the CPU's, in registry order, integrated GPUs included and nothing
    deduplicated; RPC servers register after the local backends (common/arg.cpp --rpc), so they come last."""
    return (tuple(d for d in devices if d.profile.kind != "rpc")
            + tuple(d for d in devices if d.profile.kind == "rpc"))


def model_devices(config: LaunchConfig, devices: tuple[Device, ...]) -> tuple[Device, ...]:
    """The devices the model uses: those -dev names, in its order (`none`: none), else llama.cpp's default choice
    (`default_devices`; `tensor_devices` with -sm tensor); of them all with -sm layer and tensor, with -sm none
    only -mg's ("if using single GPU mode, remove all except the main GPU"; a negative -mg removes them all). -ts
    and -mg are checked against the devices here: llama.cpp reads only the first n_devices values of -ts and
    silently drops the rest."""
    if config.device_names == ("none",):
        devices = ()
    elif config.device_names:
        chosen = []
        for name in config.device_names:
            dev = named_device(name, devices)
            if dev is None:  # common/arg.cpp parse_device_list: "invalid device"
                raise LaunchConfigError(f"-dev {','.join(config.device_names)}: llama.cpp has no device {name!r} "
                                        f"here (invalid device); the devices are {_device_list(devices)}")
            chosen.append(dev)
        devices = tuple(chosen)
    elif config.split_mode == "tensor":
        devices = tensor_devices(devices)
    else:
        devices = default_devices(devices)
    if not devices:
        return devices
    if len(config.tensor_split) > len(devices):
        raise LaunchConfigError(
            f"-ts {','.join(f'{x:g}' for x in config.tensor_split)}: {len(config.tensor_split)} values for "
            f"{len(devices)} device(s) ({_device_list(devices)}); give one value per device")
    if config.split_mode == "row":
        # CUDA's split buffer type (ggml_backend_split_buffer_type, RPC has none), which llama.cpp 0c1e570 still has
        raise LaunchConfigError(
            "-sm row: fitter's estimator models -sm layer, tensor and none only (llama.cpp's row split spreads "
            "each matrix over CUDA's split buffer type); use -sm layer or tensor")
    if config.split_mode != "none":
        return devices
    if config.main_gpu < 0:
        return ()
    if config.main_gpu >= len(devices):
        raise LaunchConfigError(
            f"-mg {config.main_gpu}: invalid value for main_gpu with -sm none: {len(devices)} device(s) "
            f"({_device_list(devices)}), numbered from 0")
    return (devices[config.main_gpu],)


def pipeline_parallel(spec: ModelSpec, config: LaunchConfig, devices: tuple[Device, ...]) -> bool:
    """src/llama-context.cpp `llama_context::llama_context`: the scheduler pipelines (and keeps 4 copies of its
    inputs) with several devices, every layer and the output offloaded (`n_gpu_layers() > n_layer`), -sm layer,
    the KV offloaded and no tensor override (-ot, -cmoe, -ncmoe); every device must offer async compute and events,
    which CUDA and RPC (ggml-rpc.cpp `ggml_backend_rpc_device_get_props`) both do at 0c1e570."""
    every_layer = config.n_gpu_layers < 0 or config.n_gpu_layers > spec.n_layer
    return (len(devices) > 1 and every_layer and config.split_mode == "layer" and not config.no_kv_offload
            and not config.overrides)


def layer_devices(spec: ModelSpec, config: LaunchConfig, devices: tuple[Device, ...]) -> tuple[Device | None, ...]:
    """Device of each layer 0..n_layer (index n_layer is the output layer); None = CPU."""
    n_layer = spec.n_layer
    if not devices:
        return (None,) * (n_layer + 1)
    # llama_model::n_gpu_layers: a negative count (auto, all) means every layer, the output layer included.
    n_gpu = config.n_gpu_layers if config.n_gpu_layers >= 0 else n_layer + 1
    i_gpu_start = max(n_layer + 1 - n_gpu, 0)
    act_gpu_layers = min(n_gpu, n_layer + 1)
    weights = list(config.tensor_split[: len(devices)]) if any(config.tensor_split) else [
        float(d.free_bytes or d.total_bytes or 1) for d in devices
    ]
    weights += [0.0] * (len(devices) - len(weights))
    splits, acc = [], 0.0
    for w in weights:
        acc += w
        splits.append(acc)
    splits = [s / acc for s in splits]
    out: list[Device | None] = []
    for il in range(n_layer + 1):
        if il < i_gpu_start or il - i_gpu_start >= act_gpu_layers:
            out.append(None)
            continue
        k = bisect.bisect_right(splits, (il - i_gpu_start) / act_gpu_layers)
        out.append(devices[min(k, len(devices) - 1)])
    return tuple(out)
