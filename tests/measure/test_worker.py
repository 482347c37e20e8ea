"""llama-bench-style measurements in the persistent llama.cpp worker (llama-cpp-python 0.3.36), on tiny models."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.logs import parse_oom, sum_by
from fitter.measure.types import BenchSpec, Measurement
from fitter.measure.worker import LlamaWorker, measure
from fitter.memory.backends.devices import rpc_devices
from fitter.memory.plan.estimator import estimate
from tests.models import model_file

pytestmark = pytest.mark.llama

SPEC = BenchSpec(n_prompt=64, n_gen=16, repetitions=3, threads=1)
LONG = BenchSpec(n_prompt=30000, n_gen=0, repetitions=50, threads=1)  # minutes on the tiny model
LONG_FLAGS = ["-c", "32768", "-np", "1"]
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def tiny() -> Path:
    return model_file("gpt-oss-tiny")


def _ok(m: Measurement) -> None:
    assert m.outcome == "ok", m.reason
    for stats, n in ((m.pp, SPEC.n_prompt), (m.tg, SPEC.n_gen)):
        assert stats is not None and stats.n == n
        assert len(stats.samples_ts) == SPEC.repetitions and all(x > 0 for x in stats.samples_ts)
        assert stats.avg_ts > 0 and stats.stddev_ts >= 0
    assert m.load_s is not None and m.wall_s > 0 and m.peak_rss and m.peak_rss > 0


def test_ok_measures_prefill_and_decode(tiny: Path) -> None:
    m = measure(tiny, parse_launch_flags(["-c", "2048"]), SPEC)
    _ok(m)
    assert not m.reused_model
    assert sum_by(m.buffers)[("CPU", "kv")] == 0.75  # the deployed context (-c 2048, 4 slots), not p+n
    assert m.llama_cpp["version"] == "0.3.36" and "CPU" in m.llama_cpp["system_info"]
    data = m.to_json()
    assert data["outcome"] == "ok" and len(data["pp"]["samples_ts"]) == 3 and data["tg"]["n"] == 16


def test_context_changes_reuse_the_model_and_placement_changes_reload(tiny: Path) -> None:
    with LlamaWorker() as w:
        first = w.run(tiny, parse_launch_flags(["-c", "2048"]), SPEC)
        again = w.run(tiny, parse_launch_flags(["-c", "4096", "-ub", "256"]), SPEC)
        other = w.run(tiny, parse_launch_flags(["-c", "4096", "-ot", "exps=CPU"]), SPEC)
        assert w.starts == 1
    for m in (first, again, other):
        _ok(m)
    assert not first.reused_model and again.reused_model and not other.reused_model
    assert again.load_s == 0.0 and "load_tensors" not in again.log and "load_tensors" in other.log
    # a reused model keeps reporting its model buffers
    assert sum_by(again.buffers)[("CPU_Mapped", "model")] == sum_by(first.buffers)[("CPU_Mapped", "model")]


def test_oom_on_the_emulated_gpu_names_the_buffer_and_bytes(tiny: Path) -> None:
    from fitter.measure.emulator.emulated_gpu import EmulatedGpu

    with EmulatedGpu(2) as gpu, LlamaWorker() as w:  # the weights fit, a 65536-cell KV cache (16 MiB) does not
        m = w.run(tiny, parse_launch_flags(["-c", "65536", "-np", "1", "-ngl", "all", "--rpc", gpu.endpoint]), SPEC)
    assert m.outcome == "oom", m.reason
    assert m.pp is None and m.tg is None
    assert m.oom is not None and m.oom.stage == "kv" and m.oom.buft == f"RPC0[{gpu.endpoint}]"
    assert m.oom.requested_bytes is not None and m.oom.requested_bytes > MIB
    assert f"RPC0[{gpu.endpoint}]" in m.reason and str(m.oom.requested_bytes) in m.reason


def test_parse_oom_reads_kv_compute_and_cuda_failures() -> None:
    kv = ("ggml_backend_alloc_ctx_tensors_from_buft: failed to allocate RPC0[127.0.0.1:5] buffer of size 1048576\n"
          "llama_init_from_model: failed to initialize the context: failed to allocate buffer for kv cache\n")
    got = parse_oom(kv)
    assert got is not None and (got.stage, got.buft, got.requested_bytes) == ("kv", "RPC0[127.0.0.1:5]", 1048576)
    compute = ("ggml_gallocr_reserve_n_impl: failed to allocate CUDA0 buffer of size 123\n"
               "graph_reserve: failed to allocate compute pp buffers\n")
    got = parse_oom(compute)
    assert got is not None and (got.stage, got.buft, got.requested_bytes) == ("compute", "CUDA0", 123)
    cuda = "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 2.00 MiB on device 1: cudaMalloc failed: out of mem"
    got = parse_oom(cuda)
    assert got is not None and (got.buft, got.requested_bytes) == ("CUDA1", 2 * MIB)
    assert parse_oom("llama_context: constructing llama_context\n") is None


def test_a_killed_worker_is_a_crash_and_the_next_trial_gets_a_fresh_one(tiny: Path) -> None:
    with LlamaWorker() as w:
        pid = w.start().pid
        assert pid is not None
        killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
        killer.start()
        m = w.run(tiny, parse_launch_flags(LONG_FLAGS), LONG)
        killer.join()
        assert m.outcome == "crash" and m.returncode == -signal.SIGKILL
        assert "SIGKILL" in m.reason and m.pp is None and m.tg is None
        after = w.run(tiny, parse_launch_flags(["-c", "2048"]), SPEC)
        _ok(after)
        assert w.starts == 2 and w.pid != pid


@pytest.mark.load
def test_a_trial_past_its_limit_times_out(tiny: Path) -> None:
    with LlamaWorker() as w:
        w.start()
        t0 = time.monotonic()
        m = w.run(tiny, parse_launch_flags(LONG_FLAGS), LONG, timeout=2.0)
        took = time.monotonic() - t0
        assert m.outcome == "timeout" and m.pp is None and m.tg is None
        # stopped at its limit, not run to its end (LONG takes minutes): killing and reaping the child takes a
        # loaded machine seconds (two busy processes beside the suite on 2 cores), so the bound is the trial's
        # length, not the limit plus a guess of how fast a kill is
        assert 2.0 <= m.wall_s <= took < 60.0
        _ok(w.run(tiny, parse_launch_flags(["-c", "2048"]), SPEC))  # a fresh worker


def test_device_buffers_match_the_estimate_as_ngl_changes() -> None:
    from fitter.measure.emulator.emulated_gpu import EmulatedGpu

    model = model_file("gpt-oss-tiny")
    spec = load_model_spec(str(model))
    with EmulatedGpu(64) as gpu, LlamaWorker() as w:
        devices = rpc_devices([gpu.endpoint])
        name = devices[0].name
        reloads = []
        for ngl in ("all", "1", "0"):
            config = parse_launch_flags(["-c", "1024", "-np", "1", "-ngl", ngl, "--rpc", gpu.endpoint])
            m = w.run(model, config, SPEC)
            _ok(m)
            reloads.append(m.reused_model)
            plan = estimate(spec, config, devices)
            logged = {k: v for k, v in sum_by(m.buffers).items() if k[0] == name}
            predicted: dict[tuple[str, str], float] = {}
            for b in plan.buffers:
                if b.device == name:
                    predicted[(b.buft, b.kind)] = predicted.get((b.buft, b.kind), 0.0) + b.bytes / MIB
            assert logged or ngl == "0"
            assert logged.keys() == {k for k, v in predicted.items() if round(v, 2) > 0}, (ngl, logged, predicted)
            for k, v in logged.items():
                assert abs(v - predicted[k]) <= 0.01, (ngl, k, v, predicted[k])
        assert reloads == [False, False, False]


def test_a_config_llama_cpp_rejects_raises_and_the_worker_goes_on(tiny: Path) -> None:
    from fitter.measure.types import WorkerError

    with LlamaWorker() as w:
        with pytest.raises(WorkerError, match="unknown buffer type"):
            w.run(tiny, parse_launch_flags(["-c", "2048", "-ot", "exps=CUDA0"]), SPEC)
        with pytest.raises(WorkerError, match="holds 512"):  # 4 separate slots of 512 cells
            w.run(tiny, parse_launch_flags(["-c", "2048", "-np", "4"]), BenchSpec(n_prompt=600, n_gen=0))
        _ok(w.run(tiny, parse_launch_flags(["-c", "2048"]), SPEC))
        assert w.starts == 1
