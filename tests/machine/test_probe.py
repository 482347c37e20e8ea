from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fitter.errors import FitterError
from fitter.machine.cpu import (
    CpuSnapshot,
    build_cpu_info,
    cpu_flags,
    cpu_model,
    format_cpu_list,
    frequency_split,
    node_memory,
    parse_cpu_list,
    read_cpu_snapshot,
    relevant_isa,
)

# --- fixtures: the raw text of three machines ------------------------------------------------------------------
from fitter.machine.llama_cpp import (
    REINSTALL_GPU_BUILD,
    BackendDevice,
    BackendReg,
    LlamaCppInfo,
    detect_llama_cpp,
    gpu_build_problem,
    require_gpu_build,
)
from fitter.machine.nvidia import NO_DRIVER, cuda_version, detect_nvidia, memory_bandwidth_gbs


def _x86_cpuinfo(model: str, flags: str, n: int) -> str:
    return "\n\n".join(f"processor\t: {i}\nvendor_id\t: x\nmodel name\t: {model}\nflags\t\t: {flags}\n"
                       for i in range(n))


# i9-13900K: 8 P-cores with Hyper-Threading (CPUs 0-15, siblings 2k/2k+1), 16 E-cores (CPUs 16-31), two P-cores
# favoured by Turbo Boost Max 3.0; the kernel lists P and E CPUs under /sys/devices/cpu_core and cpu_atom.
INTEL_FLAGS = "fpu sse2 ssse3 fma avx f16c avx2 avx_vnni sha_ni"
INTEL_HYBRID = CpuSnapshot(
    arch="x86_64",
    cpuinfo=_x86_cpuinfo("13th Gen Intel(R) Core(TM) i9-13900K", INTEL_FLAGS, 32),
    siblings={**{c: f"{c & ~1}-{c | 1}" for c in range(16)}, **{c: str(c) for c in range(16, 32)}},
    max_freq_khz={**{c: "5800000" if c < 4 else "5500000" for c in range(16)}, **{c: "4300000" for c in range(16, 32)}},
    governors={c: "powersave\n" for c in range(32)},
    core_cpus="0-15\n",
    atom_cpus="16-31\n",
    nodes={0: ("0-31\n", "Node 0 MemTotal:       65536000 kB\nNode 0 MemFree: 1 kB\n")},
    logical_cpus=32,
    physical_cores=24,
    usable_cpus=tuple(range(32)),
)

# Ryzen 9 7950X: 16 cores, SMT siblings N and N+16, amd-pstate preferred cores boosting a few % above the rest.
AMD_FLAGS = "fpu sse2 ssse3 fma avx f16c avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16"
AMD_SMT = CpuSnapshot(
    arch="x86_64",
    cpuinfo=_x86_cpuinfo("AMD Ryzen 9 7950X 16-Core Processor", AMD_FLAGS, 32),
    siblings={c: f"{c % 16},{c % 16 + 16}" for c in range(32)},
    max_freq_khz={c: str((5881000, 5756000, 5631000, 5507000)[c % 4]) for c in range(32)},
    governors={c: "schedutil" for c in range(32)},
    nodes={0: ("0-31", None)},
    logical_cpus=32,
    physical_cores=16,
    usable_cpus=tuple(range(32)),
)

# RK3588: 4× Cortex-A55 at 1.8 GHz (CPUs 0-3), 4× Cortex-A76 at 2.35/2.4 GHz (CPUs 4-7), no SMT, no cpu_core/atom.
ARM_FEATURES = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
RK3588_CPUINFO = "\n\n".join(
    f"processor\t: {i}\nBogoMIPS\t: 48.00\nFeatures\t: {ARM_FEATURES}\nCPU implementer\t: 0x41\n"
    f"CPU architecture: 8\nCPU variant\t: 0x{'2' if i < 4 else '4'}\nCPU part\t: {'0xd05' if i < 4 else '0xd0b'}\n"
    f"CPU revision\t: 0\n" for i in range(8))
ARM_BIG_LITTLE = CpuSnapshot(
    arch="aarch64",
    cpuinfo=RK3588_CPUINFO,
    siblings={c: str(c) for c in range(8)},
    max_freq_khz={0: "1800000", 1: "1800000", 2: "1800000", 3: "1800000",
                  4: "2352000", 5: "2352000", 6: "2400000", 7: "2400000"},
    governors={c: "schedutil" for c in range(8)},
    nodes={0: ("0-7", "Node 0 MemTotal:       16133332 kB")},
    logical_cpus=8,
    physical_cores=8,
    usable_cpus=tuple(range(8)),
)


