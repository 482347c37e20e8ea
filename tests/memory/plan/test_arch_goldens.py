"""The estimator against llama.cpp on its own tiny model of every architecture (tests/golden/archs.json, from
scripts/make_arch_goldens.py: llama.cpp's tests/test-llama-archs.cpp builds them, llama.cpp loads them CPU-only).

An architecture with a row in fitter.gguf.archs must match llama.cpp's model, KV (and recurrent state) and output
buffers to the logged 0.01 MiB; one whose graph fitter rebuilds (GRAPH_ARCHS) its compute buffer within 0.5 % beyond
the log's rounding to 0.01 MiB. Every
other architecture must be named in the spec's warning, never estimated silently. The models are rebuilt from their
headers as sparse files (the estimate reads nothing else).
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from fitter.errors import LaunchConfigError
from fitter.flags import parse_launch_flags
from fitter.gguf.archs import ARCHS
from fitter.gguf.header import read_header
from fitter.gguf.model_spec import ModelSpec, load_model_spec
from fitter.memory.backends.devices import CPU_AVX2
from fitter.memory.graph.graphs import GRAPH_ARCHS
from fitter.memory.plan.estimator import estimate
from tests.memory.plan.test_golden import MIB, _by_kind

_DIR = Path(__file__).resolve().parents[2] / "golden"
GOLDEN = json.loads((_DIR / "archs.json").read_text())
CASES = [c for c in GOLDEN["cases"] if c["outcome"] == "ok"]
REFUSED = [c for c in GOLDEN["cases"] if c["outcome"] == "error"]
_specs: dict[str, ModelSpec] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama-archs")
    with tarfile.open(_DIR / GOLDEN["headers"]) as tar:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            path = folder / member.name
            with path.open("wb") as f:
                f.write(data)
                f.truncate(GOLDEN["models"][path.stem]["size"])  # sparse: the tensor data is never read
    return folder


def spec_of(models: Path, model: str) -> ModelSpec:
    if model not in _specs:
        _specs[model] = load_model_spec(str(models / f"{model}.gguf"))
    return _specs[model]


def arch_of(models: Path, model: str) -> str:
    return str(read_header(str(models / f"{model}.gguf")).metadata["general.architecture"])


def _estimated(models: Path, case: dict[str, Any]) -> dict[tuple[str, str], list[float]]:
    plan = estimate(spec_of(models, case["model"]), parse_launch_flags(case["flags"]), (), CPU_AVX2)
    return _by_kind([(b.buft, b.kind, b.bytes / MIB) for b in plan.buffers])


def _logged(case: dict[str, Any]) -> dict[tuple[str, str], list[float]]:
    return _by_kind([(b["buft"], b["kind"], b["mib"]) for b in case["buffers"]])


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_model_kv_and_output_match_llama_cpp_for_every_architecture_with_rules(models: Path,
                                                                               case: dict[str, Any]) -> None:
    spec = spec_of(models, case["model"])
    if spec.arch not in ARCHS:
        assert any(f"architecture {spec.arch!r} has no memory rules" in w for w in spec.warnings)
        return
    est, gold = _estimated(models, case), _logged(case)
    assert {k: [round(x, 2) for x in v] for k, v in est.items() if k[1] != "compute"} == {
        k: v for k, v in gold.items() if k[1] != "compute"}


@pytest.mark.parametrize("case", REFUSED, ids=[c["id"] for c in REFUSED])
def test_configs_llama_cpp_refused_are_refused_before_loading(models: Path, case: dict[str, Any]) -> None:
    with pytest.raises(LaunchConfigError):
        estimate(spec_of(models, case["model"]), parse_launch_flags(case["flags"]), (), CPU_AVX2)


def _arch(case: dict[str, Any]) -> str:
    return str(GOLDEN["models"][case["model"]]["arch"])


@pytest.mark.parametrize("case", [c for c in CASES if _arch(c) in GRAPH_ARCHS], ids=lambda c: c["id"])
def test_compute_within_half_a_percent_where_fitter_rebuilds_the_graph(models: Path, case: dict[str, Any]) -> None:
    est, gold = _estimated(models, case), _logged(case)
    (g,), (e,) = gold[("CPU", "compute")], est[("CPU", "compute")]
    assert abs(e - g) <= 0.005 * g + 0.005, f"estimated {e:.2f} MiB, llama.cpp {g:.2f} MiB"


def test_every_row_of_the_table_has_goldens() -> None:
    """A row of fitter.gguf.archs without a model here would be a rule no golden checks."""
    built = {m["arch"] for m in GOLDEN["models"].values()}
    assert sorted(set(ARCHS) - built) == []
    assert set(GRAPH_ARCHS) <= set(ARCHS)


def test_the_models_are_llama_cpps_own(models: Path) -> None:
    assert GOLDEN["llama_cpp_commit"] == "0c1e570"
    assert sorted(p.stem for p in models.iterdir()) == sorted(GOLDEN["models"])
    assert {m: arch_of(models, m) for m in GOLDEN["models"]} == {m: v["arch"] for m, v in GOLDEN["models"].items()}


def test_glm_dsa_indexer_layers_follow_the_key_else_the_release(models: Path) -> None:
    # src/models/glm-dsa.cpp: `attention.indexer.types` when the file has it; without it every layer of a GLM-5 or
    # 5.1, and GLM-5.2's default (layers 0 and 1, then every 4th) for a training context of 1048576 or more
    from fitter.gguf.model_spec import model_spec

    header = read_header(str(models / "glm-dsa-moe.gguf"))

    def layers(**keys: object) -> tuple[bool, ...]:
        meta = {k: v for k, v in header.metadata.items() if k != "glm-dsa.attention.indexer.types"}
        meta["glm-dsa.block_count"] = 8
        meta.update({f"glm-dsa.{k.replace('__', '.')}": v for k, v in keys.items()})
        changed = type(header)(header.path, header.shards, meta, header.tensors, header.identity)
        return model_spec(changed).indexer_layers

    on, off = True, False
    assert layers(context_length=202752) == (on,) * 8
    assert layers(context_length=1048576) == (on, on, on, off, off, off, on, off)
    assert layers(context_length=1048576, attention__indexer__types=[1, 0, 0, 0, 0, 0, 0, 1]) == (
        on, off, off, off, off, off, off, on)
