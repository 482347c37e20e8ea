"""fitter.measure.llamacpp.builds and `--llama-cpp DIR`: a user's own llama.cpp build runs the trials, gives the
baseline, keys the results and is named by the exports; tested with the tools built from the pinned source on the
emulated GPU (nothing in it assumes CUDA)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from fitter.cli import main
from fitter.errors import FitterError
from fitter.machine.vulkan import VulkanDevice
from fitter.measure.llamacpp.builds import build_devices, find_build, list_devices, parse_list_devices
from fitter.memory.backends.devices import CUDA, RPC
from fitter.units import MIB
from tests.conftest import BUILT_TOOLS

LISTING = """load_backend: loaded RPC backend from /x/libggml-rpc.so
Available devices:
  CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23451 MiB free)
  Vulkan0: AMD Radeon RX 7900 XTX (RADV NAVI31) (24560 MiB, 24000 MiB free)
  ROCm0: AMD Radeon RX 7900 XTX (24560 MiB, 24400 MiB free)
  MTL0: Apple M2 Max (98304 MiB, 98304 MiB free)
  BLAS: OpenBLAS (0 MiB, 0 MiB free)
  RPC0: 127.0.0.1:50052 (200 MiB, 200 MiB free)
"""


def test_every_device_a_build_lists_is_planned_by_its_backends_rules() -> None:
    listed = parse_list_devices(LISTING)
    assert [(d.name, d.description, d.total_bytes, d.free_bytes) for d in listed][:2] == [
        ("CUDA0", "NVIDIA GeForce RTX 4090", 24080 * MIB, 23451 * MIB),
        ("Vulkan0", "AMD Radeon RX 7900 XTX (RADV NAVI31)", 24560 * MIB, 24000 * MIB),
    ]
    radv = VulkanDevice("AMD Radeon RX 7900 XTX (RADV NAVI31)", "discrete", 0x1002, 4, 64, (1 << 32) - 1,
                        1 << 32, 1 << 32, 65536, 24560 * MIB)
    devices, notes = build_devices(listed, (radv,))
    assert [(d.name, d.profile.kind) for d in devices] == [
        ("CUDA0", "cuda"), ("Vulkan0", "vulkan"), ("ROCm0", "rocm"), ("MTL0", "metal"),
        ("RPC0[127.0.0.1:50052]", "rpc")]
    cuda, vk, rocm, metal, rpc = (d.profile for d in devices)
    assert cuda == CUDA and rpc == RPC
    assert (vk.alignment, vk.max_op_bytes, vk.host_buft) == (4, (1 << 32) - 1, "Vulkan_Host")  # the card's own
    assert (rocm.alignment, rocm.row_padding, rocm.host_buft, rocm.ops) == (128, 512, "ROCm_Host", "cuda")
    assert metal.projected and metal.unified
    assert notes == [
        "ROCm0 (AMD Radeon RX 7900 XTX): CUDA's rules: ROCm builds compile ggml-cuda (ggml-cuda compiled by "
        "ggml/src/ggml-hip (GGML_USE_HIP): ggml-cuda.h GGML_CUDA_NAME \"ROCm\"); not validated on ROCm hardware "
        "(its flash-attention kernels differ)",
        "MTL0 (Apple M2 Max): no rules for Metal in fitter: its buffers come from the build's own projection "
        "(llama-fit-params --fit-print on)",
        "BLAS (OpenBLAS): an accelerator of the host's own memory; llama.cpp never places a model on it "
        "(src/llama.cpp skips ACCEL devices)",
    ]
    _, unread = build_devices(listed[1:2])
    assert unread == ["Vulkan0 (AMD Radeon RX 7900 XTX (RADV NAVI31)): its Vulkan limits could not be read here (no "
                      "Vulkan loader, or no device of that name): planned with a typical discrete card's (buffer "
                      "range 4 GiB)"]
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


def test_a_build_without_llama_perplexity_is_refused_for_quality(tmp_path: Path) -> None:
    (tmp_path / "llama-server").write_bytes(b"")
    build = find_build(tmp_path)  # llama-perplexity and llama-quantize are optional, as llama-bench is
    assert (build.llama_perplexity, build.llama_quantize, build.llama_bench) == (None, None, None)
    with pytest.raises(FitterError) as e:
        build.perplexity_tool()
    assert str(e.value) == (f"--llama-cpp {tmp_path}: no llama-perplexity in it, which measures quality; build it "
                            "there (cmake --build build --target llama-perplexity)")
    for name in ("llama-perplexity", "llama-quantize"):
        (tmp_path / name).write_bytes(b"")
    build = find_build(tmp_path)
    assert (build.perplexity_tool(), build.llama_quantize) == (tmp_path / "llama-perplexity",
                                                               tmp_path / "llama-quantize")


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
# alone 7-23 s; beside the suite's other slow tunes on 2 cores the CPU tune's llama-server threads are starved past the
# suite's 300 s: its own subprocess limit (900 s) is the test's
@pytest.mark.timeout(960)
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


FAKE_METAL_SERVER = """#!/bin/sh
case "$*" in
  *--version*) echo "version: 0.5.0-dev (build 1, commit 0c1e570)" ;;
  *--list-devices*) printf 'Available devices:\\n  MTL0: Apple M2 Max (1124 MiB, 1124 MiB free)\\n' ;;
