"""The CUDA-shaped emulated GPU (`EmulatedGpu(cuda=True)`, `--emulated-gpu cuda:MiB`): llama.cpp itself allocates
with CUDA's rules, and the estimator's CUDA profile predicts it to the logged 0.01 MiB."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from fitter.cli import main
from fitter.flags import parse_launch_flags
from fitter.gguf.demo_models import SHAPES, write_model
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.emulator.capdev import CUDA_RPC_ENV, server_env
from fitter.measure.emulator.emulated_gpu import EmulatedGpu
from fitter.memory.backends.devices import CUDA, rpc_devices
from fitter.memory.plan.estimator import estimate
from fitter.units import MIB


def test_the_server_is_told_to_answer_as_cuda() -> None:
    env = server_env({}, Path("/c/capdev.so"), Path("/t/stats"), 3 * MIB, cuda=True)
    assert env["FITTER_CAPDEV_CUDA"] == "1"
    assert "FITTER_CAPDEV_CUDA" not in server_env({}, Path("/c/capdev.so"), Path("/t/stats"), 3 * MIB)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(SHAPES["demo"], tmp_path_factory.mktemp("models") / "demo.gguf")[0]


def _loaded(model: Path, gpu: EmulatedGpu, *flags: str) -> list[tuple[str, str, float]]:
    from fitter.measure.loader import load_and_capture

    res = load_and_capture(model, parse_launch_flags([*flags, "--rpc", gpu.endpoint]), timeout=120)
    assert res.ok, res.error
    return [(b.buft.replace(gpu.endpoint, "E"), b.kind, b.mib) for b in res.buffers]


def _estimated(model: Path, endpoint: str, *flags: str) -> list[tuple[str, str, float]]:
    devices = tuple(replace(d, profile=CUDA) for d in rpc_devices([endpoint]))
    plan = estimate(load_model_spec(str(model)), parse_launch_flags([*flags, "--rpc", endpoint]), devices)
    return [(b.buft.replace(endpoint, "E"), b.kind, round(b.bytes / MIB, 2)) for b in plan.buffers]


@pytest.mark.llama
def test_llama_cpp_allocates_what_a_cuda_build_would_and_the_estimate_says_so(demo: Path) -> None:
    flags = ("-c", "4096", "-ngl", "all", "-cmoe", "-ub", "512")
    with EmulatedGpu(256, cuda=True) as gpu:
        cuda = _loaded(demo, gpu, *flags)
        no_offload = _loaded(demo, gpu, *flags, "--no-op-offload")
        endpoint = gpu.endpoint
    with EmulatedGpu(256) as gpu:
        rpc = _loaded(demo, gpu, *flags)
    assert sorted(cuda) == sorted(_estimated(demo, endpoint, *flags))
    # CUDA's pinned host type holds the host's compute and output buffers, and its expert copies (op offload) grow
    # the device's compute buffer; the RPC device has neither
    assert ("CUDA_Host", "output", 0.03) in cuda and not any(b[0] == "CUDA_Host" for b in rpc)
    device_compute = {name: mib for name, kind, mib in cuda if kind == "compute" and name.startswith("RPC0")}
    rpc_compute = {name: mib for name, kind, mib in rpc if kind == "compute" and name.startswith("RPC0")}
    off_compute = {name: mib for name, kind, mib in no_offload if kind == "compute" and name.startswith("RPC0")}
    assert device_compute == {"RPC0[E]": 19.2} and rpc_compute == {"RPC0[E]": 17.01}
    assert off_compute == {"RPC0[E]": 17.01}  # --no-op-offload: no copies
    # quantized rows padded to 512 elements: the device's weights are 0.01 MiB larger than on the RPC device
    assert ("RPC0[E]", "model", 12.29) in cuda and ("RPC0[E]", "model", 12.28) in rpc


@pytest.mark.llama
def test_clients_started_while_it_runs_give_it_cudas_rules(demo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CUDA_RPC_ENV, raising=False)
    with EmulatedGpu(64, cuda=True) as gpu:
        assert os.environ[CUDA_RPC_ENV] == gpu.endpoint
    assert CUDA_RPC_ENV not in os.environ


@pytest.mark.llama
def test_fit_verify_on_the_cuda_shaped_device_loads_what_it_predicted(capsys: pytest.CaptureFixture[str],
                                                                      demo: Path) -> None:
    assert main(["fit", str(demo), "--emulated-gpu", "cuda:120", "--fit-target", "16", "-c", "4096", "--verify",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (name,) = [n for n in out["devices"] if n != "CPU"]
    assert out["fits"] and out["verify"]["loaded"]
    assert out["verify"]["device_peak_bytes"] == out["devices"][name]["total"]
    assert any(b["buft"] == "CUDA_Host" for b in out["verify"]["buffers"])


def test_the_emulated_gpu_option_takes_a_cuda_or_vulkan_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:  # argparse's errors leave through fitter's one-line parser error
        main(["fit", "--emulated-gpu", "cuda:lots"])
    assert exit_info.value.code == 2
    assert ("--emulated-gpu 'cuda:lots': expected MiB[,MiB...], cuda:MiB[,MiB...] or vulkan:MiB[,MiB...]"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        main(["fit", "--emulated-gpu", "rocm:4096"])
    assert ("--emulated-gpu 'rocm:4096': 'rocm' is not a kind of emulated GPU; expected MiB[,MiB...], "
            "cuda:MiB[,MiB...] or vulkan:MiB[,MiB...]") in capsys.readouterr().err
    from fitter.cli.app import build_parser

    ns = build_parser().parse_args(["fit", "--emulated-gpu", "vulkan:96,48"])
    assert (ns.emulated_gpu, ns.emulated_kind) == ((96, 48), "vulkan")


def test_a_list_of_emulated_gpus_is_refused_where_one_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["grid", "--emulated-gpu", "96,48"]) == 2
    assert ("--emulated-gpu 96,48: fitter grid runs on one emulated GPU for now (fit, bench and tune take several)"
            in capsys.readouterr().err)
