"""llama.cpp's launch flags: one vocabulary (`vocabulary.FLAGS`), the typed config they parse into, the context
llama.cpp derives from it, and the one writer back to flags (`pin`) and of tensor-override rules."""

from __future__ import annotations

from fitter.flags.config import (
    KV_CACHE_TYPES,
    SERVER_DEFAULTS_HELP,
    ContextParams,
    LaunchConfig,
    ProcessFlags,
    TensorOverride,
    parse_cpu_mask,
    resolve_context,
    validate,
)
from fitter.flags.overrides import FFN_EXPS_REGEX, ncmoe_rules, override_flags, split_ncmoe
from fitter.flags.parse import (
    add_launch_arguments,
    add_process_arguments,
    launch_config_from_args,
    parse_flags,
    parse_launch_flags,
    split_process_flags,
)
from fitter.flags.pin import pin, placement_flags, server_command

__all__ = [
    "FFN_EXPS_REGEX",
    "KV_CACHE_TYPES",
    "SERVER_DEFAULTS_HELP",
    "ContextParams",
    "LaunchConfig",
    "ProcessFlags",
    "TensorOverride",
    "add_launch_arguments",
    "add_process_arguments",
    "launch_config_from_args",
    "ncmoe_rules",
    "override_flags",
    "parse_cpu_mask",
    "parse_flags",
    "parse_launch_flags",
    "pin",
    "placement_flags",
    "resolve_context",
    "server_command",
    "split_ncmoe",
    "split_process_flags",
    "validate",
]
