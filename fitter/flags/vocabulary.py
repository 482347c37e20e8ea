"""llama.cpp's flags as fitter knows them: one table, and every lookup the rest of fitter needs derived from it.

Spellings, value or bare, and defaults are llama-server's at 0c1e570 (common/arg.cpp `common_params_parser_init`
for LLAMA_EXAMPLE_SERVER, tools/server/server.cpp for `-np` auto); the `--models-preset` INI keys are what
common/preset.cpp `common_preset::to_ini` writes (an option's last spelling without dashes; a flag with a negative
form is one key whose value is true or false). Derived here: the argparse options (fitter.flags.parse), the
process-level flags (threads and affinity, which a LaunchConfig leaves to the process), the model-level fields
(a change reloads the model, llama-bench's `cmd_params_instance::equal_mparams`), the flags that fix a search-space
key, the flags llama-fit-params reads differently (fitter.measure.llamacpp.fit_params), the preset keys (fitter.export)
and the searched part of a trial's flags that tables show.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from fitter.flags.config import KV_CACHE_TYPES, LOAD_MODES, SPLIT_MODES

# common/common.cpp is_truthy / is_falsey / is_autoy
_TRUTHY = ("on", "enabled", "true", "1")
_FALSEY = ("off", "disabled", "false", "0")
_AUTOY = ("auto", "-1")


class Kind(Enum):
    VALUE = "value"  # takes a value: `-c 4096`
    SWITCH = "switch"  # bare, sets its field true: `--swa-full`
    NEGATION = "negation"  # bare, sets the field of another spelling false: `--no-kv-unified`
    CONST = "const"  # bare, an older spelling of another flag's value: `--no-mmap` = `-lm none`
    RULE = "rule"  # takes a value that adds tensor-override rules, in command-line order: `-ot`, `-ncmoe`
    RULE_SWITCH = "rule-switch"  # bare, adds a tensor-override rule: `-cmoe`


class Level(Enum):
    CONTEXT = "context"  # llama_context_params: the loaded model is reused when only these change
    MODEL = "model"  # llama_model_params (and the RPC servers): a change reloads the model
    PROCESS = "process"  # threads and CPU affinity: the process's, not a LaunchConfig's
    FIT = "fit"  # inputs of llama.cpp's own fit (common/fit.cpp); fitter's --fit-target/--fit-ctx carry them
    MODEL_PATH = "model-path"  # -m: fitter takes the model as its positional argument


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # llama-server's spellings, the one fitter writes first
    field: str  # the LaunchConfig (or ProcessFlags) field it sets; "overrides" for every RULE flag
    kind: Kind
    level: Level
    space_key: str | None = None  # the search-space key (llama.cpp's long name without dashes)
    fixes: tuple[str, ...] = ()  # search-space keys this flag fixes besides its own (`-cmoe` fixes n-cpu-moe)
    preset_key: str | None = None
    preset_value: str | None = None  # what a bare flag writes under its preset key ("true" / "false")
    const: str | None = None  # CONST: the value it stands for
    parse: Callable[[str], Any] | None = None  # a VALUE's parser (argparse type), as llama.cpp reads the value
    metavar: str | None = None
    help: str | None = None
    choices: tuple[str, ...] | None = None
    merge: Callable[[Any, Any], Any] | None = None  # a repeated flag's values combine (else the last one wins)

    @property
    def canonical(self) -> str:
        return self.names[0]

    @property
    def takes_value(self) -> bool:
        return self.kind in (Kind.VALUE, Kind.RULE)


def _legacy_load(switch: str, on: bool) -> Callable[[str, Any], str]:
    """An older llama.cpp's load switch (--mmap/--no-mmap, --mlock, --direct-io: common/arg.cpp before the -lm
    refactor, ggml-org/llama.cpp#20834) applied to the load mode so far: those were independent booleans
    (use_mmap on by default, use_mlock, use_direct_io), so `--no-mmap --mlock` in either order is -lm mlock and
    `--mlock` alone -lm mmap+mlock; direct I/O reads without mapping whatever the others say."""

    def merge(current: str, _: Any) -> str:
        if current == "dio" or (switch == "dio" and on):
            return "dio"
        mmap = current in ("auto", "mmap", "mmap+mlock")
        mlock = current in ("mlock", "mmap+mlock")
        mmap, mlock = (on, mlock) if switch == "mmap" else (mmap, on)
        return {(True, True): "mmap+mlock", (False, True): "mlock", (True, False): "mmap",
                (False, False): "none"}[(mmap, mlock)]

    return merge


def _cache_ram(value: str) -> int:
    try:
        mib = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MiB (-1 no limit, 0 none), got {value!r}") from None
    if mib < -1:
        raise argparse.ArgumentTypeError(f"expected MiB (-1 no limit, 0 none), got {value!r}")
    return mib


def _offload_off(value: str) -> bool:
    """The search key kv-offload's value as -nkvo's field: kv-offload false is --no-kv-offload."""
    return not _on_off(value)


def _ngl(value: str) -> int:
    if value == "auto":
        return -1
    if value == "all":
        return -2
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, 'auto' or 'all', got {value!r}") from None


def _on_off_auto(value: str) -> str:
    v = value.lower()
    if v in _TRUTHY:
        return "on"
    if v in _FALSEY:
        return "off"
    if v in _AUTOY:
        return "auto"
    raise argparse.ArgumentTypeError(f"expected on, off or auto, got {value!r}")


def _on_off(value: str) -> bool:
    v = value.lower()
    if v in _TRUTHY:
        return True
    if v in _FALSEY:
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")


def _cache_type(value: str) -> str:
    if value not in KV_CACHE_TYPES:
        raise argparse.ArgumentTypeError(f"unsupported cache type {value!r}; allowed: {', '.join(KV_CACHE_TYPES)}")
    return value


def _split(value: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in re.split(r"[,/]+", value) if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected proportions like 3,1, got {value!r}") from None


def _endpoints(value: str) -> tuple[str, ...]:
    return tuple(x for x in value.split(",") if x)


def _device_list(value: str) -> tuple[str, ...]:
    """-dev as common/arg.cpp parse_device_list reads it: a comma list of device names, or `none` alone."""
    names = tuple(x for x in value.split(","))
    if not value or any(not n for n in names):
        raise argparse.ArgumentTypeError(f"expected device names like Vulkan0,Vulkan1 or none, got {value!r}")
    if "none" in names and names != ("none",):
        raise argparse.ArgumentTypeError(f"{value!r}: none stands alone (llama.cpp: invalid device: none)")
    return names


def _mmproj_device(value: str) -> str:
    """-mmdev as common/arg.cpp reads it: `none` (the CPU), else one device (parse_device_list, "only one device may
    be specified for mmproj")."""
    names = _device_list(value)
    if len(names) > 1:
        raise argparse.ArgumentTypeError(f"{value!r}: only one device may be specified for mmproj")
    return names[0]


def _mmproj_offload(on: bool) -> Callable[[str, Any], str]:
    """--mmproj-offload / --no-mmproj-offload after -mmdev (common/arg.cpp: the handlers run in order, the last one
    sets mmproj_use_gpu): off puts the projector on the CPU; on undoes that (the device -mmdev named before an off is
    not remembered here: name it again after)."""

    def merge(current: str, _: Any) -> str:
        return ("" if current == "none" else current) if on else "none"

    return merge


def _spec_type(value: str) -> str:
    """One --spec-type value as common/speculative.cpp `common_speculative_types_from_names` reads its comma list: in
    order, `none` ends it as none alone, an unknown name is an error; of the types it names, fitter models
    draft-simple (what the others allocate is refused)."""
    from fitter.flags.draft import OTHER_SPEC_TYPES

    found = "none"
    for name in value.split(","):
        if name == "none":
            return "none"
        if name in OTHER_SPEC_TYPES:
            raise argparse.ArgumentTypeError(
                f"{name!r}: fitter models a draft model's speculation (draft-simple) only; what {name} allocates (an "
                "MTP, EAGLE3 or DFlash context, an n-gram cache) is not in its estimate")
        if name != "draft-simple":
            raise argparse.ArgumentTypeError(f"unknown speculative type: {name!r} (common/speculative.cpp); fitter "
                                             "reads none and draft-simple")
        found = name
    return found


def _any_draft_simple(old: str, new: str) -> str:
    """Two --spec-type flags: common/arg.cpp appends each one's types to the list, so draft-simple in either is on."""
    return "draft-simple" if "draft-simple" in (old, new) else "none"


_C, _M, _P = Level.CONTEXT, Level.MODEL, Level.PROCESS
FLAGS: tuple[Flag, ...] = (
    Flag(("-c", "--ctx-size"), "ctx_size", Kind.VALUE, _C, preset_key="ctx-size", parse=int, metavar="N",
         help="context size (default 0 = the model's training context)"),
    Flag(("-b", "--batch-size"), "batch_size", Kind.VALUE, _C, "batch-size", preset_key="batch-size", parse=int,
         metavar="N"),
    Flag(("-ub", "--ubatch-size"), "ubatch_size", Kind.VALUE, _C, "ubatch-size", preset_key="ubatch-size",
         parse=int, metavar="N"),
    Flag(("-ctk", "--cache-type-k"), "cache_type_k", Kind.VALUE, _C, "cache-type-k", preset_key="cache-type-k",
         parse=_cache_type, metavar="TYPE", help=f"K cache type: {', '.join(KV_CACHE_TYPES)}"),
    Flag(("-ctv", "--cache-type-v"), "cache_type_v", Kind.VALUE, _C, "cache-type-v", preset_key="cache-type-v",
         parse=_cache_type, metavar="TYPE", help="V cache type (quantized V needs flash attention)"),
    Flag(("-fa", "--flash-attn"), "flash_attn", Kind.VALUE, _C, "flash-attn", preset_key="flash-attn",
         parse=_on_off_auto, metavar="on|off|auto"),
    Flag(("-ngl", "--gpu-layers", "--n-gpu-layers"), "n_gpu_layers", Kind.VALUE, _M, "n-gpu-layers",
         preset_key="n-gpu-layers", parse=_ngl, metavar="N|auto|all",
         help="layers on the GPU, counted from the last one (default auto)"),
    Flag(("-cmoe", "--cpu-moe"), "overrides", Kind.RULE_SWITCH, _M, fixes=("n-cpu-moe",), preset_key="cpu-moe",
         preset_value="true", help="keep every layer's expert tensors on the CPU"),
    Flag(("-ncmoe", "--n-cpu-moe"), "overrides", Kind.RULE, _M, "n-cpu-moe", preset_key="n-cpu-moe", metavar="N",
         help="keep the expert tensors of the first N layers on the CPU"),
    Flag(("-ot", "--override-tensor"), "overrides", Kind.RULE, _M, preset_key="override-tensor",
         metavar="PATTERN=BUFT[,...]", help="buffer type per tensor-name regex; the first match wins"),
    Flag(("-np", "--parallel"), "parallel", Kind.VALUE, _C, preset_key="parallel", parse=int, metavar="N",
         help="server slots (default auto: 4 slots, unified KV)"),
    Flag(("-kvu", "--kv-unified"), "kv_unified", Kind.SWITCH, _C, preset_key="kv-unified", preset_value="true"),
    Flag(("-no-kvu", "--no-kv-unified"), "kv_unified", Kind.NEGATION, _C, preset_key="kv-unified",
         preset_value="false"),
    Flag(("--swa-full",), "swa_full", Kind.SWITCH, _C, preset_key="swa-full", preset_value="true",
         help="full-size SWA cache"),
    Flag(("-nkvo", "--no-kv-offload"), "no_kv_offload", Kind.SWITCH, _C, fixes=("kv-offload",),
         preset_key="kv-offload", preset_value="false", help="KV cache and attention in host memory"),
    Flag(("-kvo", "--kv-offload"), "no_kv_offload", Kind.NEGATION, _C, "kv-offload", preset_key="kv-offload",
         preset_value="true", parse=_offload_off),
    Flag(("-cram", "--cache-ram"), "cache_ram_mib", Kind.VALUE, _C, preset_key="cache-ram", parse=_cache_ram,
         metavar="MiB", help="llama-server's prompt cache in host RAM (default 8192; -1 no limit; 0 none)"),
    Flag(("--no-op-offload",), "no_op_offload", Kind.SWITCH, _C, preset_key="op-offload", preset_value="false"),
    Flag(("-nr", "--no-repack"), "no_repack", Kind.SWITCH, _M, preset_key="repack", preset_value="false"),
    Flag(("-lm", "--load-mode"), "load_mode", Kind.VALUE, _M, "load-mode", preset_key="load-mode", choices=LOAD_MODES,
         help="how weights are loaded (default auto = mmap)"),
    Flag(("--no-mmap",), "load_mode", Kind.CONST, _M, merge=_legacy_load("mmap", False),
         help="older llama.cpp spelling: -lm none (with --mlock: -lm mlock)"),
    Flag(("--mmap",), "load_mode", Kind.CONST, _M, merge=_legacy_load("mmap", True),
         help="older llama.cpp spelling: -lm mmap"),
    Flag(("--mlock",), "load_mode", Kind.CONST, _M, merge=_legacy_load("mlock", True),
         help="older llama.cpp spelling: -lm mmap+mlock (with --no-mmap: -lm mlock)"),
    Flag(("-dio", "--direct-io"), "load_mode", Kind.CONST, _M, merge=_legacy_load("dio", True),
         help="older llama.cpp spelling: -lm dio"),
    Flag(("-fit", "--fit"), "fit", Kind.VALUE, _C, preset_key="fit", parse=_on_off, metavar="on|off"),
    Flag(("-ts", "--tensor-split"), "tensor_split", Kind.VALUE, _M, preset_key="tensor-split", parse=_split,
         metavar="N0,N1,..."),
    Flag(("-mg", "--main-gpu"), "main_gpu", Kind.VALUE, _M, preset_key="main-gpu", parse=int, metavar="INDEX",
         help="the GPU that holds everything with -sm none"),
    Flag(("-sm", "--split-mode"), "split_mode", Kind.VALUE, _M, "split-mode", preset_key="split-mode",
         choices=SPLIT_MODES, help="how layers spread over several GPUs (default layer; none: -mg's GPU only; "
         "tensor: every layer split over them)"),
    Flag(("--rpc",), "rpc", Kind.VALUE, _M, preset_key="rpc", parse=_endpoints, metavar="HOST:PORT[,...]"),
    Flag(("-dev", "--device"), "device_names", Kind.VALUE, _M, preset_key="device", parse=_device_list,
         metavar="DEV0,DEV1,...|none", help="the devices the model uses, as the build names them (default: its GPUs)"),
    Flag(("-t", "--threads"), "threads", Kind.VALUE, _P, "threads", preset_key="threads", parse=int, metavar="N"),
    Flag(("-tb", "--threads-batch"), "threads_batch", Kind.VALUE, _P, "threads-batch", preset_key="threads-batch",
         parse=int, metavar="N", help="threads for prefill (default: -t)"),
    Flag(("-C", "--cpu-mask"), "cpu_mask", Kind.VALUE, _P, preset_key="cpu-mask", metavar="M",
         help="CPU affinity mask (hex), as llama.cpp"),
    Flag(("-Cr", "--cpu-range"), "cpu_range", Kind.VALUE, _P, preset_key="cpu-range", metavar="lo-hi",
         help="CPU range, as llama.cpp"),
    # the draft model (fitter.flags.draft): llama-server's spellings, the short one first
    Flag(("-md", "--model-draft", "--spec-draft-model"), "draft_model", Kind.VALUE, _M, preset_key="model-draft",
         metavar="FNAME", help="draft model for speculative decoding (its memory is estimated beside the model's)"),
    Flag(("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", "--spec-draft-ngl"), "draft_n_gpu_layers",
         Kind.VALUE, _M, preset_key="n-gpu-layers-draft", parse=_ngl, metavar="N|auto|all",
         help="the draft's layers on the GPU (default auto: all)"),
    Flag(("-cmoed", "--cpu-moe-draft", "--spec-draft-cpu-moe"), "draft_overrides", Kind.RULE_SWITCH, _M,
         preset_key="cpu-moe-draft", preset_value="true", help="keep every draft layer's expert tensors on the CPU"),
    Flag(("-ncmoed", "--n-cpu-moe-draft", "--spec-draft-n-cpu-moe", "--spec-draft-ncmoe"), "draft_overrides",
         Kind.RULE, _M, preset_key="n-cpu-moe-draft", metavar="N",
         help="keep the expert tensors of the draft's first N layers on the CPU"),
    Flag(("-otd", "--override-tensor-draft", "--spec-draft-override-tensor"), "draft_overrides", Kind.RULE, _M,
         preset_key="override-tensor-draft", metavar="PATTERN=BUFT[,...]", help="the draft's tensor overrides"),
    Flag(("-ctkd", "--cache-type-k-draft", "--spec-draft-type-k"), "draft_cache_type_k", Kind.VALUE, _C,
         preset_key="cache-type-k-draft", parse=_cache_type, metavar="TYPE", help="the draft's K cache type"),
    Flag(("-ctvd", "--cache-type-v-draft", "--spec-draft-type-v"), "draft_cache_type_v", Kind.VALUE, _C,
         preset_key="cache-type-v-draft", parse=_cache_type, metavar="TYPE", help="the draft's V cache type"),
    Flag(("--spec-type",), "spec_type", Kind.VALUE, _C, preset_key="spec-type", parse=_spec_type,
         metavar="none|draft-simple", help="speculative decoding type (default none: -md loads the draft, and "
         "nothing drafts)", merge=_any_draft_simple),
    Flag(("--spec-draft-n-max",), "spec_draft_n_max", Kind.VALUE, _C, preset_key="spec-draft-n-max", parse=int,
         metavar="N", help="tokens to draft per step (default 3)"),
    Flag(("--spec-draft-n-min",), "spec_draft_n_min", Kind.VALUE, _C, preset_key="spec-draft-n-min", parse=int,
         metavar="N", help="fewest draft tokens to use (default 0)"),
    # the multimodal projector (fitter.memory.plan.mmproj): llama-server's spellings
    Flag(("-mm", "--mmproj"), "mmproj", Kind.VALUE, _M, preset_key="mmproj", metavar="FILE",
         help="multimodal projector file (its weights and compute buffers are estimated beside the model's)"),
    Flag(("-mmdev", "--mmproj-device"), "mmproj_device", Kind.VALUE, _M, preset_key="mmproj-device",
         parse=_mmproj_device, metavar="DEVICE|none", help="the projector's device (default: -dev's first, else "
         "the build's first GPU)"),
    Flag(("--no-mmproj-offload",), "mmproj_device", Kind.CONST, _M, preset_key="mmproj-offload", preset_value="false",
         merge=_mmproj_offload(False), help="the projector on the CPU"),
    Flag(("--mmproj-offload",), "mmproj_device", Kind.CONST, _M, preset_key="mmproj-offload", preset_value="true",
         merge=_mmproj_offload(True)),
    Flag(("-m", "--model"), "model", Kind.VALUE, Level.MODEL_PATH, preset_key="model"),
    Flag(("-fitt", "--fit-target"), "fit_target", Kind.VALUE, Level.FIT),
    Flag(("-fitc", "--fit-ctx"), "fit_ctx", Kind.VALUE, Level.FIT),
)

BY_NAME: dict[str, Flag] = {name: f for f in FLAGS for name in f.names}
BY_SPACE_KEY: dict[str, Flag] = {f.space_key: f for f in FLAGS if f.space_key}


def flag(name: str) -> Flag:
    """The table row of a spelling ("-ngl", "--n-gpu-layers", …)."""
    return BY_NAME[name]


def names_of(field: str) -> tuple[str, ...]:
    """Every spelling of every flag that sets `field`, e.g. "kv_unified" → -kvu … --no-kv-unified."""
    return tuple(name for f in FLAGS if f.field == field for name in f.names)


def launch_flags() -> tuple[Flag, ...]:
    """The flags a LaunchConfig holds (what the estimator and the runners read)."""
    return tuple(f for f in FLAGS if f.level in (Level.CONTEXT, Level.MODEL))


def process_flags() -> tuple[Flag, ...]:
    return tuple(f for f in FLAGS if f.level is Level.PROCESS)


# LaunchConfig fields whose change reloads the model (llama-bench's equal_mparams, plus --rpc: RPC devices stay
# registered for a process's life).
MODEL_LEVEL: tuple[str, ...] = tuple(dict.fromkeys(f.field for f in FLAGS if f.level is Level.MODEL))
BARE: frozenset[str] = frozenset(name for f in FLAGS if not f.takes_value for name in f.names)
# The searched part of a trial's flags, as tables show it (context, slots and --rpc are the same in every trial);
# on several GPUs the split too (fitter.search.split).
SEARCHED: frozenset[str] = frozenset(f.canonical for f in FLAGS if f.takes_value and (
    f.space_key or f.field in ("overrides", "tensor_split", "split_mode", "main_gpu")))
# bare switches of a searched key (-nkvo/-kvo: kv-offload), shown alone
SEARCHED_SWITCHES: frozenset[str] = frozenset(f.canonical for f in FLAGS if f.kind in (Kind.SWITCH, Kind.NEGATION)
                                              and (f.space_key or f.fixes))


def fixing(space_key: str) -> tuple[str, ...]:
    """The spellings that fix a search-space key on the command line (so it leaves the search)."""
    return tuple(name for f in FLAGS if f.space_key == space_key or space_key in f.fixes for name in f.names)


def short_flag(space_key: str) -> str:
    """The flag fitter writes for a search-space key, e.g. "ubatch-size" → "-ub"."""
    return BY_SPACE_KEY[space_key].canonical


# Speculative decoding beyond a draft model's (fitter.flags.draft): the draft's own devices, threads and affinity, a
# draft from Hugging Face, and every --spec-* setting of the types fitter does not model (MTP, EAGLE3, n-gram
# drafts). llama.cpp's removed spellings (--draft-max, --draft-min) are refused with its own advice.
SPECULATIVE_SHORT = frozenset({"-devd", "-td", "-tbd", "-hfd", "-hfrd", "-Cd", "-Crd", "-Cbd", "-Crbd"})
REMOVED = {"--draft": "--spec-draft-n-max", "--draft-n": "--spec-draft-n-max", "--draft-max": "--spec-draft-n-max",
           "--draft-min": "--spec-draft-n-min", "--draft-n-min": "--spec-draft-n-min"}  # common/arg.cpp arg_removed


def speculative_flag(token: str) -> bool:
    """A llama.cpp flag of speculative decoding that fitter does not model, in any spelling."""
    name = token.split("=", 1)[0]
    if name in BY_NAME:
        return False
    return name in SPECULATIVE_SHORT or name.startswith(("--spec-", "--draft")) or (
        name.startswith("--") and name.endswith("-draft"))


def unmodelled_speculation(token: str) -> str:
    """The one-line refusal of a `speculative_flag`."""
    name = token.split("=", 1)[0]
    if name in REMOVED:
        return (f"{name}: the argument has been removed from llama.cpp; use {REMOVED[name]} (common/arg.cpp), "
                "which fitter reads")
    return (f"{name}: fitter models a draft model (-md, -ngld, -ncmoed, -cmoed, -otd, -ctkd, -ctvd, --spec-type "
            "draft-simple, --spec-draft-n-max/-min) on the target's devices; this setting's memory or placement (the "
            "draft's own devices or threads, MTP, EAGLE3, n-gram drafts, a draft from Hugging Face) is not in its "
            "estimate; give the flags without it")
