"""Search spaces for `fitter tune`: TOML files keyed by llama.cpp's long flags, turned into optuna distributions.

A file has an optional ``description`` and a ``[params]`` table. Each parameter is a list of explicit choices, a range
``{low = A, high = B}`` (keys that count layers or threads), or ``"auto"`` (layer keys: the tuner derives the range
from the model). Context (-c), slots (-np) and depth (-d) are fixed by the user on the command line, never searched.
The format is documented in search_spaces/README.md; shipped spaces live beside it.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from fitter.errors import SearchSpaceError
from fitter.flags import KV_CACHE_TYPES
from fitter.flags.config import LOAD_MODES
from fitter.flags.vocabulary import fixing, short_flag
from fitter.paths import SOURCE_ROOT
from fitter.search.split import EXPERT_ORDERS, TENSOR

SHIPPED = ("moe", "dense", "cpu")
THREAD_SYMBOLS = ("physical", "performance-cores")
SPACE_SPLIT_MODES = ("layer", TENSOR)  # -sm values a space may list (none is fitter.search.split's own placement)
FLASH_ATTN_VALUES = ("on", "off", "auto")
# Fixed by the user for the whole run (a tuned context would change what is being measured), with the flag to use.
FIXED_ON_COMMAND_LINE = {"ctx-size": "-c", "parallel": "-np", "depth": "-d", "n-depth": "-d"}
_TOP_LEVEL = ("description", "params")


def _ints_from(minimum: int) -> Callable[[Any], bool]:
    # bool is an int subclass and TOML floats like 512.0 are not flags llama.cpp parses: exact type only.
    return lambda v: type(v) is int and v >= minimum


def _cache_type(v: Any) -> bool:
    return isinstance(v, str) and v in KV_CACHE_TYPES  # a dict lookup: a list or table in the file is unhashable


def _load_mode(v: Any) -> bool:
    return isinstance(v, str) and v in LOAD_MODES


def _thread_count(v: Any) -> bool:
    return (type(v) is int and v >= 1) or v in THREAD_SYMBOLS


@dataclass(frozen=True)
class _Rule:
    allowed: str  # the rule an explicit value breaks, as the error message states it
    accepts: Callable[[Any], bool]
    minimum: int | None = None  # ranges {low, high} allowed from this value up; None: lists only
    auto: bool = False  # "auto" allowed: a layer count the tuner derives from the model
    flag: bool = True  # False: no flag of its own; fitter.search.split writes the placement it orders
    switch: bool = False  # true/false: a bare flag either way (kv-offload: -kvo / -nkvo)


# In the order params_to_flags emits them; each key's flag is fitter.flags.vocabulary's.
_RULES: dict[str, _Rule] = {
    "n-cpu-moe": _Rule("values must be integers >= 0", _ints_from(0), minimum=0, auto=True),
    "n-gpu-layers": _Rule("values must be integers >= 0", _ints_from(0), minimum=0, auto=True),
    # which layers -ncmoe's count takes (first: -ncmoe itself; last: llama.cpp --fit's, an -ot rule)
    "expert-order": _Rule(f"values must be one of {', '.join(EXPERT_ORDERS)}", EXPERT_ORDERS.__contains__,
                          flag=False),
    "batch-size": _Rule("values must be integers >= 1", _ints_from(1)),
    "ubatch-size": _Rule("values must be integers >= 1", _ints_from(1)),
    "cache-type-k": _Rule(f"values must be one of {', '.join(KV_CACHE_TYPES)}", _cache_type),
    "cache-type-v": _Rule(f"values must be one of {', '.join(KV_CACHE_TYPES)}", _cache_type),
    "flash-attn": _Rule(f"values must be one of {', '.join(FLASH_ATTN_VALUES)}", FLASH_ATTN_VALUES.__contains__),
    # where weights and the KV cache live in host memory (fitter.memory.plan.host): -lm none puts the CPU's weights
    # in the GPU's pinned host buffers, which op offload copies from faster; -nkvo trades VRAM for host attention
    "load-mode": _Rule(f"values must be one of {', '.join(LOAD_MODES)}", _load_mode),
    "kv-offload": _Rule("values must be true or false", lambda v: type(v) is bool, switch=True),
    # -sm on two or more GPUs: layer (llama.cpp's default) or tensor parallelism; fitter.search.split writes it
    "split-mode": _Rule(f"values must be one of {', '.join(SPACE_SPLIT_MODES)}", SPACE_SPLIT_MODES.__contains__,
                        flag=False),
    "threads": _Rule('values must be integers >= 1, "physical" or "performance-cores"', _thread_count, minimum=1),
    "threads-batch": _Rule('values must be integers >= 1, "physical" or "performance-cores"', _thread_count,
                           minimum=1),
}
KEYS = tuple(_RULES)
FLAGLESS = frozenset(k for k, rule in _RULES.items() if not rule.flag)  # placement words: no flag of their own


@dataclass(frozen=True)
class Dimension:
    """One searched llama.cpp flag, as written in the file (threads symbols and "auto" are resolved by `resolve`)."""

    key: str  # the llama.cpp long flag name, e.g. "ubatch-size"
    values: tuple[Any, ...] | None  # explicit choices as written; None for a range or "auto"
    low: int | None = None
    high: int | None = None
    auto: bool = False  # the tuner derives the range from the model and the placement search


@dataclass(frozen=True)
class SearchSpace:
    source: str  # the file path, or "shipped:<name>"
    description: str
    dims: tuple[Dimension, ...]  # in file order

    def keys(self) -> tuple[str, ...]:
        return tuple(d.key for d in self.dims)


def load_space(path: str | Path) -> SearchSpace:
    """A user's search-space file (`--space FILE`), validated strictly."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SearchSpaceError(f"{p}: not a UTF-8 text file, so not a TOML search space") from None
    except OSError as exc:
        raise SearchSpaceError(f"{p}: cannot read the search space: {exc.strerror or exc}") from None
    return parse_space(text, str(p))


