"""`fitter tune --min-ctx N`: the context searched from N up, a Pareto axis beside speed and VRAM, the table showing
what each larger context costs; refused where it cannot be searched. On a simulated 8 GB GPU with gpt-oss-20b's
real shape (a header-only file), where a larger context pushes experts to the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.errors import FitterError
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.grid.replay_tune import run_replay
from fitter.results.pareto import load_result
from fitter.results.table import pareto_table
from fitter.tune.options import TuneOptions
from fitter.tune.session import run_tune
from fitter.workload import Workload, searched_context
from tests.models import model_file
from tests.tune.options import tune_options, with_options

MIN_CTX = 32768


def _options(tmp_path: Path, workload: Workload, flags: list[str] = (), **kw: object) -> TuneOptions:
    model = str(model_file("gpt-oss-20b", sparse=True))
    base = searched_context(workload, parse_launch_flags(["-fa", "on", *flags]))
    return tune_options(model=model, spec=load_model_spec(model), base=base, workload=workload, trials=10,
                       repetitions=2, confirm_rounds=2, results=tmp_path / "r", backend="sim",
                       machine="gpu-8gb", **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def widening(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("ctx")
    outcome = run_tune(_options(tmp, Workload(n_prompt=256, n_gen=32, min_ctx=MIN_CTX)), None)
    assert outcome.folder is not None
    return outcome.folder


def test_the_context_is_searched_from_the_minimum_to_the_training_context_as_an_objective(widening: Path) -> None:
    doc = json.loads((widening / "pareto.json").read_text())
    assert doc["objectives"] == ["tg", "pp", "vram", "ctx"]
    assert doc["workload"]["min_ctx"] == MIN_CTX
    contexts = {e["n_ctx"] for e in doc["pareto"]}
    assert contexts <= {32768, 65536, 98304, 131072} and len(contexts) > 1
    for e in doc["pareto"]:
        flags = e["flags"]
        assert flags.count("-c") == 1 and int(flags[flags.index("-c") + 1]) == e["n_ctx"]


def test_on_the_front_a_larger_context_is_paid_for_in_decode_speed_or_vram(widening: Path) -> None:
    doc = json.loads((widening / "pareto.json").read_text())
    front = [e for e in doc["pareto"] if e["phase"] != "baseline"]
    for e in front:  # what the front keeps at a smaller context is faster, or holds less VRAM, than a larger one
        for o in front:
            if o["n_ctx"] < e["n_ctx"]:
                assert (o["measurement"]["tg"]["avg_ts"] > e["measurement"]["tg"]["avg_ts"]
                        or o["measurement"]["pp"]["avg_ts"] > e["measurement"]["pp"]["avg_ts"]
                        or o["vram_bytes"] < e["vram_bytes"])


def test_the_max_context_pick_is_the_largest_context_within_5_percent_of_the_best_decode(widening: Path) -> None:
    result = load_result(widening)
    best_tg = max(e.speed("tg") or 0 for e in result.pareto)
    near = [e for e in result.pareto if (e.speed("tg") or 0) >= 0.95 * best_tg]
    pick = result.entry("max-context")
    assert pick.n_ctx == max(e.n_ctx or 0 for e in near)


def test_the_table_shows_each_context_and_what_it_costs_against_the_smallest(widening: Path) -> None:
    result = load_result(widening)
    text = pareto_table(result)
    assert text.splitlines()[0].startswith(f"{'trial':>5}  {'pp t/s':>9} {'tg t/s':>8} {'VRAM MiB':>9} {'ctx':>7}")
    assert "context: the front's fastest decode at each context, against the smallest's" in text
    rows = text.split("tg× the smallest's [95 % CI]\n")[1].split("\n\n")[0].splitlines()
    contexts = sorted({e.n_ctx for e in result.pareto if e.n_ctx})
    assert [int(r.split()[0]) for r in rows] == contexts
    assert rows[0].endswith("  1") and all(f"for +{c - contexts[0]} cells" in r for c, r in zip(contexts[1:], rows[1:],
                                                                                               strict=True))


def test_min_ctx_beside_a_fixed_context_is_refused() -> None:
    with pytest.raises(FitterError, match=r"^flags: min_ctx 32768 searches the context, and -c 8192 fixes it: give "
                                          r"one or the other$"):
        searched_context(Workload(min_ctx=MIN_CTX), parse_launch_flags(["-c", "8192"]))


def test_min_ctx_past_the_training_context_or_on_a_replay_and_a_ctx_objective_without_it_are_refused(
        tmp_path: Path) -> None:
    with pytest.raises(FitterError, match=r"^--min-ctx 262144: more than the model's training context \(131072\)$"):
        run_tune(_options(tmp_path, Workload(min_ctx=262144)), None)
    with pytest.raises(FitterError, match=r"^flags: a replayed landscape holds the contexts it recorded: drop "
                                          r"--min-ctx$"):
        run_replay(with_options(_options(tmp_path, Workload(min_ctx=MIN_CTX)), backend="replay"))
    with pytest.raises(FitterError, match=r"^--objectives ctx: the context is an objective where it is searched: "
                                          r"give --min-ctx N$"):
        run_tune(_options(tmp_path, Workload(), objectives=("tg", "ctx")), None)


def test_the_cli_takes_min_ctx_and_refuses_it_beside_c_and_in_bench(tmp_path: Path) -> None:
    def fitter(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fitter.cli", *args], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)

    proc = fitter("tune", "--backend", "sim", "--machine", "gpu-8gb", "--min-ctx", "4096", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "ctx-size: CategoricalDistribution(choices=(4096, 8192))" in proc.stdout  # the demo model's 8192
    proc = fitter("tune", "--backend", "sim", "--machine", "gpu-8gb", "--min-ctx", "4096", "-c", "2048", "--dry-run")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("fitter: error: flags: min_ctx 4096 searches the context, and -c 2048 fixes it: "
                                   "give one or the other")
    (tmp_path / "w.toml").write_text("min_ctx = 4096\n")
    proc = fitter("bench", "--backend", "sim", "--machine", "gpu-8gb", "--workload", str(tmp_path / "w.toml"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"fitter: error: {tmp_path / 'w.toml'}: min_ctx 4096 asks for a search of the "
                                   "context, which only `fitter tune` does; bench measures the -c you give")
