"""fitter.memory.graph.families.llama_like against llama.cpp: the tiny models of tests/golden/archs.json (their own
test checks every config) with a key set that those models leave at zero, so the graph takes a path they do not:
deepstack layers (qwen3vl, qwen3vlmoe) and mistral3's attention temperature. The bytes are the CPU compute buffers
llama.cpp 0c1e570 reserved for these files (ggml_backend_sched_get_buffer_size on a real load)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import CPU_AVX2
from fitter.memory.plan.estimator import estimate
from tests.memory.plan.test_arch_goldens import models  # noqa: F401 (the fixture)

CONFIGS = {  # archs.json's
    "c256": ["-c", "256", "-ngl", "0"],
    "ub64-nofa": ["-c", "256", "-ngl", "0", "-ub", "64", "-b", "128", "-fa", "off"],
    "np2-q8": ["-c", "256", "-ngl", "0", "-np", "2", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"],
}


def with_keys(models: Path, model: str, out: Path, **keys: Any) -> Path:  # noqa: F811
    """The tiny model's file with `{arch}.<key>` set (its type kept; `__` in a name stands for a dot)."""
    reader = gguf.GGUFReader(models / f"{model}.gguf")
    arch = reader.fields["general.architecture"].contents()
    new = {}
    for name, value in keys.items():
        field = reader.fields[f"{arch}.{name.replace('__', '.')}"]
        new[field.name] = MetadataDetails(field.types[0], value)
    empty = [f.name for f in reader.fields.values() if f.types and f.types[0] == gguf.GGUFValueType.ARRAY
             and f.contents() == []]  # the saver writes empty arrays, which gguf's writer refuses: llama.cpp reads none
    path = out / f"{model}-{'-'.join(keys)}.gguf"
    copy_with_new_metadata(reader, gguf.GGUFWriter(path, arch), new, empty)
    return path


def compute_bytes(path: Path, config: str) -> int:
    plan = estimate(load_model_spec(str(path)), parse_launch_flags(CONFIGS[config]), (), CPU_AVX2)
    (cpu,) = [b.bytes for b in plan.buffers if b.kind == "compute"]
    return cpu


@pytest.mark.parametrize(("model", "keys", "expected"), [
    # one deepstack layer: the input is 2 × n_embd wide, the token path PADded to it, its second half added to layer
    # 0's output
    ("qwen3vl-dense", {"n_deepstack_layers": 1}, {"c256": 2892832, "ub64-nofa": 886560, "np2-q8": 2974752}),
    ("qwen3vlmoe-moe", {"n_deepstack_layers": 1}, {"c256": 4076576, "ub64-nofa": 1182496, "np2-q8": 4158496}),
    # Q × inp_attn_scale [1, 1, T] after RoPE in every layer
    ("mistral3-dense", {"attention__temperature_scale": 0.1},
     {"c256": 1973280, "ub64-nofa": 656672, "np2-q8": 2186272}),
], ids=["qwen3vl-deepstack", "qwen3vlmoe-deepstack", "mistral3-temperature"])
def test_a_path_the_tiny_models_skip_reserves_what_llama_cpp_reserves(
        models: Path, tmp_path: Path, model: str, keys: dict[str, Any], expected: dict[str, int]) -> None:  # noqa: F811
    path = with_keys(models, model, tmp_path, **keys)
    assert {config: compute_bytes(path, config) for config in expected} == expected