esac
"""
# a Metal build's projection of llama-tiny (2 layers and the output): 40 MiB of weights and 2 MiB of cache per layer
FAKE_METAL_FIT_PARAMS = """#!/usr/bin/env python3
import sys
args = sys.argv[1:]
value = args[args.index("-ngl") + 1] if "-ngl" in args else "auto"
n = 3 if value in ("all", "auto", "-1", "-2") else min(3, int(value))
print(f"MTL0 {40 * n} {2 * n} {10 if n else 0}")
print(f"Host {40 * (3 - n) + 1} {2 * (3 - n)} 5")
"""


def fake_metal_build(folder: Path) -> Path:
    """A build folder whose llama-server lists one Metal GPU and whose llama-fit-params projects for it: the
    backend fitter has no rules for, through the I/O edge a real Metal build offers (a Mac is not at hand)."""
    folder.mkdir()
    for name, text in (("llama-server", FAKE_METAL_SERVER), ("llama-fit-params", FAKE_METAL_FIT_PARAMS)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def test_a_backend_without_rules_is_planned_from_its_builds_projection(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.models import model_file

    build = fake_metal_build(tmp_path / "metal")
    model = str(model_file("llama-tiny"))
    assert main(["estimate", model, "-c", "512", "-ngl", "2", "--llama-cpp", str(build), "--json"]) == 0
    out = capsys.readouterr()
    doc = json.loads(out.out)
    # the Metal device's every kind and the host's compute from the projection (floored MiB rounded up); the host's
    # weights and cache are the CPU backend's, fitter's own (the embedding, one layer's cache)
    own = plan_of(model, ["-c", "512", "-ngl", "2"], "metal:1124").totals()["CPU"]
    assert {name: (d["model"], d["kv"], d["compute"]) for name, d in doc["devices"].items()} == {
        "CPU": (own.model, own.kv, 5 * MIB + MIB - 1),
        "MTL0": (80 * MIB + MIB - 1, 4 * MIB + MIB - 1, 10 * MIB + MIB - 1)}
    assert ("fitter: warning: MTL0 (Apple M2 Max): no rules for Metal in fitter: its buffers come from the build's "
            "own projection (llama-fit-params --fit-print on)") in out.err
    assert "MTL0: every buffer from llama.cpp's own projection" in out.err
    # the fit judges each placement by the build's projection: 100 MiB of budget holds two layers (84 MiB), not three
    assert main(["fit", model, "-c", "512", "--fit-target", "1024", "--llama-cpp", str(build), "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["fits"] and "-ngl" in fitted["flags"]
    assert fitted["flags"][fitted["flags"].index("-ngl") + 1] == "2"


def plan_of(model: str, flags: list[str], devices: str) -> Any:
    from fitter.flags import parse_launch_flags
    from fitter.gguf.model_spec import load_model_spec
    from fitter.memory.backends.registry import parse_devices
    from fitter.memory.plan.estimator import estimate

    return estimate(load_model_spec(model), parse_launch_flags(flags), parse_devices(devices))


FAKE_VULKAN_SERVER = """#!/bin/sh
case "$*" in
  *--version*) echo "version: 0.5.0-dev (build 1, commit 0c1e570)" ;;
  *--list-devices*) printf 'Available devices:\\n'
                    printf '  Vulkan0: AMD Radeon RX 7600 (RADV NAVI33) (8176 MiB, 8000 MiB free)\\n' ;;
