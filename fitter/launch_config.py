"""llama.cpp launch flags as llama-server reads them, and the context parameters llama.cpp derives from them.

Flag names, spellings and defaults are llama-server's (common/arg.cpp, common/common.h, tools/server/server.cpp);
`resolve_context` repeats the adjustments `llama_context::llama_context` makes silently (src/llama-context.cpp)
and reports each one as a warning.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Any

from fitter.errors import LaunchConfigError

# common/arg.cpp `kv_cache_types`, by ggml type name; bytes per element as (block size, block bytes).
KV_CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
    "q4_1": (32, 20), "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24),
}
LOAD_MODES = ("auto", "none", "mmap", "mlock", "mmap+mlock", "dio")  # common/arg.cpp -lm/--load-mode
# common/common.h LLM_FFN_EXPS_REGEX: no `.weight` anchor, so expert biases move too.
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
# common/common.cpp is_truthy / is_falsey / is_autoy
_TRUTHY = ("on", "enabled", "true", "1")
_FALSEY = ("off", "disabled", "false", "0")
_AUTOY = ("auto", "-1")

SERVER_DEFAULTS_HELP = """\
llama-server defaults assumed when a flag is not given (llama.cpp 0c1e570):
  -c 0 (the model's training context)   -b 2048   -ub 512   -ctk f16   -ctv f16   -fa auto (on where supported)
  -np auto = 4 slots sharing one unified KV cache (--kv-unified); an explicit -np N uses N separate streams
  unless --kv-unified is also given.  --swa-full off (the C API and llama-cpp-python default to on).
  -ngl auto: --fit chooses; fitter's estimate then assumes all layers (what llama.cpp does with -fit off).
  KV and compute on the GPU (no -nkvo), op offload on, weight repacking on, -lm auto (mmap), -fit on.
  llama-server reserves logits for one output per slot (-np), so the compute graph has n_slots outputs."""


@dataclass(frozen=True)
class TensorOverride:
    """One `-ot PATTERN=BUFT` rule; `-cmoe` and `-ncmoe N` add rules of the same kind in command-line order."""

    pattern: str
    buft: str  # buffer type name as llama.cpp prints it: "CPU", "CUDA0", "RPC0[127.0.0.1:50052]"

    def matches(self, tensor_name: str) -> bool:
        # std::regex_search semantics (src/llama-model-loader.cpp): unanchored search.
        return re.search(self.pattern, tensor_name) is not None


@dataclass(frozen=True)
class LaunchConfig:
    ctx_size: int = 0
    batch_size: int = 2048
    ubatch_size: int = 512
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: str = "auto"  # on | off | auto
    n_gpu_layers: int = -1  # -1 auto, <= -2 all, else a count from the last layer backwards
    overrides: tuple[TensorOverride, ...] = ()
    parallel: int = -1  # -1 auto: 4 slots with a unified KV (tools/server/server.cpp)
    kv_unified: bool | None = None  # None: llama-server decides (true only with -np auto)
    swa_full: bool = False
    no_kv_offload: bool = False
    no_op_offload: bool = False
    no_repack: bool = False
    load_mode: str = "auto"  # -lm: auto | none | mmap | mlock | mmap+mlock | dio
    fit: bool = True
    tensor_split: tuple[float, ...] = ()
    main_gpu: int = 0
    rpc: tuple[str, ...] = ()
    flags: tuple[str, ...] = field(default=(), compare=False)  # the flags as the user gave them

    @property
    def mmap(self) -> bool:
        """Weights mapped from the file (common/arg.cpp --load-mode; auto = mmap where every device allows it)."""
        return self.load_mode in ("auto", "mmap", "mmap+mlock")

    @property
    def n_seq_max(self) -> int:
        return 4 if self.parallel < 0 else self.parallel

    @property
    def unified(self) -> bool:
        if self.kv_unified is not None:
            return self.kv_unified
        return self.parallel < 0


@dataclass(frozen=True)
class ContextParams:
    """What llama_context derives from the flags for a given model (src/llama-context.cpp)."""

    n_ctx: int  # total cells, padded
    n_ctx_seq: int  # cells per stream
    n_seq_max: int
    n_stream: int  # 1 when unified, else n_seq_max
    n_batch: int
    n_ubatch: int
    n_outputs_max: int  # llama-server reserves logits for one output per slot (server_output_limits)
    flash_attn: bool  # as the graph is built; `-fa auto` may still be turned off by the estimator's probe
    auto_fa: bool  # -fa auto with an unquantized V: llama.cpp probes the graph's devices (resolve_fused_ops)
    v_trans: bool  # V cache stored transposed: fixed when the cache is made, i.e. only with -fa off
    swa_full: bool
    warnings: tuple[str, ...]


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def resolve_context(config: LaunchConfig, n_ctx_train: int) -> ContextParams:
    """Mirror llama_context's constructor: -c 0 → training context, pad to 256, clamp -b and -ub."""
    warnings: list[str] = []
    n_seq_max = config.n_seq_max
    n_ctx = n_ctx_train if config.ctx_size == 0 else config.ctx_size
    n_batch = min(n_ctx, config.batch_size)  # causal attention: n_batch <= n_ctx
    if n_batch != config.batch_size:
        warnings.append(f"-b {config.batch_size} exceeds the context; llama.cpp uses -b {n_batch}")
    n_ubatch = min(n_batch, config.ubatch_size if config.ubatch_size else n_batch)
    if config.ubatch_size and n_ubatch != config.ubatch_size:
        warnings.append(f"-ub {config.ubatch_size} exceeds -b {n_batch}; llama.cpp clamps it to {n_ubatch}")
    padded = _pad(n_ctx, 256)
    if padded != n_ctx:
        warnings.append(f"-c {n_ctx} is padded to {padded} (a multiple of 256)")
    n_ctx = padded
    if config.unified:
        n_ctx_seq = n_ctx
    else:
        n_ctx_seq = _pad(n_ctx // n_seq_max, 256)
        if n_ctx != n_ctx_seq * n_seq_max:
            warnings.append(
                f"-c {n_ctx} is not {n_seq_max} slots of a multiple of 256; llama.cpp uses {n_ctx_seq * n_seq_max} "
                f"({n_ctx_seq} per slot)"
            )
            n_ctx = n_ctx_seq * n_seq_max
    # src/llama-context.cpp: a quantized V forces -fa auto to on; otherwise auto starts on (so the KV cache is made
    # for flash attention, V not transposed) and is turned off if the probe finds an FA op off its layer's device.
    flash_attn = config.flash_attn != "off"
    auto_fa = config.flash_attn == "auto" and KV_CACHE_TYPES[config.cache_type_v][0] == 1
    return ContextParams(
        n_ctx=n_ctx,
        n_ctx_seq=n_ctx_seq,
        n_seq_max=n_seq_max,
        n_stream=1 if config.unified else n_seq_max,
        n_batch=n_batch,
        n_ubatch=n_ubatch,
        # tools/server/server-context.cpp server_output_limits → common_speculative_get_output_limits:
        # min(n_batch, n_parallel * (1 + n_draft)), no speculative decoding here.
        n_outputs_max=min(n_batch, n_seq_max),
        flash_attn=flash_attn,
        auto_fa=auto_fa,
        v_trans=not flash_attn,
        swa_full=config.swa_full,
        warnings=tuple(warnings),
    )


# ---------------------------------------------------------------------------------------------------------------
# Command-line parsing: the same spellings as llama-server.


class _AppendOverride(argparse.Action):
    """-ot, -cmoe and -ncmoe share one ordered rule list, as in common/arg.cpp (first match wins)."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        rules: list[TensorOverride] = list(getattr(ns, "overrides", None) or [])
        if self.dest == "cpu_moe":
            rules.append(TensorOverride(FFN_EXPS_REGEX, "CPU"))
        elif self.dest == "n_cpu_moe":
            n = _int(values, option_string)
            if n < 0:
                raise LaunchConfigError(f"{option_string} {values}: must be >= 0 (common/arg.cpp)")
            # llm_add_n_cpu_ffn_overrides: the *first* n layers
            rules.extend(TensorOverride(rf"blk\.{i}{FFN_EXPS_REGEX}", "CPU") for i in range(n))
        else:
            for item in str(values).split(","):
                pattern, sep, buft = item.partition("=")
                if not sep or not pattern or not buft:
                    raise LaunchConfigError(f"{option_string} {values!r}: each rule must be PATTERN=BUFFER_TYPE")
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise LaunchConfigError(f"{option_string} {values!r}: bad regular expression: {e}") from None
                rules.append(TensorOverride(pattern, buft))
        ns.overrides = rules
        setattr(ns, self.dest, values if self.dest != "cpu_moe" else True)


def _int(value: Any, flag: str | None) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LaunchConfigError(f"{flag} {value!r}: expected an integer") from None


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


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("llama.cpp flags (llama-server spellings and defaults)")
    g.add_argument("-c", "--ctx-size", dest="ctx_size", type=int, default=0, metavar="N",
                   help="context size (default 0 = the model's training context)")
    g.add_argument("-b", "--batch-size", dest="batch_size", type=int, default=2048, metavar="N")
    g.add_argument("-ub", "--ubatch-size", dest="ubatch_size", type=int, default=512, metavar="N")
    g.add_argument("-ctk", "--cache-type-k", dest="cache_type_k", type=_cache_type, default="f16", metavar="TYPE",
                   help=f"K cache type: {', '.join(KV_CACHE_TYPES)}")
    g.add_argument("-ctv", "--cache-type-v", dest="cache_type_v", type=_cache_type, default="f16", metavar="TYPE",
                   help="V cache type (quantized V needs flash attention)")
    g.add_argument("-fa", "--flash-attn", dest="flash_attn", type=_on_off_auto, default="auto", metavar="on|off|auto")
    g.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", type=_ngl, default=-1,
                   metavar="N|auto|all", help="layers on the GPU, counted from the last one (default auto)")
    g.add_argument("-cmoe", "--cpu-moe", dest="cpu_moe", nargs=0, action=_AppendOverride,
                   help="keep every layer's expert tensors on the CPU")
    g.add_argument("-ncmoe", "--n-cpu-moe", dest="n_cpu_moe", action=_AppendOverride, metavar="N",
                   help="keep the expert tensors of the first N layers on the CPU")
    g.add_argument("-ot", "--override-tensor", dest="override_tensor", action=_AppendOverride,
                   metavar="PATTERN=BUFT[,...]", help="buffer type per tensor-name regex; the first match wins")
    g.add_argument("-np", "--parallel", dest="parallel", type=int, default=-1, metavar="N",
                   help="server slots (default auto: 4 slots, unified KV)")
    kvu = g.add_mutually_exclusive_group()
    kvu.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_true", default=None)
    kvu.add_argument("-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_false")
    g.add_argument("--swa-full", dest="swa_full", action="store_true", help="full-size SWA cache")
    g.add_argument("-nkvo", "--no-kv-offload", dest="no_kv_offload", action="store_true")
    g.add_argument("--no-op-offload", dest="no_op_offload", action="store_true")
    g.add_argument("-nr", "--no-repack", dest="no_repack", action="store_true")
    lm = g.add_mutually_exclusive_group()
    lm.add_argument("-lm", "--load-mode", dest="load_mode", choices=LOAD_MODES, default="auto",
                    help="how weights are loaded (default auto = mmap)")
    lm.add_argument("--no-mmap", dest="load_mode", action="store_const", const="none",
                    help="older llama.cpp spelling of -lm none")
    g.add_argument("-fit", "--fit", dest="fit", type=_on_off, default=True, metavar="on|off")
    g.add_argument("-ts", "--tensor-split", dest="tensor_split", type=_split, default=(), metavar="N0,N1,...")
    g.add_argument("-mg", "--main-gpu", dest="main_gpu", type=int, default=0, metavar="INDEX")
    g.add_argument("--rpc", dest="rpc", default="", metavar="HOST:PORT[,...]")


def launch_config_from_args(ns: argparse.Namespace, flags: list[str]) -> LaunchConfig:
    config = LaunchConfig(
        ctx_size=ns.ctx_size,
        batch_size=ns.batch_size,
        ubatch_size=ns.ubatch_size,
        cache_type_k=ns.cache_type_k,
        cache_type_v=ns.cache_type_v,
        flash_attn=ns.flash_attn,
        n_gpu_layers=ns.n_gpu_layers,
        overrides=tuple(getattr(ns, "overrides", None) or ()),
        parallel=ns.parallel,
        kv_unified=ns.kv_unified,
        swa_full=ns.swa_full,
        no_kv_offload=ns.no_kv_offload,
        no_op_offload=ns.no_op_offload,
        no_repack=ns.no_repack,
        load_mode=ns.load_mode,
        fit=ns.fit,
        tensor_split=ns.tensor_split,
        main_gpu=ns.main_gpu,
        rpc=tuple(x for x in ns.rpc.split(",") if x),
        flags=tuple(flags),
    )
    validate(config)
    return config


def validate(config: LaunchConfig) -> None:
    """The rules llama.cpp enforces before it loads anything, as errors naming flag, rule and value."""
    if config.ctx_size < 0:
        raise LaunchConfigError(f"-c {config.ctx_size}: must be >= 0 (0 = the model's training context)")
    if config.batch_size < 1 or config.ubatch_size < 1:
        raise LaunchConfigError(f"-b {config.batch_size} -ub {config.ubatch_size}: both must be >= 1")
    if config.parallel == 0 or config.parallel < -1:
        raise LaunchConfigError(f"-np {config.parallel}: must be >= 1, or -1 for auto (tools/server/server.cpp)")
    if config.flash_attn == "off" and KV_CACHE_TYPES[config.cache_type_v][0] > 1:
        raise LaunchConfigError(
            f"-ctv {config.cache_type_v} with -fa off: a quantized V cache requires flash attention "
            "(src/llama-context.cpp); use -fa on or -ctv f16"
        )


def parse_launch_flags(flags: list[str]) -> LaunchConfig:
    """Parse a list of llama.cpp flags (as a launcher would pass them) into a LaunchConfig."""

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str) -> Any:  # argparse would print usage and exit
            raise LaunchConfigError(f"llama.cpp flags {' '.join(flags)!r}: {message}")

    parser = _Parser(add_help=False)
    add_launch_arguments(parser)
    ns = parser.parse_args(flags)
    return launch_config_from_args(ns, flags)


# Flags fitter's launch config leaves to the process (threads and affinity): spelling → canonical
PROCESS_FLAGS = {"-t": "-t", "--threads": "-t", "-tb": "-tb", "--threads-batch": "-tb",
                 "-C": "-C", "--cpu-mask": "-C", "-Cr": "-Cr", "--cpu-range": "-Cr"}


def split_process_flags(flags: list[str], where: str) -> tuple[list[str], dict[str, str]]:
    """(llama.cpp flags for parse_launch_flags, {-t|-tb|-C|-Cr: value})."""
    launch: list[str] = []
    process: dict[str, str] = {}
    i = 0
    while i < len(flags):
        canonical = PROCESS_FLAGS.get(flags[i])
        if canonical is None:
            launch.append(flags[i])
            i += 1
            continue
        if i + 1 >= len(flags):
            raise LaunchConfigError(f"{where}: {flags[i]} without a value")
        process[canonical] = flags[i + 1]
        i += 2
    return launch, process
