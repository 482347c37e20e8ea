"""`fitter check` on a result tuned on a simulated machine: the machine's profile changes, the check notices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.sim import MACHINES_DIR
from tests.models import model_file

# a simulated tune of gpt-oss-20b, then checks of it: ~40 s:
# deselected by the default test command, run by .ci/run (pytest -m slow)
pytestmark = pytest.mark.slow


def fitter(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fitter.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    tmp = tmp_path_factory.mktemp("simcheck")
    profile = tmp / "box.toml"
    profile.write_text((MACHINES_DIR / "gpu-8gb.toml").read_text())
    model = str(model_file("gpt-oss-20b", sparse=True))
    proc = fitter("tune", model, "--backend", "sim", "--machine", str(profile), "-c", "8192", "-fa", "on",
                  "--trials", "4", "--llama-fit-params", "/nonexistent/llama-fit-params", "--results",
                  str(tmp / "results"), cwd=tmp)
    assert proc.returncode == 2 and "'/nonexistent/llama-fit-params': not an executable file" in proc.stderr
    assert not (tmp / "results").exists()  # refused before any study was opened
    proc = fitter("tune", model, "--backend", "sim", "--machine", str(profile), "-c", "8192", "-fa", "on",
                  "--trials", "4", "--results", str(tmp / "results"), cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    (pareto,) = (tmp / "results").glob("*/*/*/pareto.json")
    return pareto.parent, profile, model


def test_the_same_machine_passes(tuned: tuple[Path, Path, str]) -> None:
    result, _, _ = tuned
    proc = fitter("check", str(result), "--policy", "max-decode", cwd=result)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "recorded with sim-box (sim), re-measured with sim-box (sim)" in proc.stdout
    assert proc.stdout.rstrip().endswith("check: PASS")


def test_slower_ram_fails_the_decode_check(tuned: tuple[Path, Path, str]) -> None:
    result, profile, _ = tuned
    original = profile.read_text()
    try:
        profile.write_text(original.replace("mts = 3200", "mts = 2133"))  # a BIOS reset to JEDEC speed
        proc = fitter("check", str(result), "--policy", "max-decode", "--json", cwd=result)
    finally:
        profile.write_text(original)
    verdict = json.loads(proc.stdout)
    assert proc.returncode == 1 and not verdict["ok"]
    assert any(f.startswith("tg ") for f in verdict["failures"])


def test_a_smaller_gpu_no_longer_fits(tuned: tuple[Path, Path, str]) -> None:
    result, profile, _ = tuned
    original = profile.read_text()
    try:
        profile.write_text(original.replace("memory_gib = 8", "memory_gib = 4"))
        proc = fitter("check", str(result), "--policy", "max-decode", cwd=result)
    finally:
        profile.write_text(original)
    assert proc.returncode == 1
    assert "FAIL  no longer fits (out of memory): oom: " in proc.stdout  # the machine refuses it
    fit_line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("fit  CUDA0"))
    assert "(free 3686.40 − fit target 1024 MiB)" in fit_line and fit_line.endswith("FAIL")  # and so does the estimate
