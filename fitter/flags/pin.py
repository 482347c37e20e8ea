"""Launch flags as a launcher should pass them: everything llama-server would otherwise decide itself is pinned.

CONTRACTS.md export rules: `-np`, `--kv-unified`/`--no-kv-unified`, `-fa on|off`, `-fit off` when placement is
explicit, `-c`, `-ngl`, `-ncmoe`/`-ot`, `-b`, `-ub`, `-ctk`, `-ctv`, `-t`, `-tb`. Pure functions: argv lists,
tested as lists. The one writer of a LaunchConfig as llama-server flags.
"""

from __future__ import annotations

import shlex

from fitter.flags.config import ContextParams, LaunchConfig, ProcessFlags
from fitter.flags.draft import draft_flags
from fitter.flags.overrides import override_flags


def pin(config: LaunchConfig, context: ContextParams | None = None, process: ProcessFlags | None = None) -> list[str]:
    """The llama-server flags that reproduce `config` exactly, in llama-server's order.

    With the model's resolved context (`resolve_context`, a memory plan's `context`) the context size, batch sizes,
    slots, KV unification and flash attention are what llama.cpp will use (`-c 0` becomes the training context,
    `-fa auto` on or off); without it they are the config's own, as a list of already pinned flags reads back."""
    if context is not None:
        c, b, ub = context.n_ctx, context.n_batch, context.n_ubatch
        fa, slots, unified = "on" if context.flash_attn else "off", context.n_seq_max, context.n_stream == 1
    else:
        c, b, ub = config.ctx_size, config.batch_size, config.ubatch_size
        fa, slots, unified = config.flash_attn, config.n_seq_max, config.unified
    flags = ["-c", str(c), "-b", str(b), "-ub", str(ub), "-ctk", config.cache_type_k, "-ctv", config.cache_type_v,
             "-fa", fa, "-np", str(slots), "--kv-unified" if unified else "--no-kv-unified"]
    flags += placement_flags(config)
    if config.rpc:
        flags += ["--rpc", ",".join(config.rpc)]
    flags += draft_flags(config)
    flags += ["-fit", "off"]  # the placement is explicit: llama-server's --fit must not second-guess it
    return flags + (process.flags() if process is not None else [])


def placement_flags(config: LaunchConfig) -> list[str]:
    """-ngl, -ncmoe/-ot and the switches that change where buffers go or how they load, as llama-server spells them."""
    flags = ["-ngl", "all" if config.n_gpu_layers < 0 else str(config.n_gpu_layers), *override_flags(config.overrides)]
    switches = [(config.swa_full, "--swa-full"), (config.no_kv_offload, "-nkvo"),
                (config.no_op_offload, "--no-op-offload"), (config.no_repack, "-nr")]
    flags += [flag for on, flag in switches if on]
    if config.load_mode != "auto":
        flags += ["-lm", config.load_mode]
    if config.tensor_split:
        flags += ["-ts", ",".join(f"{x:g}" for x in config.tensor_split)]
    if config.split_mode != "layer":
        flags += ["-sm", config.split_mode]
    if config.main_gpu:
        flags += ["-mg", str(config.main_gpu)]
    return flags


def server_command(model_path: str, flags: list[str]) -> str:
    """One shell-quoted llama-server line."""
    return shlex.join(["llama-server", "-m", model_path, *flags])
