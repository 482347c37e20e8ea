"""fitter export --format launcher: the script, run by sh with a fake nvidia-smi and a fake llama-server on PATH,
execs the first line that fits the free memory it reads, and runs the pick as recorded without nvidia-smi."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fitter.export.launcher_script import render_launcher
from fitter.gguf.model_spec import load_model_spec
from tests.export.test_candidates import demo_result
from tests.models import model_file


def _run(tmp_path: Path, free_mib: int | None) -> tuple[int, str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "llama-server").write_text('#!/bin/sh\necho "llama-server $*"\n')
    smi = bin_dir / "nvidia-smi"
    if free_mib is not None:
        smi.write_text(f"#!/bin/sh\necho '00000000:01:00.0, {free_mib}'\n")
    elif smi.exists():
        smi.unlink()
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    script = tmp_path / "launch.sh"
    script.write_text(render_launcher(demo_result(tmp_path), "balanced", load_model_spec(str(model_file("demo")))))
    proc = subprocess.run(["/bin/sh", str(script), "--port", "8080"], capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize(("free_mib", "said", "flags"), [
    (96, "serving trial 6: needs 74.11 MiB on CUDA0", "-ub 256 -ctk f16 -ctv q8_0 -fa on -np 4 --kv-unified -ngl all "
     "-ncmoe 4"),
    (85, "serving trial 5: needs 68.73 MiB on CUDA0", "-ub 512 -ctk f16 -ctv f16 -fa on -np 4 --kv-unified -ngl all "
     "-ncmoe 6"),
    (60, "serving trial 3: needs 30.79 MiB on CUDA0", "-ub 256 -ctk q8_0 -ctv q8_0 -fa on -np 4 --kv-unified -ngl all "
     "-ncmoe 8"),
    (None, "nvidia-smi reads no GPU here: running the balanced pick (trial 6) as recorded", "-ub 256 -ctk f16 -ctv "
     "q8_0 -fa on -np 4 --kv-unified -ngl all -ncmoe 4"),
])
def test_the_script_runs_the_first_line_that_fits(tmp_path: Path, free_mib: int | None, said: str,
                                                   flags: str) -> None:
    rc, out, err = _run(tmp_path, free_mib)
    assert rc == 0
    assert err.startswith(f"launcher: {said}")
    assert out == (f"llama-server -m {model_file('demo')} -c 4096 -b 2048 {flags} -fit off -t 1 -tb 1 --port 8080\n")


def test_nothing_that_fits_runs_nothing(tmp_path: Path) -> None:
    rc, out, err = _run(tmp_path, 40)
    assert (rc, out) == (1, "")
    assert err == ("launcher: no config fits the GPUs' free memory now; the least needs 30.79 MiB on CUDA0 and the fit "
                   "target free: nothing started\n")