# --- pure parsers ----------------------------------------------------------------------------------------------


def test_intel_hybrid_uses_cpu_core_and_cpu_atom() -> None:
    cpu = build_cpu_info(INTEL_HYBRID)
    assert cpu.model == "13th Gen Intel(R) Core(TM) i9-13900K"
    assert (cpu.physical_cores, cpu.logical_cpus, cpu.smt) == (24, 32, True)
    assert cpu.hybrid_source == "cpu_core/cpu_atom"
    assert (cpu.performance_cores, cpu.efficiency_cores) == (8, 16)
    assert cpu.cores[0].cpus == (0, 1) and cpu.cores[0].max_freq_khz == 5800000
    assert cpu.cores[-1].cpus == (31,) and cpu.cores[-1].kind == "efficiency"
    assert cpu.recommended_threads == 8  # -t on the P-cores, one per physical core
    assert cpu.governor == "powersave"
    assert cpu.numa_nodes[0].cpus == tuple(range(32)) and cpu.numa_nodes[0].memory == 65536000 * 1024
    isa = dict(cpu.isa)
    assert isa["avx2"] and isa["avx_vnni"] and isa["fma"] and isa["f16c"] and not isa["avx512f"]


def test_intel_hybrid_without_pmu_lists_falls_back_to_max_frequency() -> None:
    snap = dataclasses.replace(INTEL_HYBRID, core_cpus=None, atom_cpus=None)
    cpu = build_cpu_info(snap)
    assert cpu.hybrid_source == "cpuinfo_max_freq"
    assert (cpu.performance_cores, cpu.efficiency_cores, cpu.recommended_threads) == (8, 16, 8)


def test_amd_smt_preferred_cores_are_not_hybrid() -> None:
    cpu = build_cpu_info(AMD_SMT)
    assert (cpu.physical_cores, cpu.logical_cpus, cpu.smt) == (16, 32, True)
    assert cpu.cores[3].cpus == (3, 19)
    assert cpu.hybrid_source is None and cpu.efficiency_cores == 0
    assert cpu.recommended_threads == 16
    assert dict(cpu.isa)["avx512_bf16"] and not dict(cpu.isa)["amx_tile"]
    assert cpu.numa_nodes[0].memory is None


def test_amd_threads_follow_the_affinity_mask() -> None:
    snap = dataclasses.replace(AMD_SMT, usable_cpus=(0, 16, 1, 17, 2, 18))  # taskset -c 0-2,16-18
    assert build_cpu_info(snap).recommended_threads == 3


def test_arm_big_little_by_frequency() -> None:
    cpu = build_cpu_info(ARM_BIG_LITTLE)
    assert cpu.model == "4× Cortex-A55 + 4× Cortex-A76"
    assert (cpu.physical_cores, cpu.smt) == (8, False)
    assert cpu.hybrid_source == "cpuinfo_max_freq"
    assert [c.kind for c in cpu.cores] == ["efficiency"] * 4 + ["performance"] * 4
    assert cpu.recommended_threads == 4
    assert dict(cpu.isa) == {"asimd": True, "asimdhp": True, "asimddp": True, "i8mm": False, "bf16": False,
                             "sve": False, "sve2": False}


def test_arm_server_flags_and_name() -> None:
    features = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp sve i8mm bf16 svei8mm"
    text = f"processor\t: 0\nFeatures\t: {features}\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n"
    assert cpu_model(text, "aarch64") == "Neoverse-V1"
    isa = dict(relevant_isa("aarch64", cpu_flags(text)))
    assert isa["asimddp"] and isa["i8mm"] and isa["sve"] and isa["bf16"] and not isa["sve2"]
    unknown = "processor\t: 0\nCPU implementer\t: 0x61\nCPU part\t: 0x023\n"
    assert cpu_model(unknown, "aarch64") == "implementer 0x61 part 0x23"


def test_flags_common_to_every_processor() -> None:
    text = "processor: 0\nflags: avx avx2 fma\n\nprocessor: 1\nflags: avx fma\n"
    assert cpu_flags(text) == frozenset({"avx", "fma"})
    assert cpu_flags("") == frozenset()


@pytest.mark.parametrize(
    ("freqs", "split"),
    [
        ([3200000] + [2800000] * 4 + [2000000] * 3, 2800000),  # Snapdragon 8 Gen 2: prime + big vs little
        ([5881000, 5756000, 5631000, 5507000], None),  # one die's preferred cores
        ([4800000, 3800000, 2500000], 3800000),  # Meteor Lake P / E / LP-E: the widest gap wins
        ([3000000], None),
        ([], None),
    ],
)
def test_frequency_split(freqs: list[int], split: int | None) -> None:
    assert frequency_split(freqs) == split


