"""Launch flags as a launcher should pass them: everything llama-server would otherwise decide itself is pinned.

CONTRACTS.md export rules: `-np`, `--kv-unified`/`--no-kv-unified`, `-fa on|off`, `-fit off` when placement is
explicit, `-c`, `-ngl`, `-ncmoe`/`-ot`, `-b`, `-ub`, `-ctk`, `-ctv` (and `-t`/`-tb` once fitter measures them).
Pure functions: argv lists, tested as lists.
"""

from __future__ import annotations

import re
import shlex

from fitter.launch_config import FFN_EXPS_REGEX, ContextParams, LaunchConfig, TensorOverride

_NCMOE_RE = re.compile(r"^blk\\\.(\d+)" + re.escape(FFN_EXPS_REGEX) + "$")


def split_ncmoe(overrides: tuple[TensorOverride, ...]) -> tuple[int, list[TensorOverride]]:
    """Recognise the rules `-ncmoe N` adds (layers 0…N-1, in order, first) so they print as `-ncmoe N` again."""
    n = 0
    while n < len(overrides):
        m = _NCMOE_RE.match(overrides[n].pattern)
        if m is None or int(m.group(1)) != n or overrides[n].buft != "CPU":
            break
        n += 1
    return n, list(overrides[n:])


def server_flags(config: LaunchConfig, ctx: ContextParams, rpc: tuple[str, ...] = ()) -> list[str]:
    """The llama-server flags that reproduce this configuration exactly."""
    flags = ["-c", str(ctx.n_ctx), "-b", str(ctx.n_batch), "-ub", str(ctx.n_ubatch)]
    flags += ["-ctk", config.cache_type_k, "-ctv", config.cache_type_v, "-fa", "on" if ctx.flash_attn else "off"]
    flags += ["-np", str(ctx.n_seq_max), "--kv-unified" if ctx.n_stream == 1 else "--no-kv-unified"]
    flags += placement_flags(config)
    if rpc:
        flags += ["--rpc", ",".join(rpc)]
    flags += ["-fit", "off"]  # the placement is explicit: llama-server's --fit must not second-guess it
    return flags


def placement_flags(config: LaunchConfig) -> list[str]:
    """-ngl, -ncmoe/-ot and the switches that change where buffers go or how they load, as llama-server spells them."""
    flags = ["-ngl", "all" if config.n_gpu_layers < 0 else str(config.n_gpu_layers)]
    n_cpu_moe, rules = split_ncmoe(config.overrides)
    if n_cpu_moe:
        flags += ["-ncmoe", str(n_cpu_moe)]
    if rules:
        flags += ["-ot", ",".join(f"{r.pattern}={r.buft}" for r in rules)]
    switches = [(config.swa_full, "--swa-full"), (config.no_kv_offload, "-nkvo"),
                (config.no_op_offload, "--no-op-offload"), (config.no_repack, "-nr")]
    flags += [flag for on, flag in switches if on]
    if config.load_mode != "auto":
        flags += ["-lm", config.load_mode]
    if config.tensor_split:
        flags += ["-ts", ",".join(f"{x:g}" for x in config.tensor_split)]
    if config.main_gpu:
        flags += ["-mg", str(config.main_gpu)]
    return flags


def server_command(model_path: str, flags: list[str]) -> str:
    """One shell-quoted llama-server line."""
    return shlex.join(["llama-server", "-m", model_path, *flags])
