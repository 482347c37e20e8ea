"""Property tests: search-space files as `fitter tune --space FILE` reads them (load_space, resolve for a model and
a machine, a trial's flags from the resolved distributions). Generated documents keep the file's structure with
hostile values (random keys, wrong types, huge ranges, unicode, NaN and inf), and the shipped spaces' text is cut
and spliced. Each either loads or fails with one line of SearchSpaceError naming the file; nothing else escapes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optuna.distributions import CategoricalDistribution, IntDistribution

from fitter.errors import FitterError
from fitter.flags import KV_CACHE_TYPES, parse_flags
from fitter.flags.config import LOAD_MODES
from fitter.paths import SOURCE_ROOT
from fitter.search.space import (
    FIXED_ON_COMMAND_LINE,
    FLAGLESS,
    FLASH_ATTN_VALUES,
    KEYS,
    SHIPPED,
    THREAD_SYMBOLS,
    is_valid_combination,
    load_space,
    params_to_flags,
    resolve,
)
from tests.properties import assert_one_line_naming, bounded, examples


class Raw(str):
    """TOML text put in as it is (nesting deeper than any generated list, an integer of 5000 digits)."""


def toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped, everything else as it is."""
    return '"' + "".join(c if c >= " " and c not in '"\\\x7f' else f"\\u{ord(c):04x}" for c in text) + '"'


