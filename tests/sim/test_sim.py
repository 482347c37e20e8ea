"""Simulated machines (fitter/sim/): the seeds' figures, the model's physics, determinism, memory, profiles."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest

from fitter.errors import FitterError
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import ModelSpec, load_model_spec
from fitter.measure.runners import TrialRunner
from fitter.measure.types import BenchSpec, TrialResult, WorkerError
from fitter.memory.backends.devices import CPU_AVX2, CUDA, Device
from fitter.sim import MACHINES_DIR, Machine, SimRunner, load_machine, machines_table, shipped_machines, speeds
from fitter.sim.physics import thread_capacity, ubatch_stages
from fitter.units import GIB, MIB
from tests.models import model_file

# The seeds' launch: `--n-cpu-moe N --n-gpu-layers 999 -c 0 -fa`, llama-server's defaults otherwise (-ub 512 -b 2048,
# f16 KV); threads: llama.cpp's default on a hybrid CPU is its P-cores, which is also the seeds' advice (-t 8).
SEEDS_FLAGS = ["-c", "0", "-fa", "on", "-ngl", "999"]
SEEDS_BENCH = BenchSpec(threads=8)


@cache
def spec(shape: str) -> ModelSpec:
    return load_model_spec(str(model_file(shape, sparse=True)))


def runner(machine: str, shape: str, seed: int | None = None) -> SimRunner:
    return SimRunner(load_machine(machine), spec(shape), seed)


def run(r: SimRunner, flags: list[str], bench: BenchSpec = SEEDS_BENCH) -> TrialResult:
    return r.run(r.spec.path, parse_launch_flags(flags), bench, None)


def noise_free(machine: str, shape: str, flags: list[str], bench: BenchSpec = SEEDS_BENCH) -> tuple[float, float]:
    r = runner(machine, shape)
    return speeds(r.machine, r.plan(parse_launch_flags(flags)), bench)


# --- the seeds' figures ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("ncmoe", "pp", "tg", "vram_gb"), [
    (36, 134.4, 25.6, 8),  # every expert on the CPU: "7.44 ms/token prompt, 39.03 ms/token decode, 8 GB VRAM"
    (28, 163.0, 30.8, 22),  # 8 layers' experts on the GPU: "6.13 ms / 32.45 ms, 22 GB"
])
def test_seeds_figures_within_15_percent(ncmoe: int, pp: float, tg: float, vram_gb: float) -> None:
    result = run(runner("seeds", "gpt-oss-120b"), [*SEEDS_FLAGS, "-ncmoe", str(ncmoe)])
    m = result.measurement
    assert m.outcome == "ok", m.reason
    assert m.pp is not None and m.tg is not None
    assert abs(m.pp.avg_ts / pp - 1) <= 0.15, m.pp
    assert abs(m.tg.avg_ts / tg - 1) <= 0.15, m.tg
    assert abs(result.peak_vram["CUDA0"]["bytes"] / (vram_gb * 1e9) - 1) <= 0.15


def test_seeds_figures_exact() -> None:
    # Deterministic: the figures the calibration test checks, pinned (update them with the profile, knowingly).
    r = runner("seeds", "gpt-oss-120b")
    all_cpu, eight_on_gpu = (run(r, [*SEEDS_FLAGS, "-ncmoe", str(n)]) for n in (36, 28))
    assert all_cpu.measurement.pp is not None and all_cpu.measurement.tg is not None
    assert all_cpu.measurement.pp.avg_ts == pytest.approx(136.17, abs=0.01)
    assert all_cpu.measurement.tg.avg_ts == pytest.approx(25.81, abs=0.01)
    assert eight_on_gpu.measurement.pp is not None and eight_on_gpu.measurement.tg is not None
    assert eight_on_gpu.measurement.pp.avg_ts == pytest.approx(167.13, abs=0.01)
    assert eight_on_gpu.measurement.tg.avg_ts == pytest.approx(31.42, abs=0.01)
    # the estimator's device total (op offload's copy of the largest expert tensor included) plus the 450 MiB CUDA
    # context of the profile
    plan = r.plan(parse_launch_flags([*SEEDS_FLAGS, "-ncmoe", "36"]))
    assert all_cpu.peak_vram == {"CUDA0": {"bytes": plan.totals()["CUDA0"].total + 450 * MIB, "source": "sim"}}
    assert all_cpu.peak_vram["CUDA0"]["bytes"] == 7_793_809_536  # with op offload's copies (was 7_206_197_248)
    assert eight_on_gpu.peak_vram["CUDA0"]["bytes"] == 21_365_662_848  # was 20_848_829_440


# --- the physics ----------------------------------------------------------------------------------------------------


def test_fewer_cpu_experts_decode_faster() -> None:
    tg = [noise_free("seeds", "gpt-oss-120b", [*SEEDS_FLAGS, "-ncmoe", str(n)])[1] for n in (36, 32, 28, 24)]
    assert tg == sorted(tg) and len(set(tg)) == 4
    tg = [noise_free("gpu-8gb", "gpt-oss-20b", ["-c", "8192", "-ncmoe", str(n)])[1] for n in (24, 20, 16, 12)]
    assert tg == sorted(tg) and len(set(tg)) == 4


def test_larger_ubatch_prefills_faster_under_op_offload() -> None:
    bench = BenchSpec(n_prompt=4096, threads=8)
    pp = [noise_free("seeds", "gpt-oss-120b", [*SEEDS_FLAGS, "-ncmoe", "36", "-b", "4096", "-ub", str(ub)], bench)[0]
          for ub in (128, 256, 512, 1024, 2048, 4096)]
    assert pp == sorted(pp) and len(set(pp)) == 6
    # each ubatch copies every CPU-resident expert over PCIe, so prefill scales almost with -ub
    assert pp[-1] / pp[2] > 5
    # below 32 tokens nothing is offloaded: the CPU computes the experts itself
    no_offload = noise_free("seeds", "gpt-oss-120b", [*SEEDS_FLAGS, "-ncmoe", "36", "--no-op-offload"], bench)[0]
    assert no_offload < pp[-1]


@pytest.mark.parametrize(("machine", "shape", "physical"), [
    ("seeds", "gpt-oss-120b", 24),  # 8 P-cores with SMT + 16 E-cores: 24 cores, 32 threads
    ("cpu-16c", "gpt-oss-20b", 16),
])
def test_threads_beyond_physical_cores_do_not_help_decode(machine: str, shape: str, physical: int) -> None:
    flags = ["-c", "4096", "-ncmoe", "36"] if machine == "seeds" else ["-c", "4096"]
    tg = {t: noise_free(machine, shape, flags, BenchSpec(threads=t))[1] for t in (1, 4, physical, physical + 4,
                                                                                   2 * physical, 3 * physical)}
    assert tg[1] < tg[4]
    assert tg[physical] > tg[physical + 4] > tg[2 * physical] > tg[3 * physical]


def test_thread_capacity_pcores_then_ecores_then_smt() -> None:
    cpu = load_machine("seeds").cpu  # 8 P (SMT 2) + 16 E at 0.45, SMT gain 0.15
    assert thread_capacity(cpu, 8) == (8, 8)
    assert thread_capacity(cpu, 24) == pytest.approx((15.2, 15.2))  # E-cores add less than P-cores
    assert thread_capacity(cpu, 32) == pytest.approx((16.4, 15.2))  # siblings add compute, no bandwidth
    assert thread_capacity(cpu, 64) == pytest.approx((8.2, 7.6))  # oversubscribed: time slicing


def test_decode_saturates_at_the_memory_limit() -> None:
    flags = [*SEEDS_FLAGS, "-ncmoe", "36"]
    tg = {t: noise_free("seeds", "gpt-oss-120b", flags, BenchSpec(threads=t))[1] for t in (2, 4, 8, 16)}
    assert tg[4] / tg[2] > 1.8  # below the limit each P-core adds its own stream
    assert tg[16] <= tg[8]  # past it E-cores only add barrier cost


def test_kv_cache_type_and_flash_attention_at_depth() -> None:
    flags = [*SEEDS_FLAGS, "-c", "65536", "-ncmoe", "28"]
    deep = BenchSpec(threads=8, n_depth=32768)
    f16 = noise_free("seeds", "gpt-oss-120b", flags, deep)
    q8 = noise_free("seeds", "gpt-oss-120b", [*flags, "-ctk", "q8_0", "-ctv", "q8_0"], deep)
    fa_off = noise_free("seeds", "gpt-oss-120b", [*flags, "-fa", "off"], deep)
    shallow = noise_free("seeds", "gpt-oss-120b", flags)
    assert q8[1] > f16[1]  # half the KV bytes read per token
    assert fa_off[1] < f16[1] and fa_off[0] < f16[0]  # the f32 scores go through memory
    assert shallow[1] > f16[1]  # KV reads grow with depth


def test_dense_model_partially_on_a_16gb_gpu() -> None:
    r = runner("gpu-16gb", "qwen3-14b")
    tg = []
    for ngl in (0, 10, 20, 30, 40):
        m = run(r, ["-c", "8192", "-ngl", str(ngl)], BenchSpec(threads=6)).measurement
        assert m.outcome == "ok" and m.tg is not None, m.reason
        tg.append(m.tg.avg_ts)
    assert tg == sorted(tg)
    full = run(r, ["-c", "8192", "-ngl", "all"], BenchSpec(threads=6)).measurement
    assert full.outcome == "oom" and full.oom is not None and full.oom.buft == "CUDA0"


# --- determinism ----------------------------------------------------------------------------------------------------


def test_same_seed_same_samples_in_any_order() -> None:
    a, b = runner("seeds", "gpt-oss-20b"), runner("seeds", "gpt-oss-20b")
    x, y = ["-c", "8192", "-ncmoe", "4"], ["-c", "8192", "-ncmoe", "8", "-ub", "1024"]
    ax, ay = run(a, x).measurement, run(a, y).measurement
    by, bx = run(b, y).measurement, run(b, x).measurement
    assert ax.pp == bx.pp and ax.tg == bx.tg and ay.tg == by.tg
    assert ax.tg is not None and len(set(ax.tg.samples_ns)) == 3  # noisy: each repetition differs
    other = run(runner("seeds", "gpt-oss-20b", seed=7), x).measurement
    assert other.tg is not None and other.tg.samples_ns != ax.tg.samples_ns
    assert other.tg.avg_ts == pytest.approx(ax.tg.avg_ts, rel=0.05)


def test_noise_free_profile_gives_the_model_itself(tmp_path: Path) -> None:
    text = (MACHINES_DIR / "seeds.toml").read_text().replace("noise = 0.02", "noise = 0")
    (tmp_path / "quiet.toml").write_text(text)
    r = SimRunner(load_machine(tmp_path / "quiet.toml"), spec("gpt-oss-20b"))
    m = run(r, ["-c", "8192"]).measurement
    pp, tg = speeds(r.machine, r.plan(parse_launch_flags(["-c", "8192"])), SEEDS_BENCH)
    assert m.pp is not None and m.tg is not None
    assert len(set(m.tg.samples_ns)) == 1
    assert m.pp.avg_ts == pytest.approx(pp, rel=1e-6) and m.tg.avg_ts == pytest.approx(tg, rel=1e-6)


def test_run_noise_scales_a_whole_run_and_differs_between_runs_of_one_config(tmp_path: Path) -> None:
    text = (MACHINES_DIR / "seeds.toml").read_text().replace("noise = 0.02", "noise = 0\nrun_noise = 0.1")
    (tmp_path / "busy.toml").write_text(text)
    r = SimRunner(load_machine(tmp_path / "busy.toml"), spec("gpt-oss-20b"))
    first, second = run(r, ["-c", "8192"]).measurement, run(r, ["-c", "8192"]).measurement
    assert first.tg is not None and second.tg is not None
    assert len(set(first.tg.samples_ns)) == 1  # one factor on every repetition of a run
    assert first.tg.avg_ts != second.tg.avg_ts
    again = SimRunner(load_machine(tmp_path / "busy.toml"), spec("gpt-oss-20b"))
    assert run(again, ["-c", "8192"]).measurement.tg == first.tg  # seeded: the same first run again
    quiet = runner("seeds", "gpt-oss-20b")  # no run_noise: runs of one config are identical, as before
    assert run(quiet, ["-c", "8192"]).measurement.tg == run(quiet, ["-c", "8192"]).measurement.tg



def test_pace_makes_a_run_take_its_simulated_time_in_real_time(tmp_path: Path) -> None:
    (tmp_path / "seeds.toml").write_text((MACHINES_DIR / "seeds.toml").read_text().replace(
        "noise = 0.02", "noise = 0.02\npace = 0.1"))
    paced = SimRunner(load_machine(tmp_path / "seeds.toml"), spec("gpt-oss-20b"))
    started = time.monotonic()
    m = run(paced, ["-c", "8192"]).measurement
    took = time.monotonic() - started
    instant = run(runner("seeds", "gpt-oss-20b"), ["-c", "8192"]).measurement
    assert replace(m, llama_cpp=instant.llama_cpp) == instant  # the same figures, only slower
    assert m.wall_s == 5.659 and 0.5659 <= took < 0.5659 + 2.0, took  # 5.659 simulated seconds at a tenth

def test_model_reused_when_model_level_flags_repeat() -> None:
    r = runner("seeds", "gpt-oss-20b")
    first = run(r, ["-c", "8192", "-ncmoe", "4"]).measurement
    context_only = run(r, ["-c", "8192", "-ncmoe", "4", "-ub", "1024", "-ctk", "q8_0"]).measurement
    moved = run(r, ["-c", "8192", "-ncmoe", "6"]).measurement
    assert (first.reused_model, context_only.reused_model, moved.reused_model) == (False, True, False)
    assert first.load_s is not None and first.load_s > 0 and context_only.load_s == 0.0
    assert (r.trials_run, r.model_loads) == (3, 2)


# --- memory ---------------------------------------------------------------------------------------------------------


def test_over_gpu_memory_is_oom_naming_buffer_device_and_bytes() -> None:
    r = runner("gpu-8gb", "gpt-oss-120b")
    flags = ["-c", "8192", "-ncmoe", "32"]
    m = run(r, flags).measurement
    plan = r.plan(parse_launch_flags(flags))
    model_buffer = next(b for b in plan.buffers if b.buft == "CUDA0" and b.kind == "model")
    assert m.outcome == "oom" and m.pp is None and m.tg is None
    assert m.oom is not None
    assert (m.oom.stage, m.oom.buft, m.oom.requested_bytes) == ("model", "CUDA0", model_buffer.bytes)
    assert f"CUDA0 refused {model_buffer.bytes} bytes" in m.reason
    assert "sim machine gpu-8gb" in m.reason


def test_kv_oom_logs_the_buffers_allocated_before() -> None:
    r = runner("gpu-8gb", "gpt-oss-20b")
    m = run(r, ["-c", "8192", "-ncmoe", "9"]).measurement
    assert m.oom is not None and (m.oom.stage, m.oom.buft) == ("kv", "CUDA0")
    assert [(b.buft, b.kind) for b in m.buffers] == [("CPU_Mapped", "model"), ("CUDA0", "model")]
    # the tuner learns a margin from what the device held plus the refused request: never above the free memory
    held = sum(b.mib * MIB for b in m.buffers if b.buft == "CUDA0")
    assert held + (m.oom.requested_bytes or 0) > 7.6 * GIB - 350 * MIB
    # the model stayed loaded (only its context failed)
    assert run(r, ["-c", "4096", "-ncmoe", "9"]).measurement.reused_model


def test_over_ram_is_oom_on_the_cpu() -> None:
    m = run(runner("gpu-16gb", "gpt-oss-120b"), ["-c", "8192", "-cmoe"]).measurement
    assert m.outcome == "oom" and m.oom is not None
    assert (m.oom.stage, m.oom.buft) == ("model", "CPU_Mapped")
    assert "of RAM" in m.reason


def test_rejected_config_and_test_outside_the_context() -> None:
    r = runner("seeds", "gpt-oss-20b")
    with pytest.raises(WorkerError, match="the test needs 4608 cells"):
        run(r, ["-c", "4096"], BenchSpec(n_prompt=512, n_depth=4096))
    with pytest.raises(WorkerError, match=r"llama\.cpp rejected"):
        run(r, ["-c", "4096", "-ot", "exps=CUDA7"])


def test_timeout_past_the_limit() -> None:
    r = runner("seeds", "gpt-oss-120b")
    m = r.run(r.spec.path, parse_launch_flags([*SEEDS_FLAGS, "-ncmoe", "36"]), SEEDS_BENCH, 5.0).measurement
    assert m.outcome == "timeout" and m.pp is None and "killed after 5 s" in m.reason


# --- the runner's surface -------------------------------------------------------------------------------------------


def test_runner_surface() -> None:
    r: TrialRunner = runner("seeds", "gpt-oss-20b")
    assert (r.backend, r.emulated) == ("sim", False)
    sim = runner("seeds", "gpt-oss-20b")
    assert sim.devices() == (Device("CUDA0", CUDA, 24 * GIB, 24 * GIB - GIB // 2),)
    assert sim.cpu_profile() == CPU_AVX2
    assert sim.build() == {"commit": "sim-seeds", "source": f"fitter.sim model of {MACHINES_DIR / 'seeds.toml'}"}
    assert runner("cpu-16c", "gpt-oss-20b").devices() == ()
    m = run(sim, ["-c", "8192"]).measurement
    assert [(b.buft, b.kind) for b in m.buffers][:2] == [("CPU_Mapped", "model"), ("CUDA0", "model")]
    assert m.llama_cpp == sim.build() and m.wall_s > m.load_s > 0  # type: ignore[operator]


# --- profiles -------------------------------------------------------------------------------------------------------


def test_shipped_profiles_load_and_are_listed() -> None:
    names = shipped_machines()
    assert {"seeds", "gpu-8gb", "gpu-12gb", "gpu-16gb", "cpu-16c"} <= set(names)
    table = machines_table()
    for name in names:
        m = load_machine(name)
        assert isinstance(m, Machine) and m.name == name and m.description and m.models
        assert name in table
    assert load_machine("cpu-16c").gpu is None
    assert load_machine("cpu-16c").ram.channels == 8
    assert load_machine(MACHINES_DIR / "seeds.toml") == load_machine("seeds")


GOOD = """\
description = "x"
[gpu]
memory_gib = 8
bandwidth_gbps = 300
tflops = 10
pcie_gbps = 12
[cpu]
p_cores = 8
core_gflops = 100
core_gbps = 10
[ram]
gib = 32
channels = 2
mts = 4800
"""


@pytest.mark.parametrize(("change", "message"), [
    (("description", "colour = 1\ndescription"),
     "unknown key 'colour'; allowed: description, models, disk_gbps, noise, run_noise, seed, routing_spread_first, "
     "routing_spread_last, pace, gpu, cpu, ram"),
    (("tflops = 10", "tflops = 10\nwatts = 300"), "unknown key 'watts' in [gpu]; allowed: memory_gib, bandwidth_gbps"),
    (("memory_gib = 8", "memory_gib = -8"), "gpu.memory_gib = -8: must be a number > 0 (memory of each GPU)"),
    (("p_cores = 8", 'p_cores = "eight"'), "cpu.p_cores = 'eight': must be an integer >= 1"),
    (("p_cores = 8", "p_cores = 8.5"), "cpu.p_cores = 8.5: must be an integer >= 1"),
    (("mts = 4800", "mts = 4800\nefficiency = 1.5"), "ram.efficiency = 1.5: must be a number > 0 and <= 1"),
    (("core_gbps = 10", 'core_gbps = 10\nisa = "sse"'), "cpu.isa = 'sse': must be one of avx2, avx512, none"),
    (('description = "x"', "description = 3"), "description = 3: must be a string"),
    (('description = "x"', 'description = "x"\nnoise = true'), "noise = True: must be a number >= 0 and <= 0.5"),
    (("[ram]\ngib = 32\n", "[ram]\n"), "[ram] is missing gib"),
    (("[cpu]", "[cpus]"), "unknown key 'cpus'"),
    (("tflops = 10", "tflops = "), "cannot read the machine profile"),
    (("[gpu]\nmemory_gib = 8\nbandwidth_gbps = 300\ntflops = 10\npcie_gbps = 12\n", "gpu = []\n"),
     "gpu = []: must be a table [gpu] or tables [[gpu]]"),
    (("[gpu]", "[[gpu]]\nmemory_gib = 4\n[[gpu]]"), "[gpu #1] is missing bandwidth_gbps"),
])
def test_bad_profiles_name_file_key_and_value(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    path = tmp_path / "bad.toml"
    old, new = change
    assert old in GOOD
    path.write_text(GOOD.replace(old, new, 1))
    with pytest.raises(FitterError) as e:
        load_machine(path)
    assert str(path) in str(e.value)
    assert message in str(e.value)


def test_missing_table_and_unknown_machine(tmp_path: Path) -> None:
    path = tmp_path / "nocpu.toml"
    path.write_text(GOOD.split("[cpu]")[0])
    with pytest.raises(FitterError, match=r"missing table \[cpu\] \(only \[gpu\] may be left out"):
        load_machine(path)
    with pytest.raises(FitterError, match=r"'no-such-box': neither a shipped profile \(.*seeds.*\) nor a file"):
        load_machine("no-such-box")
    path.write_text(GOOD)
    m = load_machine(path)
    assert m.gpu is not None and m.gpu.count == 1 and m.cpu.smt == 1 and m.ram.efficiency == 0.65


# --- two or more GPUs -------------------------------------------------------------------------------------------------


def test_gpu_tables_in_cuda_order_each_kind_with_its_count() -> None:
    m = load_machine("gpu-4090-2x3060")
    assert [(g.name, g.memory_gib, g.bandwidth_gbps) for g in m.gpus] == [
        ("RTX 4090", 24, 900), ("RTX 3060", 12, 310), ("RTX 3060", 12, 310)]
    r = SimRunner(m, spec("gpt-oss-120b"))
    assert [(d.name, d.total_bytes, d.free_bytes) for d in r.devices()] == [
        ("CUDA0", 24 * GIB, 24 * GIB - GIB // 2), ("CUDA1", 12 * GIB, 12 * GIB - round(0.1 * GIB)),
        ("CUDA2", 12 * GIB, 12 * GIB - round(0.1 * GIB))]
    assert m.peer_gbps("CUDA1", "CUDA2") == 6  # no peer link: through the host at the slower PCIe
    assert load_machine("gpu-2x3090").peer_gbps("CUDA0", "CUDA1") == 45
    assert "1× 24 GiB 900 GB/s 80 TFLOPS, PCIe 24 GB/s + 2× 12 GiB 310 GB/s" in machines_table()


def test_a_model_on_the_faster_gpu_alone_decodes_faster_by_about_their_bandwidths() -> None:
    flags = ["-c", "8192", "-fa", "on", "-ngl", "all", "-sm", "none", "-mg"]
    fast, slow = (noise_free("gpu-3090-3060", "gpt-oss-20b", [*flags, g], BenchSpec(threads=16))[1] for g in "01")
    assert 1.8 < fast / slow < 800 / 310  # bandwidth-bound, less the per-op costs both pay


def test_op_offload_runs_on_the_one_gpu_split_mode_none_keeps() -> None:
    # -sm none -mg 1: the scheduler has CUDA1 and the CPU only, so CPU-resident experts are offloaded to CUDA1
    flags = ["-c", "8192", "-fa", "on", "-ngl", "all", "-sm", "none", "-mg", "1", "-ot",
             r"blk\.(20|21|22|23)\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"]
    r = runner("gpu-3090-3060", "gpt-oss-20b")
    stages = ubatch_stages(r.machine, r.plan(parse_launch_flags(flags)), 512, 1024, 16)
    assert set(stages) == {"CPU", "CUDA1"} and stages["CUDA1"] > 0


def test_each_hop_between_gpus_costs_the_activation_copy_over_their_link() -> None:
    # the same split on two equal 3090s, bridged (45 GB/s) or through the host (12 GB/s): prefill hops 2048 tokens
    flags = ["-c", "8192", "-fa", "on", "-ngl", "all", "-ts", "12,13", "-ub", "2048", "-b", "2048"]
    r = runner("gpu-2x3090", "gpt-oss-20b")
    plan = r.plan(parse_launch_flags(flags))
    bridged = speeds(r.machine, plan, BenchSpec(threads=8, n_prompt=2048))[0]
    no_bridge = replace(r.machine, gpus=tuple(replace(g, peer_gbps=0.0) for g in r.machine.gpus))
    through_host = speeds(no_bridge, plan, BenchSpec(threads=8, n_prompt=2048))[0]
    hop = 2048 * r.spec.n_embd * 4.0
    expected = 2048 / (2048 / bridged + hop / 12e9 - hop / 45e9)
    assert through_host == pytest.approx(expected, rel=1e-9)


def test_a_pipelined_batch_overlaps_its_ubatches_across_the_gpus() -> None:
    flags = ["-c", "8192", "-fa", "on", "-ngl", "all", "-ub", "512", "-b", "2048"]
    r = runner("gpu-2x3090", "gpt-oss-20b")
    plan = r.plan(parse_launch_flags(flags))
    assert plan.pipelined
    bench = BenchSpec(threads=8, n_prompt=2048)
    serial = speeds(r.machine, replace(plan, pipelined=False), bench)[0]
    assert 1.5 < speeds(r.machine, plan, bench)[0] / serial < 2  # two stages: at most twice, less the fill


# --- profiles where fitter's prior is wrong (issue 14, 4b) -----------------------------------------------------------


def _variant(tmp_path: Path, machine: str, old: str, new: str) -> Machine:
    text = (MACHINES_DIR / f"{machine}.toml").read_text()
    assert old in text
    (tmp_path / "variant.toml").write_text(text.replace(old, new, 1))
    return load_machine(tmp_path / "variant.toml")


def _speeds(m: Machine, shape: str, flags: list[str], bench: BenchSpec) -> tuple[float, float]:
    r = SimRunner(m, spec(shape))
    return speeds(m, r.plan(parse_launch_flags(flags)), bench)


def test_static_split_runs_every_thread_at_the_slowest_threads_pace() -> None:
    cpu = load_machine("laptop-2p8e").cpu  # 2P (SMT 2) + 8E at 0.55, 60 % of the work split statically
    assert thread_capacity(cpu, 2) == (2, 2)
    # 10 threads: 2 + 8 · 0.55 = 6.4 shared by speed, 10 · 0.55 = 5.5 at the E-cores' pace; 1 / (0.6/5.5 + 0.4/6.4)
    assert thread_capacity(cpu, 10) == pytest.approx((1 / (0.6 / 5.5 + 0.4 / 6.4),) * 2)
    # 12 threads: two SMT siblings; bandwidth's slowest thread is then a sibling at half a core
    assert thread_capacity(cpu, 12) == pytest.approx((1 / (0.6 / 6.6 + 0.4 / 6.7), 1 / (0.6 / 6.0 + 0.4 / 6.4)))


def test_on_the_laptop_all_cores_beat_the_p_cores_but_slow_e_cores_hurt(tmp_path: Path) -> None:
    # fitter's prior (and llama.cpp's default) is -t = P-cores: on a 2P+8E laptop the E-cores are worth more
    flags = ["-c", "4096", "-fa", "on"]
    tg = {t: noise_free("laptop-2p8e", "gpt-oss-20b", flags, BenchSpec(threads=t))[1] for t in (2, 10)}
    assert tg[10] > 2 * tg[2]
    # ... while with 16 E-cores at 0.3 of a P-core and every op split statically, -t 24 runs at 24 · 0.3 = 7.2 of
    # the 8 P-cores' pace: the E-cores hurt
    slow = _variant(tmp_path, "seeds", "e_core_speed = 0.45", "e_core_speed = 0.3\nstatic_split = 1")
    tg = {t: _speeds(slow, "gpt-oss-120b", [*SEEDS_FLAGS, "-ncmoe", "36"], BenchSpec(threads=t))[1] for t in (8, 24)}
    assert tg[8] > tg[24]
    # with the work shared by speed (the shipped seeds profile) prefill gains from the E-cores instead
    bench = BenchSpec(threads=8)
    pp = {t: noise_free("seeds", "gpt-oss-120b", [*SEEDS_FLAGS, "-ncmoe", "36", "--no-op-offload"],
                        BenchSpec(threads=t))[0] for t in (8, 24)}
    assert pp[24] > pp[8] and bench.threads == 8


def test_busy_cores_leave_fewer_threads_and_oversubscription_waits_at_every_barrier(tmp_path: Path) -> None:
    busy = _variant(tmp_path, "cpu-16c", "sync_us = 0.15", "sync_us = 0.15\nbusy_cores = 8\nbarrier_wait_us = 200")
    assert thread_capacity(busy.cpu, 8) == (8, 8)
    assert thread_capacity(busy.cpu, 16) == pytest.approx((9.2, 8))  # the 8 free cores' SMT siblings
    assert thread_capacity(busy.cpu, 32) == pytest.approx((4.6, 4))  # 16 free hardware threads, time-sliced
    flags = ["-c", "4096"]
    tg = {t: _speeds(busy, "gpt-oss-20b", flags, BenchSpec(threads=t))[1] for t in (8, 16, 24)}
    assert tg[8] > tg[16] > 2 * tg[24]  # past the 16 free hardware threads the barriers collapse decode
    free = {t: noise_free("cpu-16c", "gpt-oss-20b", flags, BenchSpec(threads=t))[1] for t in (8, 16)}
    assert free[16] > tg[16] and free[16] > free[8]


def test_slow_flash_attention_on_the_arm_server() -> None:
    # fitter's prior keeps -fa on; on this CPU the fused kernel is the slow path (llama.cpp #27086)
    on = noise_free("arm-slowfa", "gpt-oss-120b", ["-c", "4096", "-fa", "on"], BenchSpec(threads=32))
    off = noise_free("arm-slowfa", "gpt-oss-120b", ["-c", "4096", "-fa", "off"], BenchSpec(threads=32))
    assert off[0] > 1.5 * on[0]  # prefill: #27086 measures 1.55-1.99x on Neoverse V1/V2
    assert off[1] > 1.04 * on[1]  # decode: beyond two repetitions' noise
    # at fa_efficiency 1 (every other shipped profile) flash attention is the faster path
    on, off = (noise_free("cpu-16c", "gpt-oss-120b", ["-c", "4096", "-fa", fa], BenchSpec(threads=16)) for fa in
               ("on", "off"))
    assert on[1] > off[1]  # decode reads the f32 scores three times without FA
    assert on[0] == off[0]  # prefill on the CPU is compute-bound: the scores' bytes hide under the flops


def test_slow_flash_attention_on_a_gpu(tmp_path: Path) -> None:
    slow = _variant(tmp_path, "seeds", "split_sync_us = 80", "split_sync_us = 80\nfa_efficiency = 0.2")
    flags, deep = [*SEEDS_FLAGS, "-c", "65536", "-ncmoe", "28"], BenchSpec(threads=8, n_depth=32768)
    on = _speeds(slow, "gpt-oss-120b", flags, deep)
    off = _speeds(slow, "gpt-oss-120b", [*flags, "-fa", "off"], deep)
    assert off[1] > on[1] and off[0] > on[0]


def test_pcie_bound_prefill_on_the_egpu_prefers_one_512_ubatch_to_the_largest() -> None:
    # fitter's prefill prior is the largest -ub that fits; a 512-token prompt is one ubatch at -ub 512 already, and
    # -ub 4096's compute buffer pushes 3 more layers' experts to the CPU, each copied over the 2 GB/s link
    base = ["-fa", "on", "-ngl", "all", "-ctk", "q8_0", "-ctv", "q8_0"]
    ub512 = [*base, "-ncmoe", "6", "-ub", "512", "-b", "2048"]
    ub4096 = [*base, "-ncmoe", "9", "-ub", "4096", "-b", "4096"]
    egpu = [noise_free("egpu-12gb", "gpt-oss-20b", f, BenchSpec(threads=8))[0] for f in (ub512, ub4096)]
    pcie16 = [noise_free("gpu-12gb", "gpt-oss-20b", f, BenchSpec(threads=6))[0] for f in (ub512, ub4096)]
    assert egpu[0] > 1.3 * egpu[1]
    assert egpu[0] / egpu[1] > pcie16[0] / pcie16[1]  # the narrower the link, the more the copies weigh


def test_busy_cores_must_leave_a_core(tmp_path: Path) -> None:
    path = tmp_path / "busy.toml"
    path.write_text(GOOD.replace("core_gbps = 10", "core_gbps = 10\nbusy_cores = 8", 1))
    with pytest.raises(FitterError, match=r"cpu.busy_cores = 8: must be below the 8 cores"):
        load_machine(path)


# --- a workload's streams (llama-server's slots decoding at once) ---------------------------------------------------


def test_streams_share_each_step_so_aggregate_decode_rises_and_each_stream_slows() -> None:
    flags = [*SEEDS_FLAGS, "-c", "65536", "-np", "4", "-ncmoe", "28"]
    tg = {s: noise_free("seeds", "gpt-oss-120b", flags, BenchSpec(threads=8, n_depth=8192, streams=s))[1]
          for s in (1, 2, 4)}
    assert tg[1] < tg[2] < tg[4]  # the weights read once per step serve a token of every stream
    assert tg[4] / 4 < tg[2] / 2 < tg[1]  # but every stream reads its own cache, and the experts used grow


def test_each_stream_reads_its_own_cache() -> None:
    from fitter.sim.physics import _attention

    r = runner("seeds", "gpt-oss-120b")
    plan = r.plan(parse_launch_flags([*SEEDS_FLAGS, "-c", "65536", "-np", "4"]))
    one, four = (_attention(r.machine, plan, 1, 4, 8192.0, n_seq) for n_seq in (1, 4))
    spec_ = plan.model
    cell = 2 * 2 * spec_.n_embd_k_gqa(1)  # f16 K and V rows of layer 1 (a full-attention layer of gpt-oss)
    assert not spec_.swa_layers[1]
    assert one[1] == four[1]  # each token attends its own sequence's cells: the same work
    assert four[2] - one[2] == pytest.approx(3 * 8192 * cell)


def test_a_simulated_server_reports_each_stream_and_the_first_token() -> None:
    r = runner("seeds", "gpt-oss-120b")
    bench = BenchSpec(threads=8, n_depth=4096, streams=4, repetitions=2)
    m = run(r, [*SEEDS_FLAGS, "-c", "65536", "-np", "4", "-ncmoe", "28"], bench).measurement
    assert m.tg is not None and m.tg_stream is not None and m.pp is not None and m.ttft is not None
    assert m.tg_stream.samples_ts == pytest.approx([x / 4 for x in m.tg.samples_ts], rel=1e-6)
    # the first tokens come when the four prompts, batched together, are prefilled
    assert m.ttft.samples_ms == pytest.approx([4 * 512 / x * 1000 for x in m.pp.samples_ts], rel=1e-6)


def test_more_streams_than_slots_is_refused() -> None:
    r = runner("seeds", "gpt-oss-120b")
    with pytest.raises(WorkerError, match=r"^4 streams at once but the config serves 2 \(-np\)"):
        run(r, [*SEEDS_FLAGS, "-c", "65536", "-np", "2", "-ncmoe", "28"], BenchSpec(threads=8, streams=4))
    with pytest.raises(WorkerError, match=r"^4 streams of 16896 cells .* unified KV cache holds 65536$"):
        run(r, [*SEEDS_FLAGS, "-c", "65536", "-ncmoe", "28"], BenchSpec(threads=8, n_depth=16384, streams=4))


# --- the model's routing: where the CPU's experts sit matters when layers route differently ---------------------


def routed_machine(tmp_path: Path, first: float, last: float) -> Machine:
    text = (MACHINES_DIR / "gpu-8gb.toml").read_text()
    path = tmp_path / "routed.toml"
    path.write_text(f"routing_spread_first = {first}\nrouting_spread_last = {last}\n{text}")
    return load_machine(path)


def order_speeds(machine: Machine) -> dict[str, tuple[float, float]]:
    """(prefill, decode) with gpt-oss-20b's 8 first or 8 last layers' experts on the CPU of an 8 GB GPU."""
    exps = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"
    base = ["-c", "8192", "-fa", "on", "-ngl", "all"]
    flags = {"first": [*base, "-ncmoe", "8"], "last": [*base, "-ot", rf"blk\.(16|17|18|19|20|21|22|23){exps}"]}
    r = SimRunner(machine, spec("gpt-oss-20b"))
    return {order: speeds(machine, r.plan(parse_launch_flags(f)), SEEDS_BENCH) for order, f in flags.items()}


def test_with_uniform_routing_the_expert_order_changes_nothing(tmp_path: Path) -> None:
    s = order_speeds(load_machine("gpu-8gb"))
    assert s["first"][0] == pytest.approx(s["last"][0], rel=1e-12)
    assert s["first"][1] == pytest.approx(s["last"][1], rel=1e-12)
    assert order_speeds(routed_machine(tmp_path, 1.0, 1.0)) == s  # the stated default


def test_routing_that_narrows_with_depth_makes_last_n_prefill_faster_and_decode_the_same(tmp_path: Path) -> None:
    s = order_speeds(routed_machine(tmp_path, 1.0, 0.002))  # late layers' tokens share experts: fewer read
    assert s["last"][0] / s["first"][0] == pytest.approx(1.0578, abs=1e-4)
    assert s["first"][1] == pytest.approx(s["last"][1], rel=1e-12)  # one token reads k of E in any layer


def test_a_routing_spread_outside_zero_to_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FitterError, match=r"routing_spread_last = 1.5: must be a number >= 0 and <= 1 \(the same in "
                                          r"its last expert layer"):
        routed_machine(tmp_path, 1.0, 1.5)
