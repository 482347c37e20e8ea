"""llama.cpp launch flags as llama-server reads them, and the context parameters llama.cpp derives from them.

Flag names, spellings and defaults are llama-server's (common/arg.cpp, common/common.h, tools/server/server.cpp);
`resolve_context` repeats the adjustments `llama_context::llama_context` makes silently (src/llama-context.cpp)
and reports each one as a warning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from fitter.errors import LaunchConfigError
from fitter.flags.consumers import DEFAULT_CONSUMER, consumer

# common/arg.cpp `kv_cache_types`, by ggml type name; bytes per element as (block size, block bytes).
KV_CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
    "q4_1": (32, 20), "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24),
}
GGML_MAX_N_THREADS = 512  # ggml/include/ggml.h: the CPUs --cpu-mask and --cpu-range can name
LOAD_MODES = ("auto", "none", "mmap", "mlock", "mmap+mlock", "dio")  # common/arg.cpp -lm/--load-mode
# common/arg.cpp -sm/--split-mode, in llama_split_mode order (include/llama.h): the index is the C API value
SPLIT_MODES = ("none", "layer", "row", "tensor")

SERVER_DEFAULTS_HELP = """\
llama-server defaults assumed when a flag is not given (llama.cpp 0c1e570):
  -c 0 (the model's training context)   -b 2048   -ub 512   -ctk f16   -ctv f16   -fa auto (on where supported)
  -np auto = 4 slots sharing one unified KV cache (--kv-unified); an explicit -np N uses N separate streams
  unless --kv-unified is also given.  --swa-full off (the C API and llama-cpp-python default to on).
  -ngl auto: --fit chooses; fitter's estimate then assumes all layers (what llama.cpp does with -fit off).
  KV and compute on the GPU (no -nkvo), op offload on, weight repacking on, -lm auto (mmap), -fit on.
  llama-server reserves logits for one output per slot (-np), so the compute graph has n_slots outputs.
--for llama-cli | llama-cpp-python | llama-bench: that program's defaults and memory rules instead:
  llama-cli as llama-server with -np 1; llama-cpp-python's Llama(): -c 512 -b 512 -ub 512 -fa off -ngl 0, one
  sequence, --swa-full on, logits for a whole ubatch (the C API's n_outputs_max 0 = n_batch), no --fit;
  llama-bench: -c stands for its p+n+d (default 640), -ngl all, one sequence, swa-full off, logits for a ubatch."""


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
    split_mode: str = "layer"  # -sm: none | layer | row | tensor (SPLIT_MODES)
    rpc: tuple[str, ...] = ()
    # -dev: the devices the model uses, by the names the build lists (common/arg.cpp parse_device_list); ("none",):
    # none; (): llama.cpp's choice (src/llama.cpp: RPC servers, then GPUs, integrated ones only without those)
    device_names: tuple[str, ...] = ()
    # --cache-ram: llama-server's prompt cache in host RAM, MiB (-1 no limit but the context's tokens, 0 none;
    # common/common.h cache_ram_mib, tools/server/server-task.cpp server_prompt_cache)
    cache_ram_mib: int = 8192
    consumer: str = DEFAULT_CONSUMER  # the program that runs it (`--for`, fitter.flags.consumers)
    # Speculative decoding with a draft model (common/arg.cpp --spec-draft-*, common/common.h
    # common_params_speculative_draft): a second model llama-server loads beside this one, with one draft context
    # every slot shares (fitter.flags.draft)
    draft_model: str = ""  # -md: the draft model's path as given ("" = none)
    draft_n_gpu_layers: int = -1  # -ngld: -1 auto, <= -2 all, else a count from the last layer backwards
    draft_overrides: tuple[TensorOverride, ...] = ()  # -otd, -cmoed, -ncmoed: the draft's own rules, in order
    draft_cache_type_k: str = "f16"  # -ctkd (the draft's cache is f16 whatever -ctk says)
    draft_cache_type_v: str = "f16"  # -ctvd
    spec_type: str = "none"  # --spec-type: none (the draft is loaded, nothing drafts) | draft-simple
    spec_draft_n_max: int = 3  # --spec-draft-n-max: tokens drafted per step (the target reserves logits for them)
    spec_draft_n_min: int = 0  # --spec-draft-n-min
    # The multimodal projector (common/arg.cpp --mmproj*, tools/mtmd): libmtmd's clip context, which llama-server
    # loads once the model and its context are made (fitter.memory.plan.mmproj)
    mmproj: str = ""  # -mm/--mmproj: the projector's path as given ("" = none)
    # -mmdev: "" llama.cpp's choice (-dev's first device, else the build's first GPU), "none" the CPU
    # (--no-mmproj-offload, -mmdev none), else a device as the build names it
    mmproj_device: str = ""
    # The fields a flag set (the rest are the program's defaults): what `pin(config, given=True)` writes back, so
    # the flags a user gave and the config fitter runs cannot disagree. Not part of equality: two configs that
    # allocate alike are alike however they were spelled.
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def with_given(self, **changes: object) -> LaunchConfig:
        """This config with `changes` made as flags added on the command line would make them: recorded as given."""
        return replace(self, **changes, given=self.given | set(changes))  # type: ignore[arg-type]

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
    n_outputs_max: int  # logits reserved in the worst-case graph: one per slot (servers) or n_batch (C API)
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
        # llama-server and llama-cli: server_output_limits (tools/server/server-context.cpp) → min(n_batch,
        # n_parallel * (1 + n_draft)), n_draft = --spec-draft-n-max with --spec-type draft-simple, else 0
        # (common/speculative.cpp common_speculative_n_max); the C API (llama-cpp-python, llama-bench): 0, which
        # llama_context reads as n_batch.
        n_outputs_max=consumer(config.consumer).n_outputs_max(n_batch, n_seq_max, drafted_tokens(config)),
        flash_attn=flash_attn,
        auto_fa=auto_fa,
        v_trans=not flash_attn,
        swa_full=config.swa_full,
        warnings=tuple(warnings),
    )


def drafted_tokens(config: LaunchConfig) -> int:
    """The tokens a slot drafts per step (common/speculative.cpp common_speculative_n_max): --spec-draft-n-max for a
    draft-simple speculation, 0 without one (`-md` alone loads the draft and drafts nothing)."""
    return config.spec_draft_n_max if config.spec_type == "draft-simple" and config.draft_model else 0


def validate(config: LaunchConfig) -> None:
    """The rules llama.cpp enforces before it loads anything, as errors naming flag, rule and value."""
    from fitter.flags.draft import validate_draft

    validate_draft(config)
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


@dataclass(frozen=True)
class ProcessFlags:
    """The flags a LaunchConfig leaves to the process: threads (-t, -tb) and CPU affinity (-C, -Cr)."""

    threads: int | None = None
    threads_batch: int | None = None  # None: = threads (llama.cpp's -tb default)
    cpu_mask: str | None = None
    cpu_range: str | None = None

    @property
    def cpus(self) -> tuple[int, ...] | None:
        """The CPUs -C and -Cr allow, combined (None: any)."""
        return parse_cpu_mask(self.cpu_mask, self.cpu_range)

    def flags(self) -> list[str]:
        """llama-server's spellings, in its order: -t, -tb, -C, -Cr (what is set)."""
        out: list[str] = []
        for name, value in (("-t", self.threads), ("-tb", self.threads_batch), ("-C", self.cpu_mask),
                            ("-Cr", self.cpu_range)):
            if value is not None:
                out += [name, str(value)]
        return out


def parse_cpu_mask(mask: str | None, cpu_range: str | None) -> tuple[int, ...] | None:
    """llama.cpp's --cpu-mask (arbitrarily long hex) and --cpu-range lo-hi, combined (common/common.cpp)."""
    cpus: set[int] = set()
    if mask:
        try:
            bits = int(mask.removeprefix("0x").removeprefix("0X"), 16)
        except ValueError:
            raise LaunchConfigError(f"--cpu-mask {mask!r}: expected a hex mask such as 0x3") from None
        cpus |= {i for i in range(bits.bit_length()) if bits >> i & 1}
    if cpu_range:
        lo, sep, hi = cpu_range.partition("-")
        if not sep or not lo.isdigit() or not hi.isdigit() or int(lo) > int(hi):
            raise LaunchConfigError(f"--cpu-range {cpu_range!r}: expected lo-hi, e.g. 0-3")
        if int(hi) >= GGML_MAX_N_THREADS:  # llama.cpp refuses it ("End index out of bounds!"): no set of 10^11 CPUs
            raise LaunchConfigError(f"--cpu-range {cpu_range!r}: CPUs go up to {GGML_MAX_N_THREADS - 1} "
                                    "(GGML_MAX_N_THREADS, common/common.cpp parse_cpu_range)")
        cpus |= set(range(int(lo), int(hi) + 1))
    return tuple(sorted(cpus)) or None


# A draft model's settings besides its path (fitter.flags.draft)
DRAFT_FIELDS = ("draft_n_gpu_layers", "draft_overrides", "draft_cache_type_k", "draft_cache_type_v", "spec_type",
                "spec_draft_n_max", "spec_draft_n_min")
# Fields added after keys were recorded, left out of `recorded_repr` at their defaults
_LATER_FIELDS = ("split_mode", "device_names", "draft_model", *DRAFT_FIELDS, "cache_ram_mib", "mmproj",
                 "mmproj_device")


def recorded_repr(config: LaunchConfig) -> str:
    """repr(config) as keys recorded before `split_mode`, `-dev`, the draft's fields, `--cache-ram` and `--mmproj`
    existed spell it: each is left out at its default (`-sm layer`, no `-dev`, no draft), so seeded simulations and
    recorded landscapes keep matching (fitter.sim);
    `flags=()` closes it, as when a config carried its flags' tokens (keys were recorded without them)."""
    text = repr(config)[:-1] + ", flags=())"
    program = consumer(config.consumer)
    for name in _LATER_FIELDS:
        # the program's own value (--cache-ram: llama-server's 8192 MiB, none in the C API's programs)
        value = program.fixed.get(name, program.defaults.get(name, getattr(LaunchConfig, name)))
        if getattr(config, name) == value:
            text = text.replace(f", {name}={value!r}", "", 1)
    return text