def shipped_space_names() -> tuple[str, ...]:
    return SHIPPED


def shipped_space(name: str) -> SearchSpace:
    """One of the spaces shipped with fitter: "moe", "dense" or "cpu"."""
    if name not in SHIPPED:
        raise SearchSpaceError(f"no shipped search space {name!r}; shipped: {', '.join(SHIPPED)}")
    return parse_space(_shipped_text(name), f"shipped:{name}")


def _shipped_text(name: str) -> str:
    # A wheel holds the folder as fitter/search_spaces (pyproject force-include); an editable install imports
    # fitter from the repository, where the folder is the top-level search_spaces/ beside the package.
    packaged = resources.files("fitter") / "search_spaces" / f"{name}.toml"
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (SOURCE_ROOT / "search_spaces" / f"{name}.toml").read_text(encoding="utf-8")


def default_space_name(n_expert: int, has_gpu: bool) -> str:
    """The shipped space for a model: experts only matter when a GPU can take the rest of the model."""
    if not has_gpu:
        return "cpu"
    return "moe" if n_expert > 0 else "dense"


def parse_space(text: str, source: str) -> SearchSpace:
    """A search space from TOML text; `source` names it in every error message."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # its message ends "(at line L, column C)"
        raise SearchSpaceError(f"{source}: not valid TOML: {exc}") from None
    except ValueError:  # tomllib's int() of a literal past Python's limit on integer digits
        raise SearchSpaceError(f"{source}: an integer of more than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:  # tomllib descends one call per level of nesting
        raise SearchSpaceError(f"{source}: arrays or inline tables nested too deeply") from None
    for key in data:
        if key not in _TOP_LEVEL:
            where = " (searched flags go under [params])" if key in _RULES or key in FIXED_ON_COMMAND_LINE else ""
            raise SearchSpaceError(f"{source}: unknown top-level key {key!r}{where}; allowed: description, [params]")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise SearchSpaceError(f"{source}: description = {_toml(description)}: must be a string")
    params = data.get("params")
    if not isinstance(params, dict) or not params:
        raise SearchSpaceError(f"{source}: needs a [params] table with at least one of: {', '.join(KEYS)}")
    return SearchSpace(source, description, tuple(_dimension(source, k, v) for k, v in params.items()))


def _dimension(source: str, key: str, value: Any) -> Dimension:
    where = f"{source}: {key} = {_toml(value)}"
    if key in FIXED_ON_COMMAND_LINE:
        raise SearchSpaceError(
            f"{where}: {key} is fixed on the command line ({FIXED_ON_COMMAND_LINE[key]}), not in a search space"
        )
    rule = _RULES.get(key)
    if rule is None:
        raise SearchSpaceError(f"{source}: unknown key {key!r} in [params]{_key_hint(key)}; allowed: {', '.join(KEYS)}")
    if value == "auto" and rule.auto:
        return Dimension(key, None, auto=True)
    if isinstance(value, list):
        return _choices(where, key, value, rule)
    if isinstance(value, dict) and rule.minimum is not None:
        return _range(where, key, value, rule.minimum)
    forms = "a list of choices" + (", a range {low = A, high = B}" if rule.minimum is not None else "")
    forms += ' or "auto"' if rule.auto else ""
    example = "" if isinstance(value, dict) else f" (e.g. {key} = [{_toml(value)}])"
    raise SearchSpaceError(f"{where}: must be {forms}{example}")


def _choices(where: str, key: str, value: list[Any], rule: _Rule) -> Dimension:
    if not value:
        raise SearchSpaceError(f"{where}: the list is empty; give at least one value")
    seen: list[Any] = []
    for v in value:
        if not rule.accepts(v):
            raise SearchSpaceError(f"{where}: {rule.allowed} (got {_toml(v)})")
        if v in seen:
            raise SearchSpaceError(f"{where}: {_toml(v)} is listed twice")
        seen.append(v)
    try:  # optuna's own check of the choices, so the tuner can never be handed a distribution it rejects
        CategoricalDistribution(tuple(value))
    except ValueError as exc:
        raise SearchSpaceError(f"{where}: {exc}") from None
    return Dimension(key, tuple(value))


def _range(where: str, key: str, value: dict[str, Any], minimum: int) -> Dimension:
    if set(value) != {"low", "high"}:
        raise SearchSpaceError(f"{where}: a range has exactly the keys low and high")
    low, high = value["low"], value["high"]
    if not (_ints_from(minimum)(low) and _ints_from(minimum)(high)):
        raise SearchSpaceError(f"{where}: low and high must be integers >= {minimum}")
    try:
        IntDistribution(low, high)
    except ValueError as exc:  # "`low <= high` must hold, but got (low=5, high=2)."
        raise SearchSpaceError(f"{where}: {exc}") from None
    return Dimension(key, None, low=low, high=high)


def _key_hint(key: str) -> str:
    short = {short_flag(name).lstrip("-"): name for name, rule in _RULES.items() if rule.flag}
    if key in short:
        return f" (keys are long flag names: -{key} is {short[key]})"
    close = difflib.get_close_matches(key, KEYS + tuple(FIXED_ON_COMMAND_LINE), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def resolve(
    space: SearchSpace, *, n_layer: int, physical_cores: int, performance_cores: int,
    expert_layers: Sequence[int] = (),
) -> dict[str, BaseDistribution]:
    """Concrete optuna distributions for one model and machine, one per key in space order. `n-cpu-moe = "auto"`
    spans the model's expert layers (`expert_layers`, in order): from -ncmoe <first> (nothing on the CPU: the layers
    before it are dense) to -ncmoe <last + 1> (every expert on the CPU), so no trial repeats a placement."""
    symbols = {"physical": physical_cores, "performance-cores": performance_cores}
    # -ncmoe counts repeating layers; -ngl also counts the output layer (n_layer + 1 = everything on the GPU).
    limits = {
        "n-cpu-moe": (n_layer, f"the model has {n_layer} layers"),
        "n-gpu-layers": (n_layer + 1, f"the model's {n_layer} layers + the output layer"),
    }
    out: dict[str, BaseDistribution] = {}
    for dim in space.dims:
        limit = limits.get(dim.key)
        if dim.auto:
            assert limit is not None, dim.key  # parse_space allows "auto" only for layer keys
            if dim.key == "n-cpu-moe" and expert_layers:
                out[dim.key] = IntDistribution(expert_layers[0], expert_layers[-1] + 1)
            else:
                out[dim.key] = IntDistribution(0, limit[0])
            continue
        if dim.values is None:
            assert dim.low is not None and dim.high is not None
            choices: tuple[Any, ...] = (dim.high,)
        else:
            choices = dim.values
        if limit is not None and max(choices) > limit[0]:
            raise SearchSpaceError(
                f"{space.source}: {dim.key} = {_dim_toml(dim)}: values must be <= {limit[0]} ({limit[1]}), "
                f"got {max(choices)}"
            )
        if dim.values is None:
            assert dim.low is not None and dim.high is not None
            out[dim.key] = IntDistribution(dim.low, dim.high)
        elif dim.key in ("threads", "threads-batch"):
            # "physical" and "performance-cores" are one number on a non-hybrid CPU: sample it once.
            out[dim.key] = CategoricalDistribution(tuple(sorted({symbols.get(v, v) for v in dim.values})))
        else:
            out[dim.key] = CategoricalDistribution(dim.values)
    return out


def for_target(distributions: dict[str, BaseDistribution], *, has_gpu: bool, pinned_host: bool,
               tensor_split: bool = False) -> dict[str, BaseDistribution]:
    """`distributions` less the values that cannot differ on this target: without a GPU the KV cache is the host's
    either way (kv-offload: true only); without a device whose host buffer type is page-locked (CUDA_Host,
    Vulkan_Host: an RPC device, the CPU alone), -lm none reads the weights into the same plain memory mmap maps them
    in, and they run at the same speed (load-mode: its first value only). `tensor_split`: llama.cpp can run this
    model with -sm tensor here (two or more GPUs, an architecture it splits, flash attention possible); where it
    cannot, split-mode leaves the space (layer, llama.cpp's default, is what runs), and with flash-attn off alone
    listed tensor is refused (SPLIT_MODE_TENSOR requires flash_attn), so it goes too."""
    out = dict(distributions)
    fa = out.get("flash-attn")
    if isinstance(fa, CategoricalDistribution) and set(fa.choices) == {"off"}:
        tensor_split = False
    modes = out.get("split-mode")
    if modes is not None and (not tensor_split or not isinstance(modes, CategoricalDistribution)
                              or TENSOR not in modes.choices):
        del out["split-mode"]
    narrow = {"kv-offload": (not has_gpu, True), "load-mode": (not pinned_host, None)}
    for key, (pointless, keep) in narrow.items():
        d = out.get(key)
        if pointless and isinstance(d, CategoricalDistribution) and len(d.choices) > 1:
            kept = keep if keep in d.choices else d.choices[0]
            out[key] = CategoricalDistribution((kept,))
    return out


def params_to_flags(params: Mapping[str, Any]) -> list[str]:
    """llama.cpp short flags for concrete (resolved) parameters, in a fixed order whatever the dict's order."""
    unknown = sorted(set(params) - set(_RULES))
    if unknown:
        raise ValueError(f"not search-space parameters: {', '.join(unknown)}; known: {', '.join(KEYS)}")
    flagless = sorted(FLAGLESS & set(params))
    if flagless:
        raise ValueError(f"{', '.join(flagless)}: no flag of its own (fitter.search.split writes the placement)")
    flags: list[str] = []
    for key in _RULES:
        if key not in params:
            continue
        value = params[key]
        if _RULES[key].switch and isinstance(value, bool):
            flags.append(fixing(key)[0] if not value else short_flag(key))
            continue
        if isinstance(value, bool) or not isinstance(value, int | str) or value in THREAD_SYMBOLS:
            raise ValueError(f"{key}={value!r} is not a concrete llama.cpp value (resolve the space first)")
        flags += [short_flag(key), str(value)]
    return flags


def is_valid_combination(params: Mapping[str, Any]) -> str | None:
    """Why llama.cpp would refuse or duplicate these parameters, or None. Absent keys are not checked."""
    ctv = params.get("cache-type-v")
    # src/llama-context.cpp: "V cache quantization requires flash_attn"; -fa auto is forced on by a quantized V.
    if params.get("flash-attn") == "off" and ctv in KV_CACHE_TYPES and KV_CACHE_TYPES[ctv][0] != 1:
        return f"quantized V cache (cache-type-v={ctv}) needs flash-attn on/auto"
    # src/llama-context.cpp llama_init_from_model: "SPLIT_MODE_TENSOR requires flash_attn to be enabled"
    if params.get("flash-attn") == "off" and params.get("split-mode") == TENSOR:
        return "split-mode=tensor needs flash-attn on/auto"
    b, ub = params.get("batch-size"), params.get("ubatch-size")
    # src/llama-context.cpp: n_ubatch = min(n_batch, n_ubatch), so the run would repeat ubatch-size = batch-size.
    if b is not None and ub is not None and b < ub:
        return (
            f"batch-size={b} < ubatch-size={ub}: llama.cpp clamps -ub to -b, a duplicate of batch-size=ubatch-size={b}"
        )
    return None


def _dim_toml(dim: Dimension) -> str:
    if dim.auto:
        return '"auto"'
    if dim.values is None:
        return _toml({"low": dim.low, "high": dim.high})
    return _toml(list(dim.values))


def _toml(value: Any, depth: int = 0) -> str:
    """A value as the user wrote it in TOML, for error messages: on one line (keys quoted unless bare), nesting past
    a few levels elided (hundreds of levels would exceed Python's recursion limit)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[...]" if depth > 4 else "[" + ", ".join(_toml(v, depth + 1) for v in value) + "]"
    if isinstance(value, dict):
        if depth > 4:
            return "{...}"
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml(v, depth + 1)}" for k, v in value.items()) + "}"
    return str(value)


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)