def toml_value(value: Any) -> str:
    """A value as TOML text (floats that are not finite as nan and inf)."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_document(doc: dict[str, Any]) -> str:
    lines = [f"{toml_string(k)} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines += [f"[{toml_string(k)}]", *(f"{toml_string(kk)} = {toml_value(vv)}" for kk, vv in v.items())]
    return "\n".join(lines) + "\n"


TEXT = st.one_of(st.text(max_size=12), st.sampled_from(["", "a\nb", "\r\n", "\t", "\x00", "\x1b[2J", "\u2028", "ä",
                                                        "'", '"', "\\", "=", "[params]"]))
WORDS = st.sampled_from([*KV_CACHE_TYPES, *FLASH_ATTN_VALUES, *THREAD_SYMBOLS, "0", "-1", "F16"])
INTS = st.one_of(st.integers(-3, 9), st.sampled_from([512, 4096, 2**31, 2**63, 2**64, 10**300]),
                 st.integers(-(2**70), 2**70))
RAW = st.one_of(st.integers(1, 3000).map(lambda n: Raw("[" * n + "]" * n)),
                st.integers(4000, 5000).map(lambda n: Raw("9" * n)),
                st.sampled_from([Raw("1979-05-27T07:32:00Z"), Raw("0x7fffffffffffffffffff"), Raw("1e999"),
                                 Raw("-nan"), Raw("{}"), Raw("[]")]))
SCALARS = st.one_of(INTS, WORDS, TEXT, st.floats(), st.booleans())
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.sampled_from(["low", "high"]) | TEXT, inner, max_size=3)),
    max_leaves=12) | RAW
# What each key accepts, so that many documents load and go on to resolve and to a trial's flags.
COUNTS = st.integers(0, 600) | st.sampled_from([2**31, 2**64, 10**30])
RANGE = st.fixed_dictionaries({"low": COUNTS, "high": COUNTS})
THREADS = st.lists(st.integers(1, 512) | st.sampled_from(THREAD_SYMBOLS), min_size=1, max_size=4, unique=True)
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "n-cpu-moe": st.just("auto") | RANGE | st.lists(COUNTS, min_size=1, max_size=5, unique=True),
    "n-gpu-layers": st.just("auto") | RANGE | st.lists(COUNTS, min_size=1, max_size=5, unique=True),
    "expert-order": st.lists(st.sampled_from(["first", "last"]), min_size=1, max_size=2, unique=True),
    "batch-size": st.lists(st.integers(1, 2**40), min_size=1, max_size=5, unique=True),
    "ubatch-size": st.lists(st.integers(1, 2**40), min_size=1, max_size=5, unique=True),
    "cache-type-k": st.lists(st.sampled_from(list(KV_CACHE_TYPES)), min_size=1, max_size=4, unique=True),
    "cache-type-v": st.lists(st.sampled_from(list(KV_CACHE_TYPES)), min_size=1, max_size=4, unique=True),
    "flash-attn": st.lists(st.sampled_from(FLASH_ATTN_VALUES), min_size=1, max_size=3, unique=True),
    "load-mode": st.lists(st.sampled_from(LOAD_MODES), min_size=1, max_size=3, unique=True),
    "kv-offload": st.lists(st.booleans(), min_size=1, max_size=2, unique=True),
    "split-mode": st.lists(st.sampled_from(["layer", "tensor"]), min_size=1, max_size=2, unique=True),
    "threads": THREADS | RANGE,
    "threads-batch": THREADS | RANGE,
}
PARAM_VALUES = st.one_of(
    st.lists(st.one_of(INTS, WORDS), min_size=1, max_size=6, unique=True),  # choices of the wrong kind
    st.dictionaries(st.sampled_from(["low", "high"]) | TEXT, INTS, min_size=1, max_size=3),  # a range, or nearly
    st.just("auto"),
    VALUES,
)
PARAM_KEYS = st.one_of(st.sampled_from(sorted(FIXED_ON_COMMAND_LINE)),
                       st.sampled_from(["ub", "ngl", "thread", "ctx_size", "n_gpu_layers"]), TEXT)
PARAMS = st.lists(st.one_of(
    st.sampled_from(KEYS).flatmap(lambda k: st.tuples(st.just(k), PLAUSIBLE[k])),  # twice as likely
    st.sampled_from(KEYS).flatmap(lambda k: st.tuples(st.just(k), PLAUSIBLE[k])),
    st.tuples(st.sampled_from(KEYS), PARAM_VALUES),
    st.tuples(PARAM_KEYS, PARAM_VALUES),
), max_size=6).map(dict)
DOCUMENTS = st.one_of(
    st.fixed_dictionaries({"params": PARAMS}, optional={"description": TEXT}),
    st.fixed_dictionaries({"params": PARAMS}, optional={"description": VALUES}),
    st.dictionaries(TEXT | st.sampled_from(["params", "description"]), VALUES, max_size=3),  # any document at all
)

pytestmark = pytest.mark.properties  # all their examples: FITTER_ALL_EXAMPLES=1 (tests/properties.py)
MACHINES = st.fixed_dictionaries({"n_layer": st.integers(1, 512), "physical_cores": st.integers(1, 256),
                                  "performance_cores": st.integers(1, 256)})


@pytest.fixture(scope="module")
def space_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spaces") / "space.toml"


def tune_reads(path: Path, text: str, machine: dict[str, int], data: st.DataObject) -> None:
    """load_space, resolve, then one trial's flags from the distributions: the flags of a combination llama.cpp
    accepts must parse."""
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    with bounded():
        try:
            dists = resolve(load_space(path), **machine)
        except FitterError as e:
            assert_one_line_naming(e, str(path))
            return
        params: dict[str, Any] = {}
        for key, d in dists.items():
            if isinstance(d, CategoricalDistribution):
                params[key] = data.draw(st.sampled_from(d.choices))
            else:
                assert isinstance(d, IntDistribution)
                params[key] = data.draw(st.integers(d.low, d.high))
        flags = params_to_flags({k: v for k, v in params.items() if k not in FLAGLESS})
        if is_valid_combination(params) is None:
            parse_flags(flags)


@settings(max_examples=examples(500))
@given(DOCUMENTS, MACHINES, st.data())
def test_generated_documents(space_file: Path, doc: dict[str, Any], machine: dict[str, int],
                             data: st.DataObject) -> None:
    tune_reads(space_file, toml_document(doc), machine, data)


SHIPPED_TEXT = [(SOURCE_ROOT / "search_spaces" / f"{name}.toml").read_text() for name in SHIPPED]


@st.composite
def spliced(draw: st.DrawFn) -> str:
    """A shipped space's text with a few pieces cut out or put in (the TOML syntax itself, broken)."""
    text = draw(st.sampled_from(SHIPPED_TEXT))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 20))
        piece = draw(st.one_of(st.sampled_from(["[", "]", "{", "}", "=", ",", '"', "\n", "[params]", "[[params]]",
                                                "\\", "#", "'''", "\x00", "9" * 5000, "[" * 2000]),
                               st.text(max_size=8)))
        text = text[:at] + piece + text[at + cut:]
    return text


@settings(max_examples=examples(300))
@given(spliced(), MACHINES, st.data())
def test_spliced_shipped_spaces(space_file: Path, text: str, machine: dict[str, int], data: st.DataObject) -> None:
    tune_reads(space_file, text, machine, data)