esac
"""


def test_a_vulkan_builds_gpu_is_the_tunes_device(tmp_path: Path) -> None:
    # what `fitter tune --llama-cpp <a Vulkan build> --dry-run` planned CPU-only before: the build's own listing is
    # the list, whatever NVML (none here) says
    import subprocess
    import sys

    build = tmp_path / "vulkan"
    build.mkdir()
    (build / "llama-server").write_text(FAKE_VULKAN_SERVER)
    (build / "llama-server").chmod(0o755)
    proc = subprocess.run([sys.executable, "-m", "fitter.cli", "tune", "--llama-cpp", str(build), "--dry-run", "-c",
                           "4096", "--results", str(tmp_path / "r")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "budgets: Vulkan0 6976 MiB, host" in proc.stdout  # 8000 MiB free less the 1024 MiB fit target
    assert ("Vulkan0 (AMD Radeon RX 7600 (RADV NAVI33)): its Vulkan limits could not be read here" in proc.stderr
            or "Vulkan0" not in proc.stderr)  # a machine whose loader lists that card reads its own


def test_a_result_is_held_to_the_devices_and_backends_of_its_build() -> None:
    from fitter.measure.llamacpp.builds import build_change

    then = {"build_devices": [{"device": "Vulkan0", "backend": "vulkan", "memory_total": 8176 * MIB}]}
    same = [{"device": "Vulkan0", "backend": "vulkan", "memory_total": 8180 * MIB}]  # a driver moved it a little
    assert build_change(then, same, ["CPU", "Vulkan"], ["CPU", "Vulkan"]) is None
    other = [{"device": "Vulkan0", "backend": "vulkan", "memory_total": 16368 * MIB}]
    assert build_change(then, other, ["CPU", "Vulkan"], ["CPU", "Vulkan"]) == (
        "was tuned on Vulkan0 (vulkan, 8176 MiB), as the build listed them; it lists Vulkan0 (vulkan, 16368 MiB) "
        "now: its placement and budgets are for those devices; tune again here")
    assert build_change(then, same, ["CPU", "Vulkan"], ["CPU", "CUDA"]) == (
        "was tuned with a build of CPU, Vulkan; it is now a build of CPU, CUDA: tune again with this build")
    assert build_change({}, other, None, ["CPU"]) is None  # tuned before the record: not compared


def test_a_backend_the_build_has_but_cannot_run_here_is_said(tmp_path: Path) -> None:
    from fitter.measure.llamacpp.builds import devices_of_build

    (tmp_path / "llama-server").write_text("#!/bin/sh\nprintf 'Available devices:\\n  (none)\\n'\n")
    (tmp_path / "llama-server").chmod(0o755)
    for name in ("libggml-base.so.0", "libggml-hip.so.0", "libggml-cpu.so.0"):
        (tmp_path / name).write_bytes(b"")
    devices, notes = devices_of_build(find_build(tmp_path))
    assert devices == ()
    assert notes == [f"{tmp_path}: the build has ROCm but lists no device of it here (its devices: none): that "
                     "backend cannot run on this machine (no driver or no card); planned without it"]
