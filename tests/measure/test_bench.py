from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.measure.bench_table import bench_json
from fitter.measure.logs import classify_exit
from fitter.measure.server import server_argv
from fitter.measure.types import BenchSpec, LoggedBuffer, Measurement, SpeedStats
from fitter.memory.plan.estimator import estimate
from tests.models import golden_arch_model, model_file

MIB = 1024 * 1024


def test_bench_json_puts_each_logged_buffer_beside_its_estimate() -> None:
    spec = load_model_spec(str(model_file("gpt-oss-tiny")))
    plan = estimate(spec, parse_launch_flags(["-c", "2048", "-np", "1"]))
    logged = tuple(LoggedBuffer(b.buft, b.kind, round(b.bytes / MIB, 2)) for b in plan.buffers)
    pp = SpeedStats.from_ns(100, 0, [10_000_000, 10_000_000])  # 100 tokens in 10 ms: 10000 t/s, no spread
    tg = SpeedStats.from_ns(10, 0, [10_000_000, 20_000_000])  # 1000 and 500 t/s: noisy
    m = Measurement("ok", "", BenchSpec(), ("-c", "2048"), pp, tg, buffers=logged)
    out = bench_json(m, "llama-cpp-python", plan, emulated=False, peak_vram={})
    assert [b["estimated_bytes"] for b in out["buffers"]] == [b.bytes for b in plan.buffers]
    assert out["pp"]["avg_ts"] == 10000.0 and out["pp"]["noisy"] is False and out["tg"]["noisy"] is True
    assert out["devices"]["CPU"]["estimated_total"] == plan.totals()["CPU"].total
    assert {b["estimated_from"] for b in out["buffers"]} == {"fitter"}  # gpt-oss: every rule is fitter's own
    failed = bench_json(Measurement("oom", "x", BenchSpec(), ()), "llama-cpp-python", plan, False, {})
    assert "pp" not in failed and "tg" not in failed  # a failure has no speeds, never zeros


def test_server_command_and_exit_classes() -> None:
    argv = server_argv("/bin/llama-server", "m.gguf", ["-c", "512"], 8080)
    assert argv == ["/bin/llama-server", "-m", "m.gguf", "-c", "512", "-lv", "4", "--host", "127.0.0.1", "--port",
                    "8080", "--no-webui"]
    assert "-lv" not in server_argv("s", "m", ["--verbosity", "3"], 1)[4:5]
    assert classify_exit(1, "x\nggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 99\n") \
        == ("oom", "ggml_backend_cpu_buffer_type_alloc_buffer: failed to allocate buffer of size 99")
    assert classify_exit(-9, "nothing") == ("crash", "killed by signal SIGKILL")