def test_cpu_lists() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpu_list("") == ()
    assert format_cpu_list((11, 0, 1, 2, 3, 8, 10)) == "0-3,8,10-11"
    with pytest.raises(ValueError, match="not a cpulist"):
        parse_cpu_list("0-x")


def test_node_memory() -> None:
    assert node_memory("Node 1 MemTotal:       24683652 kB\n") == 24683652 * 1024
    assert node_memory("nothing") is None


@pytest.mark.parametrize(
    ("clock_mhz", "bus_bits", "gbs"),
    [
        (1215, 5120, 1555.2),  # A100 40 GB, HBM2: NVML reports the real clock
        (3996, 7680, 7672.3),  # B200, HBM3e
        (10501, 384, 1008.1),  # RTX 4090, GDDR6X: NVML reports half the per-pin data rate
        (6001, 128, 192.0),  # GTX 1650 GDDR6
    ],
)
def test_memory_bandwidth_formula(clock_mhz: int, bus_bits: int, gbs: float) -> None:
    assert memory_bandwidth_gbs(clock_mhz, bus_bits) == gbs


def test_cuda_version() -> None:
    assert cuda_version(12040) == "12.4"
    assert cuda_version(13000) == "13.0"
    assert cuda_version(None) is None


# --- NVML through a stand-in module ----------------------------------------------------------------------------


class _NotSupported(Exception):
    pass


class FakeNvml:
    """pynvml's surface as `detect_nvidia` uses it: one H200, one query unsupported."""

    NVML_CLOCK_MEM = 2

    def __init__(self, init_error: Exception | None = None) -> None:
        self.init_error = init_error
        self.shut_down = False

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlSystemGetDriverVersion(self) -> str:
        return "570.124.06"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12080

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetName(self, h: str) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, h: str) -> str:
        raise _NotSupported("Not Supported")

    def nvmlDeviceGetPciInfo(self, h: str) -> Any:
        return type("Pci", (), {"busId": "00000000:19:00.0"})()

    def nvmlDeviceGetMemoryInfo(self, h: str) -> Any:
        return type("Mem", (), {"total": 150 * 2**30, "free": 149 * 2**30, "used": 2**30})()

    def nvmlDeviceGetCudaComputeCapability(self, h: str) -> tuple[int, int]:
        return (9, 0)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: str) -> int:
        return 1  # idle links train down

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: str) -> int:
        return 16

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: str) -> int:
        return 5

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: str) -> int:
        return 16

    def nvmlDeviceGetMaxClockInfo(self, h: str, kind: int) -> int:
        assert kind == self.NVML_CLOCK_MEM
        return 3201

    def nvmlDeviceGetMemoryBusWidth(self, h: str) -> int:
        return 6144


def test_detect_nvidia_reads_every_field() -> None:
    nvml = FakeNvml()
    gpus, nvidia = detect_nvidia(nvml)
    assert nvidia.driver == "570.124.06" and nvidia.cuda_driver == "12.8" and nvidia.error is None
    (g,) = gpus
    assert g.name == "NVIDIA H200" and g.uuid is None and g.pci_bus_id == "00000000:19:00.0"
    assert (g.memory_total, g.memory_free, g.memory_used) == (150 * 2**30, 149 * 2**30, 2**30)
    assert g.compute_capability == (9, 0) and g.bf16 is True
    assert (g.pcie_current.gen, g.pcie_current.width, g.pcie_max.gen, g.pcie_max.width) == (1, 16, 5, 16)
    assert g.memory_bandwidth_gbs == 4916.7
    assert nvml.shut_down


def test_detect_nvidia_without_a_driver() -> None:
    gpus, nvidia = detect_nvidia(FakeNvml(init_error=RuntimeError("NVML Shared Library Not Found")))
    assert gpus == ()
    assert nvidia.error == f"{NO_DRIVER}: NVML Shared Library Not Found"


# --- llama.cpp build -------------------------------------------------------------------------------------------

CPU_RPC_BUILD = LlamaCppInfo(
    installed=True, version="0.3.36", supports_gpu_offload=True, supports_rpc=True,
    backends=(BackendReg("RPC", 0), BackendReg("CPU", 1)), devices=(BackendDevice("CPU", "AMD EPYC", "cpu"),),
)


