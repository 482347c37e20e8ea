"""Which NVML GPU llama.cpp calls CUDA{i} (fitter.machine.gpu_order): CUDA_DEVICE_ORDER, CUDA_VISIBLE_DEVICES by
index, by UUID prefix and with an invalid entry, identical GPUs numbered fastest-first, the refusal for GPUs that
differ, llama.cpp's own listing; then the snapshot that names devices, records them and fingerprints them, and the
peak sampler. NVML here is a fake (tests/machine/fake_nvml.py) that lists the GPUs out of PCI order."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from fitter.machine.cpu import RamInfo, build_cpu_info
from fitter.machine.gpu_order import GpuOrderError, cuda_order, gpu_map, normal_bus_id, parse_visible
from fitter.machine.nvidia import NO_DRIVER, GpuInfo, NvidiaInfo, detect_nvidia
from fitter.machine.nvml_peak import NvmlPeakSampler
from fitter.machine.snapshot import MachineSnapshot, gpus_now, machine_record
from fitter.measure.llamacpp.builds import ListedDevice
from tests.machine.fake_nvml import GIB, MIB, FakeGpu, FakeNvml, Proc
from tests.machine.test_probe import AMD_SMT

RTX_3090 = FakeGpu("NVIDIA GeForce RTX 3090", "00000000:01:00.0", "GPU-3090aaaa-1111-2222-3333-444444444444",
                   24576 * MIB, 20 * GIB, (8, 6), 10496)
RTX_3060 = FakeGpu("NVIDIA GeForce RTX 3060", "00000000:02:00.0", "GPU-3060bbbb-5555-6666-7777-888888888888",
                   12288 * MIB, 11 * GIB, (8, 6), 3584)
H100_A = FakeGpu("NVIDIA H100 80GB HBM3", "00000000:19:00.0", "GPU-a100aaaa-0000-0000-0000-000000000001",
                 81559 * MIB, 80 * GIB, (9, 0), 16896)
H100_B = FakeGpu("NVIDIA H100 80GB HBM3", "00000000:3B:00.0", "GPU-b100bbbb-0000-0000-0000-000000000002",
                 81559 * MIB, 70 * GIB, (9, 0), 16896)
PCI_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def nvml_gpus(*gpus: FakeGpu) -> tuple[GpuInfo, ...]:
    found, nvidia = detect_nvidia(FakeNvml(list(gpus)))
    assert nvidia.error is None
    return found


MIXED = nvml_gpus(RTX_3060, RTX_3090)  # NVML index 0 is the 3060 on bus 02, index 1 the 3090 on bus 01
TWIN = nvml_gpus(H100_B, H100_A)


def mapping(gpus: tuple[GpuInfo, ...], env: dict[str, str],
            listed: list[ListedDevice] | None = None) -> list[tuple[str, str | None, str, int]]:
    """(llama.cpp's name, PCI bus id, GPU name, NVML index) of each CUDA device, CUDA0 first."""
    return [(c.device, c.pci_bus_id, c.gpu.name, c.gpu.index) for c in cuda_order(gpus, env, listed)]


def listing(*rows: tuple[str, int]) -> list[ListedDevice]:
    """`llama-server --list-devices` as fitter parses it: CUDA{i}: NAME (TOTAL MiB, FREE MiB free)."""
    return [ListedDevice(f"CUDA{i}", name, mib * MIB, mib * MIB // 2) for i, (name, mib) in enumerate(rows)]


# -- the order -------------------------------------------------------------------------------------------------


def test_pci_bus_id_order_is_ascending_bus_id_whatever_nvmls_order() -> None:
    assert mapping(MIXED, PCI_ORDER) == [("CUDA0", "0000:01:00.0", "NVIDIA GeForce RTX 3090", 1),
                                         ("CUDA1", "0000:02:00.0", "NVIDIA GeForce RTX 3060", 0)]


@pytest.mark.parametrize(("visible", "expected"), [
    ("1,0", [("CUDA0", "0000:02:00.0", 0), ("CUDA1", "0000:01:00.0", 1)]),  # the order named, renumbered from 0
    ("1", [("CUDA0", "0000:02:00.0", 0)]),  # the 3090 hidden: the 3060 is CUDA0
    ("0", [("CUDA0", "0000:01:00.0", 1)]),
    (" 1 , 0", [("CUDA0", "0000:02:00.0", 0), ("CUDA1", "0000:01:00.0", 1)]),  # spaces around an index
])
def test_visible_devices_by_index_count_in_pci_order(visible: str, expected: list[tuple[str, str, int]]) -> None:
    got = mapping(MIXED, {**PCI_ORDER, "CUDA_VISIBLE_DEVICES": visible})
    assert [(d, bus, i) for d, bus, _, i in got] == expected


@pytest.mark.parametrize("order", [{}, PCI_ORDER])  # by UUID the order named holds whatever CUDA_DEVICE_ORDER says
def test_visible_devices_by_uuid_prefix(order: dict[str, str]) -> None:
    env = {**order, "CUDA_VISIBLE_DEVICES": "GPU-3060b,GPU-3090aaaa-1111-2222-3333-444444444444"}
    assert mapping(MIXED, env) == [("CUDA0", "0000:02:00.0", "NVIDIA GeForce RTX 3060", 0),
                                   ("CUDA1", "0000:01:00.0", "NVIDIA GeForce RTX 3090", 1)]
    assert mapping(MIXED, {**order, "CUDA_VISIBLE_DEVICES": "GPU-3090"})[0][:2] == ("CUDA0", "0000:01:00.0")


@pytest.mark.parametrize(("visible", "expected"), [
    ("1,7,0", ["0000:02:00.0"]),  # 7 is no device: the list ends there
    ("0,-1,1", ["0000:01:00.0"]),  # a negative index ends it
    ("1,two,0", ["0000:02:00.0"]),  # so does a word
    ("1,1", []),  # a repeated device leaves none
    ("", []),  # set and empty: no device
    ("GPU-3060b,GPU-ffff,GPU-3090a", ["0000:02:00.0"]),  # a prefix of no GPU ends it
    ("GPU-30,GPU-3090a", []),  # a prefix of two GPUs is no GPU: the list ends before it begins
    ("GPU-3060b,0", ["0000:02:00.0"]),  # a UUID list ends at its first entry that is not one
    ("GPU-3060b,GPU-3060bbbb", []),  # the same GPU twice
])
def test_an_invalid_entry_ends_the_visible_list(visible: str, expected: list[str]) -> None:
    got = mapping(MIXED, {**PCI_ORDER, "CUDA_VISIBLE_DEVICES": visible})
    assert [bus for _, bus, _, _ in got] == expected
    assert [d for d, _, _, _ in got] == [f"CUDA{i}" for i in range(len(expected))]


def test_parse_visible_reads_entries_as_the_cuda_runtime_does() -> None:
    # the cases of PyTorch's test_cuda.py TestVisibleDeviceParses, which checks the same rules
    assert parse_visible(None) is None
    assert parse_visible("1gpu2,2ampere") == (1, 2)
    assert parse_visible("0, 1, 2, -1, 3") == (0, 1, 2)
    assert parse_visible("0, 1, 2, 1") == ()
    assert parse_visible("2, +3, -0, 5") == (2, 3, 0, 5)
    assert parse_visible("one,two,3,4") == ()
    assert parse_visible("4,3,two,one") == (4, 3)
    assert parse_visible("GPU-9e8d35e3") == ("GPU-9e8d35e3",)
    assert parse_visible("GPU-123, 2") == ("GPU-123",)


def test_identical_gpus_numbered_fastest_first_take_pci_order() -> None:
    assert mapping(TWIN, {}) == [("CUDA0", "0000:19:00.0", "NVIDIA H100 80GB HBM3", 1),
                                 ("CUDA1", "0000:3b:00.0", "NVIDIA H100 80GB HBM3", 0)]
    assert mapping(TWIN, {"CUDA_VISIBLE_DEVICES": "1"}) == [("CUDA0", "0000:3b:00.0", "NVIDIA H100 80GB HBM3", 0)]
    assert mapping(nvml_gpus(RTX_3060), {}) == [("CUDA0", "0000:02:00.0", "NVIDIA GeForce RTX 3060", 0)]


MIXED_REFUSAL = ("CUDA_DEVICE_ORDER is unset (FASTEST_FIRST) and the GPUs differ (0000:01:00.0 NVIDIA GeForce RTX "
                 "3090, 0000:02:00.0 NVIDIA GeForce RTX 3060): CUDA then numbers them fastest-first by an undocumented "
                 "heuristic, so fitter cannot tell which one llama.cpp calls CUDA0; set CUDA_DEVICE_ORDER=PCI_BUS_ID "
                 "(CUDA then numbers the GPUs in PCI bus order, as nvidia-smi lists them), or tune with --llama-cpp "
                 "DIR so fitter reads your build's own device list")


@pytest.mark.parametrize("env", [{}, {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1,0"}])
def test_gpus_that_differ_numbered_fastest_first_are_refused(env: dict[str, str]) -> None:
    with pytest.raises(GpuOrderError) as e:
        cuda_order(MIXED, env)
    assert str(e.value) == MIXED_REFUSAL


def test_a_gpu_that_differs_only_in_memory_is_not_identical() -> None:
    other = FakeGpu(RTX_3060.name, "00000000:03:00.0", "GPU-3060cccc", 8192 * MIB, 7 * GIB, (8, 6), 3584)
    with pytest.raises(GpuOrderError, match="the GPUs differ"):
        cuda_order(nvml_gpus(RTX_3060, other), {})


def test_mig_devices_are_refused() -> None:
    with pytest.raises(GpuOrderError) as e:
        cuda_order(TWIN, {"CUDA_VISIBLE_DEVICES": "MIG-a100aaaa/1/0"})
    assert str(e.value) == ("CUDA_VISIBLE_DEVICES=MIG-a100aaaa/1/0: MIG devices are not mapped by fitter (NVML lists "
                            "their parent GPUs, whose memory is not theirs); name whole GPUs by index or GPU-UUID")


def test_bus_ids_are_written_as_llama_cpp_writes_them() -> None:
    assert normal_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normal_bus_id("0000:01:00.0") == "0000:01:00.0"
    assert normal_bus_id(None) is None and normal_bus_id("unknown") is None


# -- llama.cpp's own listing -----------------------------------------------------------------------------------


def test_the_listing_gives_the_order_of_gpus_that_differ() -> None:
    # llama.cpp lists cudaMemGetInfo's total, a few hundred MiB under NVML's
    listed = listing(("NVIDIA GeForce RTX 3060", 12041), ("NVIDIA GeForce RTX 3090", 24259))
    assert mapping(MIXED, {}, listed) == [("CUDA0", "0000:02:00.0", "NVIDIA GeForce RTX 3060", 0),
                                          ("CUDA1", "0000:01:00.0", "NVIDIA GeForce RTX 3090", 1)]


def test_the_listing_confirms_a_known_order() -> None:
    listed = listing(("NVIDIA GeForce RTX 3090", 24259), ("NVIDIA GeForce RTX 3060", 12041))
    assert [bus for _, bus, _, _ in mapping(MIXED, PCI_ORDER, listed)] == ["0000:01:00.0", "0000:02:00.0"]


def test_a_listing_that_disagrees_is_refused_naming_the_mismatch() -> None:
    listed = listing(("NVIDIA GeForce RTX 3060", 12041), ("NVIDIA GeForce RTX 3090", 24259))
    with pytest.raises(GpuOrderError) as e:
        cuda_order(MIXED, PCI_ORDER, listed)
    assert str(e.value) == ("llama.cpp lists CUDA0=NVIDIA GeForce RTX 3060 (12041 MiB), fitter expects "
                            "CUDA0=0000:01:00.0 NVIDIA GeForce RTX 3090 (24576 MiB) (CUDA_DEVICE_ORDER=PCI_BUS_ID): "
                            "fitter would budget another GPU than llama.cpp uses")


def test_a_listed_gpu_nvml_does_not_have_is_refused() -> None:
    listed = listing(("NVIDIA GeForce RTX 3060", 12041), ("NVIDIA GeForce RTX 3090", 12041))  # a 12 GB "3090"
    with pytest.raises(GpuOrderError) as e:
        cuda_order(MIXED, {}, listed)
    assert str(e.value) == ("llama.cpp lists CUDA1=NVIDIA GeForce RTX 3090 (12041 MiB), which matches no NVIDIA "
                            "GPU NVML lists (0000:01:00.0 NVIDIA GeForce RTX 3090, 0000:02:00.0 NVIDIA GeForce RTX "
                            "3060) by name and total memory; set CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA then numbers the "
                            "GPUs in PCI bus order, as nvidia-smi lists them)")


# -- the snapshot: device names, the record, the fingerprint ---------------------------------------------------


def snapshot(nvml: FakeNvml, env: dict[str, str] | None = None) -> MachineSnapshot:
    gpus, nvidia = detect_nvidia(nvml)
    return MachineSnapshot(build_cpu_info(AMD_SMT), RamInfo(64 * GIB, 60 * GIB, 0, 0), gpus, nvidia, {}, env or {})


def test_devices_are_named_as_llama_cpp_names_them_with_each_gpus_own_free_memory() -> None:
    devices = snapshot(FakeNvml([RTX_3060, RTX_3090]), PCI_ORDER).devices()
    assert [(d.name, d.total_bytes, d.free_bytes) for d in devices] == [("CUDA0", 24576 * MIB, 20 * GIB),
                                                                         ("CUDA1", 12288 * MIB, 11 * GIB)]


def test_the_record_maps_each_cuda_device_to_its_pci_bus_id() -> None:
    record = snapshot(FakeNvml([RTX_3060, RTX_3090]), PCI_ORDER).record()
    assert record["gpus"] == ["NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 3060"]
    assert record["gpu_map"] == [
        {"device": "CUDA0", "pci_bus_id": "0000:01:00.0", "name": "NVIDIA GeForce RTX 3090",
         "memory_total": 24576 * MIB},
        {"device": "CUDA1", "pci_bus_id": "0000:02:00.0", "name": "NVIDIA GeForce RTX 3060",
         "memory_total": 12288 * MIB}]


def test_which_card_sits_where_changes_the_fingerprint() -> None:
    swapped = [FakeGpu(RTX_3090.name, RTX_3060.bus_id, RTX_3090.uuid, RTX_3090.total, RTX_3090.free),
               FakeGpu(RTX_3060.name, RTX_3090.bus_id, RTX_3060.uuid, RTX_3060.total, RTX_3060.free)]
    here = snapshot(FakeNvml([RTX_3060, RTX_3090]), PCI_ORDER).record()
    there = snapshot(FakeNvml(swapped), PCI_ORDER).record()
    assert here["gpus"] != there["gpus"] and here["fingerprint"] != there["fingerprint"]
    hidden = snapshot(FakeNvml([RTX_3060, RTX_3090]), {**PCI_ORDER, "CUDA_VISIBLE_DEVICES": "0"}).record()
    assert hidden["gpu_map"] == here["gpu_map"][:1] and hidden["fingerprint"] != here["fingerprint"]


def test_a_machine_without_gpus_keeps_its_fingerprint() -> None:
    cpu = build_cpu_info(AMD_SMT)
    record = machine_record(cpu, 64 * GIB, [], None)
    # the fingerprint as it was before gpu_map: results stored under it are found again
    stable = {"cpu": cpu.model, "arch": cpu.arch, "physical_cores": cpu.physical_cores,
              "logical_cpus": cpu.logical_cpus, "ram_bytes": 64 * GIB, "gpus": [], "nvidia_driver": None}
    assert record["fingerprint"] == hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]
    assert record["gpu_map"] == []
    without = MachineSnapshot(cpu, RamInfo(64 * GIB, 60 * GIB, 0, 0), (), NvidiaInfo(None, None, NO_DRIVER))
    assert without.record() == record


def test_a_snapshot_of_gpus_that_differ_refuses_to_name_them_until_a_listing_does() -> None:
    mixed = snapshot(FakeNvml([RTX_3060, RTX_3090]))
    with pytest.raises(GpuOrderError) as e:
        mixed.devices()
    assert str(e.value) == MIXED_REFUSAL
    listed = mixed.with_listing(listing(("NVIDIA GeForce RTX 3060", 12041), ("NVIDIA GeForce RTX 3090", 24259)))
    assert [(d.name, d.free_bytes) for d in listed.devices()] == [("CUDA0", 11 * GIB), ("CUDA1", 20 * GIB)]
    assert listed.nvml_indices() == (0, 1)


def test_the_record_of_gpus_that_differ_names_the_machine_in_pci_order_and_says_cudas_is_unknown() -> None:
    mixed = snapshot(FakeNvml([RTX_3060, RTX_3090])).record()  # an --emulated-gpu tune here names no local GPU
    assert mixed["gpu_order_unknown"] == MIXED_REFUSAL
    assert [g["pci_bus_id"] for g in mixed["gpu_map"]] == [g["pci_bus_id"] for g in
                                                           snapshot(FakeNvml([RTX_3060, RTX_3090]),
                                                                    PCI_ORDER).record()["gpu_map"]]


def test_gpus_now_rereads_free_memory_by_bus_id_and_keeps_the_snapshots_names() -> None:
    before = snapshot(FakeNvml([RTX_3060, RTX_3090]), PCI_ORDER)
    fresh = [FakeGpu(g.name, g.bus_id, g.uuid, g.total, g.free - GIB, g.cc, g.sms) for g in (RTX_3060, RTX_3090)]
    now = gpus_now(before, FakeNvml(fresh))
    assert [(d.name, d.free_bytes) for d in now] == [("CUDA0", 19 * GIB), ("CUDA1", 10 * GIB)]
    assert gpus_now(before, FakeNvml(fresh[:1])) == ()  # the 3090 is gone from NVML: no reading of it now


# -- the peak sampler ------------------------------------------------------------------------------------------


def peaks(nvml: FakeNvml, **kwargs: Any) -> dict[str, int]:
    with NvmlPeakSampler(nvml, pids=lambda: {11}, interval_s=3600, **kwargs) as sampler:
        pass
    return sampler.peaks


def test_the_peak_sampler_names_devices_in_cuda_order(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml([RTX_3060, RTX_3090], {0: [Proc(11, 300 * MIB)], 1: [Proc(11, 900 * MIB)]})
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert peaks(nvml) == {"CUDA0": 900 * MIB, "CUDA1": 300 * MIB}  # the 3090 (NVML 1) is CUDA0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert peaks(nvml) == {"CUDA0": 300 * MIB}
    assert peaks(nvml, order=(0, 1)) == {"CUDA0": 300 * MIB, "CUDA1": 900 * MIB}  # a snapshot's order, as given
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(GpuOrderError) as e:
        peaks(nvml)
    assert str(e.value) == MIXED_REFUSAL


def test_gpu_map_is_the_records_shape() -> None:
    assert gpu_map(cuda_order(nvml_gpus(RTX_3060), {})) == [
        {"device": "CUDA0", "pci_bus_id": "0000:02:00.0", "name": "NVIDIA GeForce RTX 3060",
         "memory_total": 12288 * MIB}]


def test_an_emulated_gpu_tune_runs_beside_gpus_whose_cuda_order_is_unknown() -> None:
    from fitter.flags import ProcessFlags, parse_launch_flags
    from fitter.tune.targets import local_target

    mixed = snapshot(FakeNvml([RTX_3060, RTX_3090]))
    base = parse_launch_flags(["-c", "2048"])
    target = local_target(mixed, base, ProcessFlags(), (96, 48), False, None)
    assert [d.name for d in target.planned_devices] == ["RPC0[127.0.0.1:50052]", "RPC0[127.0.0.1:50053]"]
    assert target.machine["gpu_order_unknown"] == MIXED_REFUSAL
    with pytest.raises(GpuOrderError) as e:  # on those GPUs themselves: refused, naming them
        local_target(mixed, base, ProcessFlags(), None, False, None)
    assert str(e.value) == MIXED_REFUSAL
