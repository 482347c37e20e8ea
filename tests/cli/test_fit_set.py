"""`fitter fit` for several models loaded together: the set fitted jointly, written as a router preset, and the
preset loaded by llama-server's own router on the emulated GPU (every model, each to the byte of its plan)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from fitter.cli.fit_set import set_preset, set_sections
from fitter.flags import parse_launch_flags
from fitter.flags.models_preset import read_models_preset
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.fit.joint import SetModel, joint_fit
from fitter.ports import pick_free_port
from tests.models import model_file


def _call(url: str, body: dict[str, Any] | None = None) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode() if body is not None else None,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _status(port: int) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in _call(f"http://127.0.0.1:{port}/models")["data"]}


def _until(what: Any, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if what():
                return
        except (urllib.error.URLError, ConnectionError):  # the router starting, or busy stopping a child
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(0.2)


def test_a_router_preset_reads_back_as_each_models_flags(tmp_path: Path) -> None:
    a, b = model_file("demo"), model_file("gpt-oss-tiny")
    preset = tmp_path / "set.ini"
    preset.write_text(f"[*]\nc = 2048 ; every model\nflash-attn = on\n\n[a]\nmodel = {a}\nn-cpu-moe = 2\n"
                      f"no-kv-offload = true\n\n[b]\nmodel = {b}\nkv-offload = false\ncache-type-k = q8_0\n"
                      "mmap = off\n")
    models = read_models_preset(preset)
    assert [(m.name, m.model) for m in models] == [("a", str(a)), ("b", str(b))]
    assert models[0].flags == ("-c", "2048", "-fa", "on", "-ncmoe", "2", "-nkvo")
    assert models[1].flags == ("-c", "2048", "-fa", "on", "-nkvo", "-ctk", "q8_0", "--no-mmap")
    assert parse_launch_flags(list(models[1].flags)).load_mode == "none"
    preset.write_text(f"[a]\nmodel = {a}\nport = 8080\n")
    with pytest.raises(Exception, match=r"set.ini:3: \[a\] port: not an option fitter prices"):
        read_models_preset(preset)


@pytest.mark.tools("llama-server")
def test_the_router_loads_every_model_of_the_fitted_preset_to_the_byte(llama_tools: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    from fitter.measure.runners import emulated_gpus

    files = [str(model_file("demo")), str(model_file("gpt-oss-tiny"))]
    base = parse_launch_flags(["-c", "2048", "-np", "1"])
    models = [SetModel(Path(f).stem, f, load_model_spec(f), base) for f in files]
    with emulated_gpus("rpc", (160,)) as gpu:
        fitted = joint_fit(models, gpu.devices(), (16,), models_max=1)
        assert fitted.fits
        preset = tmp_path / "set.ini"
        preset.write_text(set_preset(set_sections(models, fitted, gpu.endpoints), fitted))
        port = pick_free_port("the router")
        log = (tmp_path / "router.log").open("w")
        router = subprocess.Popen([str(llama_tools["llama-server"]), "--models-preset", str(preset),
                                   "--models-max", "1", "--no-models-autoload", "--port", str(port)],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            _until(lambda: _status(port))
            device = gpu.devices()[0].name
            for m, r in zip(models, fitted.results, strict=True):
                assert gpu.wait_until_empty(60)
                gpu.reset_peak()
                _until(lambda m=m: _call(f"http://127.0.0.1:{port}/models/load", {"model": m.name})["success"])
                _until(lambda m=m: _status(port)[m.name] == "loaded")
                assert gpu.peaks()[device] == r.plan.totals()[device].total  # its plan, to the byte
                _until(lambda m=m: _call(f"http://127.0.0.1:{port}/models/unload", {"model": m.name})["success"])
                _until(lambda m=m: _status(port)[m.name] == "unloaded")
        finally:
            router.send_signal(signal.SIGINT)
            assert router.wait(30) == 0


def test_fit_takes_several_models_and_writes_the_set_as_a_router_preset(tmp_path: Path) -> None:
    import sys

    a, b = model_file("demo"), model_file("gpt-oss-tiny")
    preset = tmp_path / "set.ini"
    run = subprocess.run([sys.executable, "-m", "fitter.cli", "fit", str(a), str(b), "--devices", "cuda:1200",
                          "--fit-target", "16", "-c", "4096", "--write-preset", str(preset)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == "2 models loaded together (--models-max all): fits"
    assert [(m.name, m.model) for m in read_models_preset(preset)] == [("demo", str(a)), ("gpt-oss-tiny", str(b))]
    run = subprocess.run([sys.executable, "-m", "fitter.cli", "fit", str(a), str(a), "--devices", "cuda:1200"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "two models of one name" in run.stderr
