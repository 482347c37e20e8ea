"""fitter.measure.llamacpp.builds and `--llama-cpp DIR`: a user's own llama.cpp build runs the trials, gives the
baseline, keys the results and is named by the exports; tested with the tools built from the pinned source on the
emulated GPU (nothing in it assumes CUDA)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from fitter.cli import main
from fitter.errors import FitterError
from fitter.measure.llamacpp.builds import build_devices, find_build, list_devices, parse_list_devices
from fitter.memory.backends.devices import CUDA, RPC
from fitter.units import MIB
from tests.conftest import BUILT_TOOLS

LISTING = """load_backend: loaded RPC backend from /x/libggml-rpc.so
Available devices:
  CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23451 MiB free)
  Vulkan0: AMD Radeon RX 7900 XTX (RADV NAVI31) (24560 MiB, 24000 MiB free)
  RPC0: 127.0.0.1:50052 (200 MiB, 200 MiB free)
"""


def test_the_devices_a_build_lists() -> None:
    listed = parse_list_devices(LISTING)
    assert [(d.name, d.description, d.total_bytes, d.free_bytes) for d in listed] == [
        ("CUDA0", "NVIDIA GeForce RTX 4090", 24080 * MIB, 23451 * MIB),
        ("Vulkan0", "AMD Radeon RX 7900 XTX (RADV NAVI31)", 24560 * MIB, 24000 * MIB),
        ("RPC0", "127.0.0.1:50052", 200 * MIB, 200 * MIB),
    ]
    devices, warnings = build_devices(listed)
    assert [(d.name, d.profile) for d in devices] == [("CUDA0", CUDA), ("RPC0[127.0.0.1:50052]", RPC)]
    assert warnings == ["Vulkan0 (AMD Radeon RX 7900 XTX (RADV NAVI31)): fitter has no memory rules for this "
                        "backend; it is left out of the estimate"]
    assert parse_list_devices("Available devices:\n  (none)\n") == ()


def test_the_commit_from_either_version_format() -> None:
    from fitter.measure.llamacpp.builds import version_info

    assert version_info("version: 0.5.0-dev (build 1, commit 0c1e570)\nbuilt with GNU 12.2.0\n") == (
        "0.5.0-dev, build 1", "0c1e570")
    assert version_info("load_backend: …\nversion: 6345 (e3a74b2)\nbuilt with GNU 12.2.0 for Linux\n") == (
        "build 6345", "e3a74b2")
    assert version_info("version: 1 (unknown)\n") == ("build 1", "unknown")
    assert version_info("error: invalid argument: --version\n") == ("unknown", "unknown")
    assert version_info("nothing\n") == ("unknown", "unknown")


def test_the_backends_of_a_build_from_its_libraries(tmp_path: Path) -> None:
    # a shared CUDA build's bin/: ggml's backend libraries name its backends (its --list-devices fails here: the
    # "binary" is a script that prints nothing, so the devices add none)
    from fitter.measure.llamacpp.builds import build_backends

    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\nexit 1\n")
    server.chmod(0o755)
    for name in ("libggml-base.so.0", "libggml-cpu-haswell.so", "libggml-cuda.so.0.9.4", "libggml-rpc.so",
                 "libggml-hip.so", "libllama.so"):
        (tmp_path / name).write_bytes(b"")
    assert build_backends(str(server)) == ["CPU", "CUDA", "ROCm", "RPC"]


def test_a_folder_without_llama_server_is_named(tmp_path: Path) -> None:
    with pytest.raises(FitterError, match=r"^--llama-cpp .*/nope: not a folder"):
        find_build(tmp_path / "nope")
    with pytest.raises(FitterError, match=r"^--llama-cpp .*: no llama-server in it"):
        find_build(tmp_path)


@pytest.mark.tools("llama-server")
def test_the_build_reports_its_commit_and_sees_an_rpc_device(llama_tools: dict[str, Path]) -> None:
    from fitter.measure.emulator.emulated_gpu import EmulatedGpu

    build = find_build(BUILT_TOOLS)
    assert build.build() == {"commit": "0c1e570", "source": "llama-server --version", "version": "0.5.0-dev, build 1",
                             "backends": ["CPU", "RPC"], "llama_server": str(BUILT_TOOLS / "llama-server")}
    assert list_devices(build) == ()  # a CPU build
    with EmulatedGpu(200) as gpu:
        (device,) = build_devices(list_devices(build, (gpu.endpoint,)))[0]
        assert (device.name, device.profile, device.free_bytes) == (gpu.device_name, RPC, 200 * MIB)


@pytest.mark.slow
@pytest.mark.llama
@pytest.mark.tools("llama-server", "llama-fit-params")
def test_tune_through_a_users_build_end_to_end(llama_tools: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--llama-cpp", str(BUILT_TOOLS), "--emulated-gpu", "96", "--fit-target", "16",
                 "--trials", "3", "-r", "2", "-p", "64", "-n", "16", "--results", str(tmp_path / "r"),
                 "--projection", "always", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["llama_cpp"] == {"commit": "0c1e570", "source": "llama-server --version",
                                "version": "0.5.0-dev, build 1", "backends": ["CPU", "RPC"],
                                "llama_server": str(BUILT_TOOLS / "llama-server")}
    assert doc["baseline"]["measurement"]["backend"] == "llama-server"  # llama.cpp's own fit, run by the build
    assert all(e["measurement"]["backend"] == "llama-server" for e in doc["pareto"])
    folder = next((tmp_path / "r").rglob("pareto.json")).parent
    assert folder.name == "0c1e570"  # keyed by the build's commit
    # the drift guard (forced: this is the build fitter's rules were matched against): every launched config was
    # projected by the build's llama-fit-params too; on the device, the projection is fitter's estimate of the same
    # reading of the flags (fitter.measure.llamacpp.projection.tool_estimate) less the flooring of its three MiB figures
    import optuna

    from fitter.gguf.demo_models import demo_model_path
    from fitter.gguf.model_spec import load_model_spec
    from fitter.measure.llamacpp.projection import tool_estimate
    from fitter.memory.backends.devices import CPU_AVX2, rpc_devices

    spec = load_model_spec(str(demo_model_path()))
    storage = f"sqlite:///{folder / 'study.db'}"
    study = optuna.load_study(study_name=optuna.get_all_study_summaries(storage)[0].study_name, storage=storage)
    launched = [t for t in study.trials if t.user_attrs.get("launched")]
    assert launched and all("projected_bytes" in t.user_attrs for t in launched)
    for t in launched:
        flags = t.user_attrs["flags"]
        endpoint = flags[flags.index("--rpc") + 1]
        ours = tool_estimate(spec, flags, rpc_devices([endpoint]), CPU_AVX2)
        name = f"RPC0[{endpoint}]"
        assert 0 <= sum(ours[name].values()) - t.user_attrs["projected_bytes"][name] < 3 * MIB, (t.number, name)
    assert main(["export", str(folder), "--format", "server"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert shlex.split(line)[0] == str(BUILT_TOOLS / "llama-server")  # the export names the binary


def _without_llama_cpp_python(tmp_path: Path) -> dict[str, str]:
    """An environment in which no Python process sees llama-cpp-python, as in a venv without it: a sitecustomize on
    PYTHONPATH hides it from the command and from every Python child (the emulated GPU's server)."""
    import os

    hide = tmp_path / "hide"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['llama_cpp'] = None\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")]))}


@pytest.mark.slow
@pytest.mark.tools("llama-server", "llama-fit-params")
@pytest.mark.parametrize("shared", [True, False], ids=["shared-build", "static-build"])
def test_a_users_build_needs_no_llama_cpp_python(llama_tools: dict[str, Path], tmp_path: Path, shared: bool) -> None:
    """`pip install` of fitter alone beside an existing llama.cpp, with llama-cpp-python hidden from every process.
    A shared build with RPC (the tools' folder: libggml-rpc.so.0 beside llama-server) serves the emulated GPU with
    its own ggml, so the demo model on this machine without a GPU is tuned on it, as with llama-cpp-python; a build
    without those libraries beside its binaries (the binaries copied into a folder of their own, their libraries
    found through LD_LIBRARY_PATH, as a static build needs none) has no emulated GPU, and the demo model is tuned on
    the CPU."""
    import shutil
    import subprocess
    import sys

    env = _without_llama_cpp_python(tmp_path)
    folder = BUILT_TOOLS
    if not shared:
        folder = tmp_path / "static"
        folder.mkdir()
        for name in ("llama-server", "llama-fit-params"):
            shutil.copy2(BUILT_TOOLS / name, folder / name)
        env["LD_LIBRARY_PATH"] = str(BUILT_TOOLS)
    args = ["tune", "--llama-cpp", str(folder), "--trials", "3", "-r", "2", "-p", "64", "-n", "16",
            "--results", str(tmp_path / "r"), "--json"]
    code = f"import sys; from fitter.cli import main; sys.exit(main({args!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    check = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('llama_cpp'))"],
                           capture_output=True, text=True, env=env)
    assert check.stdout.strip() == "None"  # it was hidden
    doc = json.loads(proc.stdout)
    assert doc["llama_cpp"]["llama_server"] == str(folder / "llama-server") and doc["pareto"]
    assert all(e["measurement"]["backend"] == "llama-server" for e in doc["pareto"])
    if shared:
        assert "fitter: no GPU found: tuning the demo model on fitter's emulated GPU (96 MiB" in proc.stderr
        assert doc["emulated"] and doc["baseline"]["measurement"]["backend"] == "llama-server"
        assert any(k.startswith("RPC0[") for e in doc["pareto"] for k in e["measurement"]["devices"])
    else:
        assert (f"fitter: no GPU found, and no emulated GPU (the emulated GPU serves llama.cpp's RPC backend from a "
                f"shared llama.cpp build or from llama-cpp-python: {folder} has no shared ggml with RPC") in proc.stderr
        assert "): tuning the demo model on the CPU with your build" in proc.stderr and not doc["emulated"]
