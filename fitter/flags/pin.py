"""The one writer of a LaunchConfig as llama-server flags: pinned for a launcher, or as it was given.

Pinned (CONTRACTS.md export rules): everything llama-server would otherwise decide itself is written — `-np`,
`--kv-unified`/`--no-kv-unified`, `-fa on|off`, `-fit off` (the placement is explicit), `-c`, `-ngl`,
`-ncmoe`/`-ot`, `-b`, `-ub`, `-ctk`, `-ctv`, `-t`, `-tb`. As given (`given=True`): only the fields a flag set
(LaunchConfig.given), so the program's own defaults still fill the rest; a trial's, a measurement's and a
llama-server run's flags are these. Either list reads back (fitter.flags.parse) as the same config. Pure functions:
argv lists, tested as lists.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable, Collection

from fitter.flags.config import DRAFT_FIELDS, ContextParams, LaunchConfig, ProcessFlags
from fitter.flags.overrides import override_flags


def _layers(n: int) -> str:
    """-ngl's value as llama.cpp reads it back: -1 auto, <= -2 all (common/arg.cpp)."""
    return "auto" if n == -1 else "all" if n < -1 else str(n)


def _proportion(x: float) -> str:
    short = f"{x:g}"
    return short if float(short) == x else repr(x)  # a proportion such as 1/3 reads back exactly


def _draft_overrides(config: LaunchConfig) -> list[str]:
    """The draft's rules as `-ncmoed N` and `-otd` (override_flags, with the draft's spellings)."""
    spelled = {"-ncmoe": "-ncmoed", "-ot": "-otd"}
    return [spelled.get(t, t) for t in override_flags(config.draft_overrides) or ["-ncmoe", "0"]]


def _switch(name: str, flag: str) -> Callable[[LaunchConfig], list[str]]:
    return lambda c: [flag] if getattr(c, name) else []


# One writer per field, in llama-server's order (the order pinned lists have always had)
WRITERS: tuple[tuple[str, Callable[[LaunchConfig], list[str]]], ...] = (
    ("ctx_size", lambda c: ["-c", str(c.ctx_size)]),
    ("batch_size", lambda c: ["-b", str(c.batch_size)]),
    ("ubatch_size", lambda c: ["-ub", str(c.ubatch_size)]),
    ("cache_type_k", lambda c: ["-ctk", c.cache_type_k]),
    ("cache_type_v", lambda c: ["-ctv", c.cache_type_v]),
    ("flash_attn", lambda c: ["-fa", c.flash_attn]),
    ("parallel", lambda c: ["-np", str(c.parallel)]),
    ("kv_unified", lambda c: [] if c.kv_unified is None else ["--kv-unified" if c.kv_unified else "--no-kv-unified"]),
    ("n_gpu_layers", lambda c: ["-ngl", _layers(c.n_gpu_layers)]),
    ("overrides", lambda c: override_flags(c.overrides) or ["-ncmoe", "0"]),  # given, and no rule: `-ncmoe 0`
    ("swa_full", _switch("swa_full", "--swa-full")),
    ("no_kv_offload", lambda c: ["-nkvo" if c.no_kv_offload else "-kvo"]),
    ("cache_ram_mib", lambda c: ["-cram", str(c.cache_ram_mib)]),
    ("no_op_offload", _switch("no_op_offload", "--no-op-offload")),
    ("no_repack", _switch("no_repack", "-nr")),
    ("load_mode", lambda c: ["-lm", c.load_mode]),
    ("tensor_split", lambda c: ["-ts", ",".join(map(_proportion, c.tensor_split))] if c.tensor_split else []),
    ("split_mode", lambda c: ["-sm", c.split_mode]),
    ("main_gpu", lambda c: ["-mg", str(c.main_gpu)]),
    ("rpc", lambda c: ["--rpc", ",".join(c.rpc)] if c.rpc else []),
    ("device_names", lambda c: ["-dev", ",".join(c.device_names)] if c.device_names else []),
    ("draft_model", lambda c: ["-md", c.draft_model] if c.draft_model else []),
    ("draft_n_gpu_layers", lambda c: ["-ngld", _layers(c.draft_n_gpu_layers)]),
    ("draft_overrides", _draft_overrides),
    ("draft_cache_type_k", lambda c: ["-ctkd", c.draft_cache_type_k]),
    ("draft_cache_type_v", lambda c: ["-ctvd", c.draft_cache_type_v]),
    ("spec_type", lambda c: ["--spec-type", c.spec_type]),
    ("spec_draft_n_max", lambda c: ["--spec-draft-n-max", str(c.spec_draft_n_max)]),
    ("spec_draft_n_min", lambda c: ["--spec-draft-n-min", str(c.spec_draft_n_min)]),
    ("mmproj", lambda c: ["-mm", c.mmproj] if c.mmproj else []),
    ("mmproj_device", lambda c: ["--no-mmproj-offload"] if c.mmproj_device == "none"
     else ["-mmdev", c.mmproj_device] if c.mmproj_device else []),
    ("fit", lambda c: ["-fit", "on" if c.fit else "off"]),
)
# Written pinned only away from llama-server's default (a default here is what llama-server does unasked)
_PINNED_IF_SET = ("overrides", "draft_overrides", "load_mode", "split_mode", "main_gpu", "device_names",
                  "cache_ram_mib", "no_kv_offload")
