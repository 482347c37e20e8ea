"""Tensor-override rules: the ones `-cmoe`, `-ncmoe N` and fitter's own placements add, and how a rule list is
written back as `-ncmoe N` plus `-ot PATTERN=BUFT,…`.

llama.cpp appends `-ot`, `-cmoe` and `-ncmoe` rules to one list in command-line order and the first rule that
matches a tensor wins (common/arg.cpp, src/llama-model-loader.cpp). Pure functions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace

from fitter.flags.config import TensorOverride

# common/common.h LLM_FFN_EXPS_REGEX: no `.weight` anchor, so expert biases move too.
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
CPU_MOE_RULE = TensorOverride(FFN_EXPS_REGEX, "CPU")  # -cmoe: every layer's experts on the CPU
EXPERT_KINDS = ("up", "gate", "down")
MAX_LAYERS = 512  # LLAMA_MAX_LAYERS (src/llama-hparams.h)
_NCMOE_RE = re.compile(r"^blk\\\.(\d+)" + re.escape(FFN_EXPS_REGEX) + "$")


def layer_experts_rule(layer: int) -> TensorOverride:
    """The experts of one layer on the CPU (common/common.h llm_add_n_cpu_ffn_overrides, for one layer)."""
    return TensorOverride(rf"blk\.{layer}{FFN_EXPS_REGEX}", "CPU")


def ncmoe_rules(n: int) -> tuple[TensorOverride, ...]:
    """The rules `-ncmoe n` adds: the experts of the *first* n layers on the CPU."""
    # One rule per layer, as llama.cpp adds them; past LLAMA_MAX_LAYERS none would match (and -ncmoe 2147483647
    # would build two billion)
    return tuple(layer_experts_rule(i) for i in range(min(n, MAX_LAYERS)))


def experts_rules(layers: list[int], boundary: int | None = None, kinds: tuple[str, ...] = ()) -> \
        tuple[TensorOverride, ...]:
    """Experts of `layers` on the CPU, plus the `kinds` (up, gate, down) of one boundary layer's experts."""
    rules = [layer_experts_rule(i) for i in layers]
    if boundary is not None and kinds:
        rules.append(TensorOverride(rf"blk\.{boundary}\.ffn_({'|'.join(kinds)})_(ch|)exps", "CPU"))
    return tuple(rules)


def split_ncmoe(overrides: tuple[TensorOverride, ...]) -> tuple[int, list[TensorOverride]]:
    """Recognise the rules `-ncmoe N` adds (layers 0…N-1, in order, first) so they print as `-ncmoe N` again."""
    n = 0
    while n < len(overrides):
        m = _NCMOE_RE.match(overrides[n].pattern)
        if m is None or int(m.group(1)) != n or overrides[n].buft != "CPU":
            break
        n += 1
    return n, list(overrides[n:])


def with_bufts(overrides: tuple[TensorOverride, ...], names: Mapping[str, str]) -> tuple[TensorOverride, ...]:
    """The rules with each buffer type `names` lists renamed (an emulated GPU's RPC0[…] as the CUDA<i> it stands
    for, and back)."""
    return tuple(replace(r, buft=names.get(r.buft, r.buft)) for r in overrides)


def override_flags(overrides: tuple[TensorOverride, ...], separator: str = ",") -> list[str]:
    """The rules in command-line order: `-ncmoe N` for each run of the rules it stands for (layers 0…N-1), `-ot` with
    the others between them joined by `separator` (llama-server splits one -ot on `,`; llama-bench on `;`, as `,`
    separates its configs). Read back, the list is the same rules in the same order."""
    flags: list[str] = []
    rest = list(overrides)
    while rest:
        n, after = split_ncmoe(tuple(rest))
        if n:
            flags += ["-ncmoe", str(n)]
            rest = after
            continue
        others = []
        while rest and split_ncmoe((rest[0],))[0] == 0:
            others.append(rest.pop(0))
        flags += ["-ot", separator.join(f"{r.pattern}={r.buft}" for r in others)]
    return flags