def test_gpu_build_problem() -> None:
    problem = gpu_build_problem(CPU_RPC_BUILD)
    assert problem is not None and REINSTALL_GPU_BUILD in problem and "only through the RPC backend" in problem
    cuda = LlamaCppInfo(True, "0.3.36", True, True, backends=(BackendReg("CUDA", 1), BackendReg("CPU", 1)),
                        devices=(BackendDevice("CUDA0", "NVIDIA H200", "gpu"), BackendDevice("CPU", "x", "cpu")))
    assert cuda.gpu_backend and gpu_build_problem(cuda) is None
    no_driver = LlamaCppInfo(True, "0.3.36", True, False, backends=(BackendReg("CUDA", 0), BackendReg("CPU", 1)),
                             devices=(BackendDevice("CPU", "x", "cpu"),))
    assert "has the CUDA backend but it finds no GPU" in (gpu_build_problem(no_driver) or "")
    missing = LlamaCppInfo(installed=False, error="llama-cpp-python is not installed")
    assert f"llama-cpp-python is not installed; reinstall it with CUDA: {REINSTALL_GPU_BUILD}" == gpu_build_problem(
        missing)
    with pytest.raises(FitterError, match="CPU build"):
        require_gpu_build(CPU_RPC_BUILD)


@pytest.mark.llama
def test_require_gpu_build_on_this_build() -> None:
    info = detect_llama_cpp()
    assert info.installed and info.devices is not None and any(d.type == "cpu" for d in info.devices)
    if info.gpu_backend:
        pytest.skip("this llama-cpp-python has a GPU backend")
    with pytest.raises(FitterError) as e:
        require_gpu_build()
    assert REINSTALL_GPU_BUILD in str(e.value)


# --- the I/O edge, for real ------------------------------------------------------------------------------------


def test_read_cpu_snapshot_from_a_sysfs_tree(tmp_path: Path) -> None:
    def write(rel: str, text: str) -> None:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)

    write("proc/cpuinfo", _x86_cpuinfo("Test CPU", INTEL_FLAGS, 4))
    write("sys/devices/system/cpu/online", "0-3\n")
    for c, sib in enumerate(("0-1", "0-1", "2", "3")):
        write(f"sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list", sib + "\n")
        write(f"sys/devices/system/cpu/cpu{c}/cpufreq/cpuinfo_max_freq", "5000000\n" if c < 2 else "3500000\n")
    write("sys/devices/cpu_core/cpus", "0-1\n")
    write("sys/devices/cpu_atom/cpus", "2-3\n")
    write("sys/devices/system/node/node0/cpulist", "0-3\n")
    snap = read_cpu_snapshot(tmp_path)
    assert snap.siblings == {0: "0-1\n", 1: "0-1\n", 2: "2\n", 3: "3\n"} and snap.atom_cpus == "2-3\n"
    cpu = build_cpu_info(snap)
    assert cpu.model == "Test CPU" and [c.cpus for c in cpu.cores] == [(0, 1), (2,), (3,)]
    assert cpu.performance_cores == 1 and cpu.numa_nodes[0].cpus == (0, 1, 2, 3) and cpu.governor is None


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def _probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fitter.cli", "probe", *args], capture_output=True, text=True,
                          timeout=120)


def test_probe_json_runs_on_this_machine() -> None:
    proc = _probe("--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"gpus", "nvidia", "cpu", "ram", "llama_cpp"}
    assert out["cpu"]["physical_cores"] >= 1 and out["cpu"]["recommended_threads"] >= 1
    assert out["ram"]["total"] >= out["ram"]["available"] > 0 and isinstance(out["ram"]["total"], int)
    if not _nvml_works():
        assert out["gpus"] == [] and out["nvidia"]["error"].startswith(f"{NO_DRIVER}: ")


def test_probe_table_runs_on_this_machine() -> None:
    proc = _probe()
    assert proc.returncode == 0, proc.stderr
    assert "threads" in proc.stdout and "-t " in proc.stdout and "RAM" in proc.stdout
    if not _nvml_works():
        assert NO_DRIVER in proc.stdout


@pytest.mark.gpu
def test_probe_reads_a_real_nvidia_gpu() -> None:
    if not _nvml_works():
        pytest.skip("no NVML: needs an NVIDIA GPU and driver")
    gpus, nvidia = detect_nvidia()
    assert nvidia.driver and nvidia.error is None and gpus
    g = gpus[0]
    assert g.memory_total and g.memory_free is not None and g.memory_total >= g.memory_free
    assert g.compute_capability is not None and g.bf16 is not None
    assert g.memory_bandwidth_gbs is None or g.memory_bandwidth_gbs > 50
