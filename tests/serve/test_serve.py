"""fitter serve: refusals in one line, signals passed on, and real serves on the emulated GPU: as tuned (queried, then
stopped by SIGINT with llama-server's status) and with a second process holding part of the GPU (what it served,
and that llama.cpp allocated exactly the re-plan's bytes)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fitter import ports
from fitter.errors import FitterError
from fitter.results.pareto import load_result
from fitter.serve.choice import passed_through, tuned_model
from fitter.serve.supervise import machine_devices, run_forwarding
from fitter.units import MIB
from tests.conftest import BUILT_TOOLS
from tests.export.test_candidates import EXAMPLE
from tests.models import model_file


def _result(tmp_path: Path, model: Path | None = None, **machine: object) -> Path:
    data = json.loads(EXAMPLE.read_text())
    data["model"]["path"] = str(model or model_file("demo"))
    data["machine"].update(machine)
    (tmp_path / "pareto.json").write_text(json.dumps(data))
    return tmp_path


def test_a_result_whose_model_changed_is_refused_in_one_line(tmp_path: Path) -> None:
    other = model_file("gpt-oss-tiny")
    doc = load_result(_result(tmp_path, other))
    with pytest.raises(FitterError) as e:
        tuned_model(doc)
    assert str(e.value) == (f"{other}: not the model {tmp_path / 'pareto.json'} was tuned on (header identity "
                            f"{_identity(other)} != "
                            "def9d6cbeb039599c71b928a9175d28def2073205f91b1af193ded9d756dcd16): its configs were "
                            "measured on another file; tune it again")


def _identity(path: Path) -> str:
    from fitter.gguf.model_spec import load_model_spec

    return load_model_spec(str(path)).identity


def test_a_result_of_other_gpus_is_refused_in_one_line(tmp_path: Path) -> None:
    gpu = {"device": "CUDA0", "pci_bus_id": "00000000:01:00.0", "name": "NVIDIA GeForce RTX 4090",
           "memory_total": 25757220864}
    doc = load_result(_result(tmp_path, gpu_map=[gpu]))
    from fitter.machine.snapshot import take_snapshot

    if take_snapshot().gpus:
        pytest.skip("this machine has NVIDIA GPUs: another machine's are refused the same way")
    with pytest.raises(FitterError) as e:
        machine_devices(doc, "llama-server")
    assert str(e.value) == (f"{tmp_path / 'pareto.json'} was tuned on CUDA0=NVIDIA GeForce RTX 4090 "
                            "(00000000:01:00.0, 24564 MiB); this machine has no GPU: its placement and budgets are "
                            "for those GPUs; tune again here, or serve it with the CUDA_VISIBLE_DEVICES and "
                            "CUDA_DEVICE_ORDER it was tuned with")


def test_flags_that_change_what_a_config_allocates_are_refused() -> None:
    assert passed_through(["--port", "8080", "--jinja"]) == ["--port", "8080", "--jinja"]
    with pytest.raises(FitterError) as e:
        passed_through(["--port", "8080", "--ctx-size=8192"])
    assert str(e.value) == ("-- --ctx-size=8192: a flag the served configs pin (it changes what they allocate, "
                            "where, or how they run); after -- give what the result does not decide (--host, "
                            "--port, --api-key, --alias, --jinja, ...), or tune with it")


def test_the_child_s_exit_status_is_returned_and_a_signal_is_passed_on(tmp_path: Path) -> None:
    assert run_forwarding(["sh", "-c", "exit 3"]) == 3
    ready = tmp_path / "ready"
    child = f"trap 'exit 7' TERM; touch {ready}; while :; do sleep 0.05; done"
    sender = subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time\n"
                               f"while not os.path.exists({str(ready)!r}): time.sleep(0.02)\n"
                               f"os.kill({os.getpid()}, signal.SIGTERM)"])
    try:
        assert run_forwarding(["sh", "-c", child]) == 7  # fitter got SIGTERM, the child ended on it
    finally:
        sender.wait(timeout=30)
    assert signal.getsignal(signal.SIGTERM) is not None  # the handlers are restored


def _get(port: int, path: str, body: dict[str, object] | None = None) -> dict[str, object]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=60) as resp:
        out: dict[str, object] = json.loads(resp.read())
        return out


def _serve(result: Path, port: int, *args: str) -> subprocess.Popen[str]:
    """`fitter serve`, its stderr (and llama-server's, which it passes on) in result/serve.log: a pipe nobody reads
    would fill and stop llama-server mid-write."""
    with (result / "serve.log").open("w") as log:
        return subprocess.Popen([sys.executable, "-m", "fitter.cli", "serve", str(result), "--llama-cpp",
                                 str(BUILT_TOOLS), *args, "--", "--port", str(port)], stderr=log, text=True)


def _wait_healthy(proc: subprocess.Popen[str], port: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"fitter serve exited {proc.returncode}"
        try:
            if _get(port, "/health") == {"status": "ok"}:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("llama-server was not healthy within 120 s")


@pytest.mark.tools("llama-server")
def test_serve_on_the_emulated_gpu_answers_and_ends_with_llama_servers_status(
        tmp_path: Path, llama_tools: dict[str, Path]) -> None:
    port = ports.pick_free_port("test")
    proc = _serve(_result(tmp_path), port)
    try:
        _wait_healthy(proc, port)
        done = _get(port, "/completion", {"prompt": "Hello", "n_predict": 4, "temperature": 0})
        assert done["tokens_predicted"] == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0  # llama-server's own status after a Ctrl-C: it shut down cleanly
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "serve.log").read_text()
    assert re.search(r"fitter: serve: balanced pick \(trial 6\) needs 74\.11 MiB on RPC0\[127\.0\.0\.1:\d+\], "
                     r"96\.00 MiB free less the 16 MiB fit target: serving it\n", err), err


@pytest.mark.tools("llama-server")
@pytest.mark.parametrize(("held_mib", "served", "need"), [
    (20, "trial 3 (30.79 MiB on RPC0[{}]), decode 0.70× and prefill 0.98× of it", 32285184),
    (50, "trial 6 with -ncmoe 4 → 8, -c 4096 → 2048 (unmeasured: re-planned by the estimator) (25.61 MiB on RPC0[{}]); "
         "its speed is not known", 26849792),
])
def test_serve_beside_a_process_holding_part_of_the_gpu(tmp_path: Path, llama_tools: dict[str, Path],
                                                        held_mib: int, served: str, need: int) -> None:
    from fitter.measure.emulator.emulated_gpu import EmulatedGpu

    port = ports.pick_free_port("test")
    with EmulatedGpu(96, beside=llama_tools["llama-server"]) as gpu:
        gpu.hold(held_mib * MIB)
        proc = _serve(_result(tmp_path), port, "--rpc", gpu.endpoint, "--min-ctx", "1024")
        try:
            _wait_healthy(proc, port)
            used = gpu.stats().used_bytes  # what llama.cpp allocated on the device: the chosen plan's bytes
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        err = (tmp_path / "serve.log").read_text()
    assert used == need
    free = 96 - held_mib
    assert (f"fitter: serve: balanced needs 74.11 MiB on RPC0[{gpu.endpoint}], {free}.00 MiB free less the 16 MiB "
            f"fit target" in err), err
    assert f"serving {served.format(gpu.endpoint)}\n" in err, err