def _bench(*args: str, model: Path | None = None, tools: Path | None = None) -> tuple[int, dict]:  # type: ignore[type-arg]
    # `tools`: the built llama.cpp tools on PATH (where a projection finds llama-fit-params beyond fitter's home)
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"} if tools is not None else None
    proc = subprocess.run([sys.executable, "-m", "fitter.cli", "bench", str(model or model_file("gpt-oss-tiny")),
                           "--json", "-t", "1", *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.stdout, proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout)


def _exact(out: dict) -> None:  # type: ignore[type-arg]
    for b in out["buffers"]:
        if b["kind"] != "compute":
            assert abs(b["bytes"] - b["estimated_bytes"]) <= 0.005 * MIB, b


@pytest.mark.llama
def test_bench_worker_on_the_emulated_gpu() -> None:
    code, out = _bench("-c", "2048", "-np", "1", "-p", "32", "-n", "8", "-r", "2", "-ngl", "all",
                       "--emulated-gpu", "16")
    assert code == 0 and out["outcome"] == "ok" and out["emulated"]
    assert out["pp"]["avg_ts"] > 0 and len(out["tg"]["samples_ts"]) == 2
    _exact(out)
    (name, peak), = out["peak_vram"].items()
    assert peak["source"] == "emulator" and peak["bytes"] == out["devices"][name]["estimated_total"]  # to the byte


@pytest.mark.llama
@pytest.mark.tools("llama-fit-params")
def test_bench_on_the_emulated_gpu_says_which_estimates_are_projected_or_guessed(llama_tools: dict[str, Path]) -> None:
    # phi2: fitter does not replay its graph, so its compute buffers are guessed; once the emulated GPU runs, the
    # build's projection of it replaces the guess, and bench warns exactly as `fitter estimate` does either way
    from fitter.memory.plan.projected import guess_warning, projection_warning

    model = golden_arch_model("phi2-dense")
    spec = load_model_spec(str(model))
    args = ("-c", "2048", "-np", "1", "-p", "32", "-n", "8", "-r", "2", "-ngl", "all", "--emulated-gpu", "64")
    tools = llama_tools["llama-fit-params"].parent
    code, out = _bench(*args, model=model, tools=tools)
    assert code == 0 and out["outcome"] == "ok", out["reason"]
    (gpu,) = out["peak_vram"]
    source = out["projection"]["source"]
    assert source.startswith("llama-fit-params --fit-print on of ")
    assert any(w.startswith(projection_warning(spec, (), source)) for w in out["warnings"]), out["warnings"]
    assert guess_warning(spec) not in out["warnings"]
    assert [(b["buft"], b["kind"], b["estimated_from"]) for b in out["buffers"] if b["kind"] != "model"] == [
        ("CPU", "output", "fitter"), (gpu, "kv", "fitter"), (gpu, "compute", "projection"),
        ("CPU", "compute", "projection")]
    code, out = _bench(*args, "--projection", "never", model=model, tools=tools)
    assert code == 0 and guess_warning(spec) in out["warnings"] and "projection" not in out
    assert {b["kind"]: b["estimated_from"] for b in out["buffers"] if b["buft"] == "CPU"} == {
        "output": "fitter", "compute": "guess"}


@pytest.mark.llama
def test_bench_over_the_cap_is_an_oom_state_not_a_zero() -> None:
    code, out = _bench("-c", "65536", "-np", "1", "-ngl", "all", "-p", "32", "-n", "8", "--emulated-gpu", "2")
    assert code == 1 and out["outcome"] == "oom" and "pp" not in out and "RPC0[" in out["reason"]


@pytest.mark.llama
@pytest.mark.tools("llama-server")
def test_bench_through_the_users_llama_server(llama_tools: dict[str, Path]) -> None:
    server = str(llama_tools["llama-server"])
    code, out = _bench("-c", "2048", "-np", "1", "-p", "64", "-n", "8", "-r", "2", "-ngl", "all", "--emulated-gpu",
                       "16", "--llama-server", server)
    assert code == 0 and out["backend"] == "llama-server" and out["pp"]["avg_ts"] > 0 and out["tg"]["avg_ts"] > 0
    _exact(out)
    code, out = _bench("-c", "65536", "-np", "1", "-ngl", "all", "--emulated-gpu", "2", "--llama-server", server)
    assert code == 1 and out["outcome"] == "oom" and "pp" not in out


@pytest.mark.load
@pytest.mark.llama
@pytest.mark.tools("llama-server")
def test_llama_server_and_the_worker_measure_the_same_quantities(llama_tools: dict[str, Path]) -> None:
    # the same tokens at the same depth from one llama.cpp source; whether their speeds agree is judged by
    # benchmarks/server_vs_worker.py (interleaved rounds, fitter.noise): beside busy processes the two backends are
    # scheduled differently (the README's test command beside two busy loops: decode 584 vs 243 t/s), which no
    # noise model cancels
    server = str(llama_tools["llama-server"])
    demo = subprocess.run([sys.executable, "-m", "fitter.cli", "demo-model"], capture_output=True, text=True,
                          check=True).stdout.strip()
    args = [demo, "--json", "-t", "1", "-p", "128", "-n", "32", "-d", "64", "-r", "5"]

    def run(*extra: str) -> dict:  # type: ignore[type-arg]
        return json.loads(subprocess.run([sys.executable, "-m", "fitter.cli", "bench", *args, *extra],
                                         capture_output=True, text=True, timeout=300).stdout)

    server, worker = run("--llama-server", server), run()
    assert server["outcome"] == worker["outcome"] == "ok"
    assert server["peak_rss"] > 50 * MIB and worker["peak_rss"] > 50 * MIB
    for key, n in (("pp", 128), ("tg", 32)):  # prefill of -p tokens; decode of -n tokens after -d tokens
        assert (server[key]["n"], server[key]["depth"], len(server[key]["samples_ts"])) == (n, 64, 5), server[key]
        assert (worker[key]["n"], worker[key]["depth"], len(worker[key]["samples_ts"])) == (n, 64, 5), worker[key]
        assert min(server[key]["samples_ts"]) > 0 and min(worker[key]["samples_ts"]) > 0
    assert server["llama_cpp"]["commit"] == worker["llama_cpp"]["commit"].removesuffix("-dirty")  # one source
    assert "--version" in server["llama_cpp"]["source"] and "ggml_commit()" in worker["llama_cpp"]["source"]


def test_llama_bench_command_line_and_json() -> None:
    from fitter.measure.llama_bench import llama_bench_argv, parse_llama_bench_json

    config = parse_launch_flags(["-ncmoe", "2", "-ot", r"blk\.5\.=CPU,exps=CPU", "-nkvo", "-fa", "on", "-nr"])
    argv = llama_bench_argv("lb", "m.gguf", config, BenchSpec(n_prompt=64, n_gen=16, repetitions=2, threads=2))
    assert argv == ["lb", "-m", "m.gguf", "-p", "64", "-n", "16", "-d", "0", "-r", "2", "-t", "2", "-b", "2048",
                    "-ub", "512", "-ctk", "f16", "-ctv", "f16", "-fa", "on", "-ngl", "999", "-ncmoe", "2",
                    "-ot", r"blk\.5\.=CPU;exps=CPU", "-nkvo", "1", "--repack", "0", "-o", "json", "-v"]
    rows = [{"n_prompt": 64, "n_gen": 0, "n_depth": 0, "samples_ns": [2_000_000, 4_000_000]},
            {"n_prompt": 0, "n_gen": 16, "n_depth": 0, "samples_ns": [1_000_000, 1_000_000]}]
    pp, tg = parse_llama_bench_json(json.dumps(rows))
    assert pp is not None and pp.samples_ts == (32000.0, 16000.0) and pp.avg_ts == 24000.0
    assert tg is not None and tg.avg_ts == 16000.0 and tg.stddev_ts == 0.0


@pytest.mark.llama
@pytest.mark.tools("llama-bench")
def test_bench_through_the_users_llama_bench(llama_tools: dict[str, Path]) -> None:
    code, out = _bench("-p", "32", "-n", "8", "-r", "2", "--llama-bench", str(llama_tools["llama-bench"]))
    assert code == 0 and out["backend"] == "llama-bench" and "p+n+d" in out["reason"]
    assert out["llama_cpp"]["commit"] not in ("", "unknown") and "build_commit" in out["llama_cpp"]["source"]
    assert out["pp"]["avg_ts"] > 0 and len(out["tg"]["samples_ts"]) == 2
    assert {b["kind"] for b in out["buffers"]} == {"model", "kv", "compute", "output"}


def test_machine_record_fingerprints_what_does_not_change_between_runs() -> None:
    from fitter.machine.cpu import build_cpu_info, read_cpu_snapshot
    from fitter.machine.snapshot import machine_record

    cpu = build_cpu_info(read_cpu_snapshot())
    a = machine_record(cpu, 24 << 30, ["NVIDIA H200"], "580.1")
    b = machine_record(cpu, 24 << 30, ["NVIDIA H200"], "580.1")
    assert a == b and len(a["fingerprint"]) == 16
    assert machine_record(cpu, 32 << 30, ["NVIDIA H200"], "580.1")["fingerprint"] != a["fingerprint"]
    assert a["physical_cores"] == cpu.physical_cores and a["gpus"] == ["NVIDIA H200"]


def test_cpu_mask_and_range_like_llama_cpp() -> None:
    from fitter.errors import LaunchConfigError
    from fitter.flags import parse_cpu_mask

    assert parse_cpu_mask("0x5", None) == (0, 2)
    assert parse_cpu_mask("0x1", "2-3") == (0, 2, 3)
    assert parse_cpu_mask(None, None) is None
    with pytest.raises(LaunchConfigError, match=r"--cpu-range '3-1': expected lo-hi"):
        parse_cpu_mask(None, "3-1")


@pytest.mark.llama
def test_bench_worker_runs_on_the_cpus_it_was_given() -> None:
    code, out = _bench("-c", "1024", "-np", "1", "-p", "16", "-n", "4", "-r", "1", "--cpu-mask", "0x1")
    assert code == 0 and out["cpus"] == [0] and out["outcome"] == "ok"


@pytest.mark.llama
def test_worker_child_is_pinned_to_the_given_cpus() -> None:
    import os

    from fitter.measure.worker import LlamaWorker

    with LlamaWorker(cpus=(0,)) as worker:
        worker.start()
        assert worker.pid is not None and os.sched_getaffinity(worker.pid) == {0}


@pytest.mark.llama
def test_bench_takes_a_separate_prefill_thread_count() -> None:
    code, out = _bench("-c", "2048", "-np", "1", "-p", "32", "-n", "8", "-r", "1", "-tb", "2")
    assert code == 0 and out["threads"] == 1 and out["threads_batch"] == 2
    proc = subprocess.run([sys.executable, "-m", "fitter.cli", "bench", "-tb", "2", "--llama-bench", "/bin/true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "llama-bench has one thread count" in proc.stderr