_PLACEMENT = ("n_gpu_layers", "overrides", "swa_full", "no_kv_offload", "no_op_offload", "no_repack", "load_mode",
              "tensor_split", "split_mode", "main_gpu", "device_names")


def pin(config: LaunchConfig, context: ContextParams | None = None, process: ProcessFlags | None = None, *,
        given: bool = False) -> list[str]:
    """The llama-server flags of `config`, in llama-server's order, then `process`'s -t/-tb/-C/-Cr.

    Pinned (the default): every setting written. With the model's resolved context (`resolve_context`, a memory
    plan's `context`) the context size, batch sizes, slots, KV unification and flash attention are what llama.cpp
    will use (`-c 0` becomes the training context, `-fa auto` on or off); without it they are the config's own, as a
    list of already pinned flags reads back. `given`: only the fields a flag set, each as given (`-ngl auto`)."""
    if given:
        flags = _written(config, config.given)
    else:
        view, fields = _pinned(config, context)
        flags = _written(view, fields)
    return flags + (process.flags() if process is not None else [])


def _written(config: LaunchConfig, fields: Collection[str]) -> list[str]:
    return [token for name, write in WRITERS if name in fields for token in write(config)]


def _pinned(config: LaunchConfig, context: ContextParams | None) -> tuple[LaunchConfig, set[str]]:
    """The config as a launcher must pass it (every layer count explicit, unification and slots resolved, no fit),
    and the fields to write."""
    changes: dict[str, object] = {
        "parallel": config.n_seq_max, "kv_unified": config.unified, "fit": False,
        "n_gpu_layers": -2 if config.n_gpu_layers < 0 else config.n_gpu_layers,
        "draft_n_gpu_layers": -2 if config.draft_n_gpu_layers < 0 else config.draft_n_gpu_layers}
    if context is not None:
        changes.update(ctx_size=context.n_ctx, batch_size=context.n_batch, ubatch_size=context.n_ubatch,
                       flash_attn="on" if context.flash_attn else "off", parallel=context.n_seq_max,
                       kv_unified=context.n_stream == 1)
    view = dataclasses.replace(config, **changes)  # type: ignore[arg-type]
    defaults = LaunchConfig()
    fields = {name for name, _ in WRITERS
              if name not in _PINNED_IF_SET or getattr(view, name) != getattr(defaults, name)}
    if not config.mmproj:
        fields -= {"mmproj", "mmproj_device"}
    if not config.draft_model:
        fields -= {"draft_model", *DRAFT_FIELDS}
    elif config.spec_type == "none":
        fields -= {"spec_draft_n_max", "spec_draft_n_min"}
    return view, fields


def placement_flags(config: LaunchConfig) -> list[str]:
    """-ngl, -ncmoe/-ot and the switches that change where buffers go or how they load, pinned."""
    view, fields = _pinned(config, None)
    return _written(view, fields & set(_PLACEMENT))


def server_command(model_path: str, flags: list[str]) -> str:
    """One shell-quoted llama-server line."""
    return shlex.join(["llama-server", "-m", model_path, *flags])
