"""Which program will run a config (`--for`): llama-server, llama-cli, llama-cpp-python or llama-bench.

The same llama.cpp flags allocate different memory in different programs, because each one fills in the flags it
was not given with its own defaults and sets context parameters no flag reaches. One row per program, read from
llama.cpp 0c1e570 and llama-cpp-python 0.3.36 (the copy of llama.cpp it vendors):

- llama-server (tools/server/server.cpp `llama_server`, server-context.cpp `server_output_limits`): `-np` auto
  means 4 slots sharing one unified KV cache; logits are reserved for one output per slot (n_outputs_max =
  min(-b, slots)); common/common.h defaults otherwise (-c 0, -b 2048, -ub 512, -fa auto, swa_full off).
- llama-cli (tools/cli/cli.cpp, cli-server.h `cli_server::start`): runs `llama_server()` in a thread with the
  flags parsed for LLAMA_EXAMPLE_CLI, so the server's memory rules with common/common.h's `n_parallel = 1` (only
  LLAMA_EXAMPLE_SERVER sets -1, common/arg.cpp `common_params_parser_init`).
- llama-cpp-python (llama_cpp/llama.py `Llama.__init__` over the C API, src/llama-context.cpp
  `llama_context_default_params`): n_ctx 512, n_batch 512, n_ubatch 512, flash_attn False (off, not auto),
  n_gpu_layers 0, one sequence, no unified KV, swa_full true (the C API's; Llama passes it only when given), no
  --fit (not in libllama), and n_outputs_max 0, which llama_context reads as n_batch: logits for a whole ubatch
  (src/llama-context.cpp: `cparams.n_outputs_max = params.n_outputs_max == 0 ? cparams.n_batch : …`). Flags the C
  API takes but `Llama(**kwargs)` has no keyword for (-np, --kv-unified, -ot/-ncmoe as tensor_buft_overrides, -nr)
  are honoured; the python export lists them apart.
- llama-bench (tools/llama-bench/llama-bench.cpp `cmd_params_instance::to_llama_cparams`): the C API's defaults
  with n_ctx = p + n + d (fitter writes that as -c), -ngl -1 (every layer), one sequence, swa_full forced off,
  n_outputs_max 0 (= n_batch). It has no -np, --kv-unified or --swa-full.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fitter.errors import LaunchConfigError

DEFAULT_CONSUMER = "llama-server"


@dataclass(frozen=True)
class Consumer:
    name: str
    defaults: Mapping[str, Any]  # LaunchConfig fields the program sets when no flag gives them
    outputs_per_slot: bool  # n_outputs_max = min(-b, slots) (server_output_limits); else 0 → n_batch
    auto_slots: bool  # -np -1 means 4 slots with a unified KV cache (tools/server/server.cpp)
    fixed: Mapping[str, Any]  # fields the program sets whatever the flags say; a flag asking otherwise is refused
    source: str  # where its rules live

    def n_outputs_max(self, n_batch: int, n_seq_max: int, n_draft: int = 0) -> int:
        """The outputs llama_context reserves logits for in the worst-case graph (src/llama-context.cpp): a server's
        slot verifies its `n_draft` drafted tokens and one more in one batch (server_output_limits)."""
        return max(1, min(n_batch, n_seq_max * (1 + n_draft))) if self.outputs_per_slot else n_batch


CONSUMERS: dict[str, Consumer] = {
    c.name: c
    for c in (
        Consumer("llama-server", {}, True, True, {}, "tools/server/server.cpp, tools/server/server-context.cpp"),
        Consumer("llama-cli", {"parallel": 1}, True, True, {}, "tools/cli/cli.cpp runs llama_server(); common.h"),
        Consumer(
            "llama-cpp-python",
            {"ctx_size": 512, "batch_size": 512, "ubatch_size": 512, "flash_attn": "off", "n_gpu_layers": 0,
             "parallel": 1, "kv_unified": False, "swa_full": True},
            False, False, {"fit": False, "cache_ram_mib": 0, "mmproj": ""},
            "llama-cpp-python 0.3.36 llama_cpp/llama.py Llama.__init__ (a projector is its chat handler's, not a "
            "Llama argument); src/llama-context.cpp defaults",
        ),
        Consumer(
            "llama-bench", {"ctx_size": 640, "parallel": 1, "kv_unified": False}, False, False,
            {"parallel": 1, "kv_unified": False, "swa_full": False, "fit": False, "cache_ram_mib": 0, "mmproj": ""},
            "tools/llama-bench/llama-bench.cpp cmd_params_instance::to_llama_cparams",
        ),
    )
}
CONSUMER_NAMES = tuple(CONSUMERS)  # the programs a user runs a config with (`--for`)
# llama.cpp's own projection tool reads flags too (fitter.measure.llamacpp.projection): common.h's defaults, `-np` as
# given (fitter.measure.llamacpp.fit_params translates llama-server's auto to 4), no unified KV (it rejects -kvu), the
# C API's n_outputs_max 0 = n_batch (tools/fit-params/fit-params.cpp, common/common.cpp common_context_params_to_llama).
CONSUMERS["llama-fit-params"] = Consumer("llama-fit-params", {"parallel": 1}, False, False,
                                         {"kv_unified": False, "fit": False, "cache_ram_mib": 0},
                                         "tools/fit-params/fit-params.cpp")


def consumer(name: str) -> Consumer:
    try:
        return CONSUMERS[name]
    except KeyError:
        raise LaunchConfigError(f"--for {name!r}: unknown program; choose one of {', '.join(CONSUMERS)}") from None


def apply_defaults(values: dict[str, Any], given: set[str], name: str) -> dict[str, Any]:
    """LaunchConfig field values for `name`: its defaults where no flag gave the field (`given`), its fixed values
    everywhere; a flag asking for something the program cannot do is an error naming both."""
    c = consumer(name)
    out = dict(values)
    for field, value in c.defaults.items():
        if field not in given:
            out[field] = value
    for field, value in c.fixed.items():
        harmless = field == "kv_unified" and c.fixed.get("parallel") == 1  # one sequence: one stream either way
        if field in given and out[field] != value and out[field] is not None and not harmless:
            uses = "loads none" if value == "" else f"always uses {value!r}"
            raise LaunchConfigError(f"--for {name}: {_spelling(field)} {out[field]!r} cannot be given to {name}, "
                                    f"which {uses} ({c.source})")
        out[field] = value
    if out.get("parallel", 1) < 0 and not c.auto_slots:
        raise LaunchConfigError(f"--for {name}: -np auto is llama-server's; give the number of sequences (-np N)")
    out["consumer"] = name
    return out


def retarget(config: Any, name: str) -> Any:
    """A resolved LaunchConfig (every field explicit, as a tuned result's) run by another program: the fields it
    can take stay, the ones it fixes take its value (llama-bench: one sequence, no full SWA cache; the C API's
    programs: no draft model)."""
    c = consumer(name)
    changes = {field: value for field, value in c.fixed.items() if getattr(config, field) != value}
    if not c.outputs_per_slot and config.draft_model:  # the C API's programs load no draft model: it is left out
        from fitter.flags.draft import without_draft

        return dataclasses.replace(without_draft(config).with_given(**changes), consumer=name)
    return dataclasses.replace(config.with_given(**changes), consumer=name)


def _spelling(field: str) -> str:
    from fitter.flags.vocabulary import names_of

    names = names_of(field)
    return names[0] if names else field


def with_bench_context(config: Any, n_tokens: int) -> Any:
    """llama-bench sizes its context as p + n + d (`to_llama_cparams`): for `--for llama-bench` without -c, the
    measured run's tokens are the context."""
    if config.consumer != "llama-bench" or "ctx_size" in config.given:
        return config
    return config.with_given(ctx_size=n_tokens)


def server_flags(config: Any) -> list[str]:
    """The flags to start llama-server with so that it runs `config` as its program would: llama-cli's one slot
    (its only default that differs, common.h n_parallel) where no -np was given. The C API's programs
    (llama-cpp-python, llama-bench) reserve memory no llama-server flag reproduces: refused."""
    if not consumer(config.consumer).outputs_per_slot:
        raise LaunchConfigError(f"--for {config.consumer}: llama-server cannot run the C API's memory rules "
                                "(logits for a whole ubatch); measure with fitter's worker (no --llama-server)")
    from fitter.flags.pin import pin  # pin reads LaunchConfig, whose module imports this one

    given = "parallel" in config.given
    return [*pin(config, given=True),
            *([] if given or config.consumer == DEFAULT_CONSUMER else ["-np", str(config.parallel)])]
