"""Property tests: the demo model's real header, mutated (bytes flipped, counts of 2^32…2^64, truncated, tensors
renamed, types and hyperparameters replaced), read as `fitter estimate` reads it: header, model spec, the estimate
on no GPU and on a GPU, the table and the JSON. Each either succeeds or fails with one line of FitterError naming
the file (or the flag, for a quantized cache the model's heads cannot take); nothing else escapes, no example runs
away in time or memory (tests.properties.bounded)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fitter import LLAMA_CPP_TARGET
from fitter.errors import FitterError, LaunchConfigError
from fitter.flags import parse_launch_flags
from fitter.flags.pin import pin
from fitter.gguf.header import read_header
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import CPU_AVX2
from fitter.memory.backends.registry import parse_devices
from fitter.memory.plan.estimator import estimate
from fitter.memory.plan_render import plan_json, plan_table
from tests.gguf.fields import Field, header_fields
from tests.models import model_file
from tests.properties import assert_one_line_naming, bounded, examples

pytestmark = pytest.mark.properties  # all their examples: FITTER_ALL_EXAMPLES=1 (tests/properties.py)

DEMO = model_file("demo", sparse=True)
HEADER = DEMO.read_bytes()[: read_header(DEMO).shards[0].data_offset]
FIELDS = header_fields(HEADER)
# The data region stays where it was (a file hole): a mutant whose header grew still finds its tensors' bytes.
FILE_SIZE = DEMO.stat().st_size + (1 << 20)
# f16 caches on the CPU; quantized ones (with their Hadamard rotation of K) on a GPU
RUNS = ((parse_launch_flags(["-c", "512"]), parse_devices("none")),
        (parse_launch_flags(["-c", "512", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]), parse_devices("cuda:4096")))

COUNTS = ("tensor_count", "kv_count", "key_length", "value_length", "item_length", "array_length",
          "tensor_name_length")
TYPES = ("value_type", "array_type", "ggml_type", "n_dims")
HUGE = st.one_of(st.sampled_from([2**32 - 1, 2**32, 2**60, 2**63 - 1, 2**63, 2**64 - 1]),
                 st.integers(2**32, 2**64 - 1))


def _of(*kinds: str) -> list[Field]:
    return [f for f in FIELDS if f.kind in kinds]


def _with(header: bytes, field: Field, value: int) -> bytes:
    raw = (value % (1 << 8 * field.size)).to_bytes(field.size, "little")
    return header[: field.offset] + raw + header[field.offset + field.size :]


@pytest.fixture(scope="module")
def mutant(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf") / "mutant.gguf"


def estimate_as_the_cli_does(path: Path, header: bytes) -> None:
    path.write_bytes(header)
    os.truncate(path, FILE_SIZE)
    with bounded():
        try:
            spec = load_model_spec(str(path))
        except FitterError as e:
            assert_one_line_naming(e, str(path))
            return
        for config, devices in RUNS:
            try:
                plan = estimate(spec, config, devices, CPU_AVX2)
                plan_table(plan, LLAMA_CPP_TARGET, per_tensor=True)
                plan_json(plan, LLAMA_CPP_TARGET)
            except LaunchConfigError as e:  # the flags against this model: a quantized cache that cannot tile a head
                assert_one_line_naming(e, *pin(config, given=True))
            except FitterError as e:
                assert_one_line_naming(e, str(path))


def test_the_demo_header_itself_is_estimated() -> None:
    assert [f.kind for f in FIELDS[:4]] == ["magic", "version", "tensor_count", "kv_count"]
    assert len(HEADER) - 32 < FIELDS[-1].offset <= len(HEADER)  # the data region starts aligned to 32
    spec = load_model_spec(str(DEMO))
    assert (spec.n_layer, len(spec.tensors)) == (8, 155)


@settings(max_examples=examples(300))
@given(st.lists(st.tuples(st.integers(0, len(HEADER) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_flipped_bytes(mutant: Path, flips: list[tuple[int, int]]) -> None:
    header = bytearray(HEADER)
    for offset, byte in flips:
        header[offset] = byte
    estimate_as_the_cli_does(mutant, bytes(header))


@settings(max_examples=examples(300))
@given(st.sampled_from(_of(*COUNTS)), HUGE)
def test_huge_counts_and_lengths(mutant: Path, field: Field, value: int) -> None:
    estimate_as_the_cli_does(mutant, _with(HEADER, field, value))


@settings(max_examples=examples(200))
@given(st.sampled_from(FIELDS), st.integers(-9, 9))
def test_truncated_at_every_kind_of_field(mutant: Path, field: Field, shift: int) -> None:
    estimate_as_the_cli_does(mutant, HEADER[: max(0, field.offset + shift)])


NAMES = _of("tensor_name")
TENSOR_NAMES = sorted({HEADER[f.offset : f.offset + f.size].decode() for f in NAMES})


@st.composite
def renamed(draw: st.DrawFn) -> tuple[Field, str]:
    field = draw(st.sampled_from(NAMES))
    old = HEADER[field.offset : field.offset + field.size].decode()
    base = old.split(".", 2)[-1] if old.startswith("blk.") else old
    new = draw(st.one_of(
        st.sampled_from(TENSOR_NAMES),  # a duplicate of another tensor
        st.integers(0, 600).map(lambda il: f"blk.{il}.{base}"),  # another block, maybe past block_count
        st.sampled_from(["attn_k", "attn_q", "ffn_up_exps", "output", "token_embd"]).map(
            lambda part: old.replace(part, "x" * len(part))),  # a tensor the graph needs, gone
        st.text(max_size=40),  # anything at all
    ))
    return field, new


@settings(max_examples=examples(250))
@given(renamed())
def test_renamed_tensors(mutant: Path, rename: tuple[Field, str]) -> None:
    field, name = rename
    raw = name.encode()
    length = FIELDS[FIELDS.index(field) - 1]  # the name's length prefix
    header = HEADER[: length.offset] + struct.pack("<Q", len(raw)) + raw + HEADER[field.offset + field.size :]
    estimate_as_the_cli_does(mutant, header)


@settings(max_examples=examples(200))
@given(st.sampled_from(_of(*TYPES)), st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1)))
def test_bad_types_and_dimension_counts(mutant: Path, field: Field, value: int) -> None:
    estimate_as_the_cli_does(mutant, _with(HEADER, field, value))


def _integers(kind: str) -> list[Field]:
    return [f for f in _of(kind) if f.fmt in ("<B", "<b", "<H", "<h", "<I", "<i", "<Q", "<q")]


@settings(max_examples=examples(250))
@given(st.sampled_from(_integers("value")), st.one_of(
    st.integers(0, 9), st.sampled_from([255, 511, 512, 513, 2**16, 2**31, 2**32 - 1]), HUGE, st.integers(-(2**63), -1)))
def test_replaced_hyperparameters(mutant: Path, field: Field, value: int) -> None:
    """Block count, heads, head sizes, experts, context, window, ... (every integer the header holds as a value)."""
    estimate_as_the_cli_does(mutant, _with(HEADER, field, value))


@settings(max_examples=examples(200))
@given(st.sampled_from(_integers("dim") + _integers("data_offset")),
       st.one_of(st.integers(0, 9), st.integers(-(2**63), 2**64 - 1)))
def test_replaced_dimensions_and_data_offsets(mutant: Path, field: Field, value: int) -> None:
    estimate_as_the_cli_does(mutant, _with(HEADER, field, value))
