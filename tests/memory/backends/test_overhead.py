"""fitter.memory.backends.overhead and fitter.machine.measured_overhead: memory a CUDA device uses outside
llama.cpp's buffers, its own line in estimates and budgets, the default by GPU class replaced by what NVML
measured on this machine."""

from __future__ import annotations

import errno
import json

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.machine.measured_overhead import overhead_for, record, record_measurements
from fitter.machine.nvidia import GpuInfo
from fitter.measure.bench_table import bench_json
from fitter.measure.types import Measurement
from fitter.memory.backends.devices import CUDA, Device, rpc_devices
from fitter.memory.backends.overhead import default_overhead, measured_overhead, sm_count
from fitter.memory.backends.registry import parse_devices
from fitter.memory.fit.budgets import device_budgets
from fitter.memory.plan.estimator import estimate
from fitter.memory.plan_render import plan_json
from fitter.paths import fitter_home
from fitter.units import MIB
from tests.disks import refused_writes
from tests.models import model_file

RTX_4090 = GpuInfo(0, "NVIDIA GeForce RTX 4090", uuid="GPU-4090", memory_total=24 * 1024 * MIB,
                   memory_free=23 * 1024 * MIB, compute_capability=(8, 9), cuda_cores=16384)


def test_the_default_by_gpu_class() -> None:
    assert sm_count(16384, (8, 9)) == 128 and sm_count(6912, (8, 0)) == 108 and sm_count(None, (8, 9)) is None
    ada = default_overhead("RTX 4090", (8, 9), 128)  # 3.5 MiB × 128 SMs + a 4 MiB cuBLAS workspace before Hopper
    assert ada.bytes == 448 * MIB + 4 * MIB
    assert ada.source.startswith("default for RTX 4090: CUDA context ~3.5 MiB × 128 SMs (llama.cpp PR #15860, "
                                 "#23604) + cuBLAS workspace 4 MiB (cc 8.9, ggml-cuda common.cuh)")
    assert default_overhead("H100", (9, 0), 132).bytes == 462 * MIB + 32 * MIB
    assert default_overhead().bytes == 453 * MIB + 32 * MIB  # a hypothetical `--devices cuda:MiB`
    assert measured_overhead(-5, "x").bytes == 0


def test_budgets_leave_the_overhead_and_the_fit_target() -> None:
    (dev,) = parse_devices("cuda:12288")
    assert dev.overhead == default_overhead()
    assert device_budgets((dev,), (1024,)) == {"CUDA0": (12288 - 1024 - 485) * MIB}
    assert device_budgets(rpc_devices(["127.0.0.1:5"]), (0,)) == {"RPC0[127.0.0.1:5]": None}  # nothing known


def test_the_estimate_has_an_overhead_line_per_cuda_device() -> None:
    spec = load_model_spec(str(model_file("gpt-oss-tiny")))
    plan = estimate(spec, parse_launch_flags(["-c", "4096", "-ngl", "all"]), parse_devices("cuda:8192"))
    devices = plan_json(plan, {"commit": "0c1e570"})["devices"]
    assert devices["CUDA0"]["overhead"] == 485 * MIB
    assert devices["CUDA0"]["overhead_source"].startswith("default for CUDA context 453 MiB")
    assert "overhead" not in devices["CPU"]


def test_what_nvml_measured_here_replaces_the_default_and_only_grows() -> None:
    assert overhead_for(RTX_4090, "fp1", "580.1") == default_overhead("NVIDIA GeForce RTX 4090", (8, 9), 128)
    record("fp1", "580.1", "GPU-4090", 600 * MIB, "fitter bench 2026-12-02")
    record("fp1", "580.1", "GPU-4090", 500 * MIB, "a later, smaller one")  # the largest seen stays
    seen = overhead_for(RTX_4090, "fp1", "580.1")
    assert seen == measured_overhead(600 * MIB, "fitter bench 2026-12-02")
    assert overhead_for(RTX_4090, "fp1", "590.0").source.startswith("default")  # another driver: not known yet
    assert json.loads((fitter_home() / "overhead.json").read_text()) == {
        "fp1|580.1|GPU-4090": {"bytes": 600 * MIB, "where": "fitter bench 2026-12-02"}}



def test_a_home_that_refuses_the_write_keeps_the_old_file_and_says_why() -> None:
    record("fp1", "580.1", "GPU-4090", 600 * MIB, "first")
    path = fitter_home() / "overhead.json"
    before = path.read_text()
    with refused_writes(fitter_home(), errno.ENOSPC):
        problem = record_measurements([({"devices": {"CUDA0": {"overhead": 700 * MIB}}}, "trial 1")], (RTX_4090,),
                                      "fp1", "580.1")
    assert problem == f"could not keep the measured overhead: {path}: disk full (No space left on device)"
    assert path.read_text() == before and [p.name for p in fitter_home().iterdir()] == ["overhead.json"]

def test_a_measurement_says_what_nvml_saw_beyond_the_logged_buffers() -> None:
    from fitter.measure.types import BenchSpec, LoggedBuffer

    m = Measurement("ok", "", BenchSpec(), ("-ngl", "all"),
                    buffers=(LoggedBuffer("CUDA0", "model", 100.0), LoggedBuffer("CUDA0", "compute", 20.0)))
    spec = load_model_spec(str(model_file("gpt-oss-tiny")))
    plan = estimate(spec, parse_launch_flags(["-c", "4096", "-ngl", "all"]), parse_devices("cuda:8192"))
    out = bench_json(m, "llama-cpp-python", plan, emulated=False,
                     peak_vram={"CUDA0": {"bytes": 700 * MIB, "source": "nvml"}})
    assert out["devices"]["CUDA0"]["overhead"] == 580 * MIB
    smaller = {"devices": {"CUDA0": {"overhead": 400 * MIB}}}
    assert record_measurements([(out, "trial 1"), (smaller, "trial 2")], (RTX_4090,), "fp2", "580.1") is None
    assert overhead_for(RTX_4090, "fp2", "580.1") == measured_overhead(580 * MIB, "trial 1")  # the largest


def test_a_device_built_from_this_machine_carries_its_overhead() -> None:
    dev = Device("CUDA0", CUDA, RTX_4090.memory_total, RTX_4090.memory_free, overhead_for(RTX_4090, None, None))
    assert device_budgets((dev,), (1024,)) == {"CUDA0": (23 * 1024 - 1024 - 452) * MIB}
