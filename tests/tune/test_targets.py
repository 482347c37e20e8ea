"""The tuning targets: which devices the estimator plans for, before and after the runner starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fitter.flags import ProcessFlags, parse_launch_flags
from fitter.machine.nvidia import GpuInfo
from fitter.machine.snapshot import take_snapshot
from fitter.memory.backends.devices import CUDA, RPC, Device
from fitter.memory.backends.overhead import default_overhead
from fitter.tune.targets import emulated_fit_targets, local_target

GIB = 1024**3
GPU = GpuInfo(0, "NVIDIA Test", memory_total=8 * GIB, memory_free=7 * GIB)


class Runner:
    def devices(self) -> tuple[Device, ...]:
        return ()  # the machine's own GPUs


def test_a_local_gpus_free_memory_is_read_again_once_the_runner_has_started(monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = dataclasses.replace(take_snapshot(), gpus=(GPU,))
    now: list[tuple[Device, ...]] = [(Device("CUDA0", CUDA, 8 * GIB, 6 * GIB),)]  # its CUDA context holds 1 GiB
    monkeypatch.setattr("fitter.tune.targets.gpus_now", lambda _snapshot: now[0])
    target = local_target(snapshot, parse_launch_flags(["-c", "2048"]), ProcessFlags(), None, False, None)
    # no measurement of this machine yet (the session's fitter home is empty): the default of an unknown GPU class
    overhead = default_overhead("NVIDIA Test")
    assert target.planned_devices == (Device("CUDA0", CUDA, 8 * GIB, 7 * GIB, overhead),)
    assert target.devices(Runner()) == (Device("CUDA0", CUDA, 8 * GIB, 6 * GIB),)  # type: ignore[arg-type]
    now[0] = ()  # NVML failed to answer this time: the snapshot's reading stands
    assert target.devices(Runner()) == (Device("CUDA0", CUDA, 8 * GIB, 7 * GIB, overhead),)  # type: ignore[arg-type]


def test_rpc_servers_are_not_re_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fitter.tune.targets.gpus_now", lambda _snapshot: pytest.fail("read NVML for an RPC target"))
    snapshot = dataclasses.replace(take_snapshot(), gpus=(GPU,))
    target = local_target(snapshot, parse_launch_flags(["-c", "2048", "--rpc", "10.0.0.2:50052"]), ProcessFlags(),
                          None, False, None)
    (device,) = target.devices(Runner())  # type: ignore[arg-type]
    assert device.name == "RPC0[10.0.0.2:50052]"


def test_the_cuda_shaped_emulated_gpu_is_planned_with_cudas_rules_and_named_apart() -> None:
    snapshot = take_snapshot()
    plain = local_target(snapshot, parse_launch_flags(["-c", "2048"]), ProcessFlags(), 96, False, None)
    cuda = local_target(snapshot, parse_launch_flags(["-c", "2048"]), ProcessFlags(), 96, False, None, "cuda")
    (p,), (c,) = plain.planned_devices, cuda.planned_devices
    assert (p.profile, c.profile) == (RPC, CUDA) and p.free_bytes == c.free_bytes == 96 * 2**20
    assert cuda.machine["emulated_gpu_kind"] == "cuda" and "emulated_gpu_kind" not in plain.machine
    # another folder (and so another study): the same cap with other rules is another machine
    assert plain.machine_dir.startswith("emulated-96MiB-") and cuda.machine_dir.startswith("emulated-cuda-96MiB-")


@pytest.mark.vulkan
def test_the_emulated_vulkan_gpu_is_planned_with_lavapipes_limits_and_named_apart(vulkan_build: Path) -> None:
    snapshot = take_snapshot()
    target = local_target(snapshot, parse_launch_flags(["-c", "2048"]), ProcessFlags(), (96, 48), False, None,
                          "vulkan")
    assert [(d.name, d.profile.kind, d.free_bytes) for d in target.planned_devices] == [
        ("Vulkan0", "vulkan", 96 * 2**20), ("Vulkan1", "vulkan", 48 * 2**20)]
    assert target.planned_devices[0].profile.max_op_bytes == 128 * 2**20  # lavapipe's buffer range
    assert target.planned_rpc == () and target.machine["emulated_gpu_kind"] == "vulkan"
    assert target.machine_dir.startswith("emulated-vulkan-96+48MiB-")
    assert target.physical_cores == snapshot.cpu.physical_cores  # no server: lavapipe computes in the trial
    assert target.machine["model_devices"] == ["Vulkan0", "Vulkan1"]  # what exports pin as -dev


def test_a_builds_devices_the_model_takes_unasked_are_recorded_for_exports(tmp_path: Path) -> None:
    from tests.measure.llamacpp.test_builds import FAKE_VULKAN_SERVER

    build = tmp_path / "vulkan"
    build.mkdir()
    (build / "llama-server").write_text(FAKE_VULKAN_SERVER)
    (build / "llama-server").chmod(0o755)
    target = local_target(take_snapshot(), parse_launch_flags(["-c", "2048"]), ProcessFlags(), None, False, None,
                          llama_cpp=str(build))
    assert [d.name for d in target.planned_devices] == ["Vulkan0"]
    assert target.machine["model_devices"] == ["Vulkan0"]
    assert target.machine["build_devices"] == [{"device": "Vulkan0", "backend": "vulkan",
                                                "memory_total": 8176 * 2**20}]
    cpu_only = local_target(take_snapshot(), parse_launch_flags(["-c", "2048"]), ProcessFlags(), None, False, None)
    assert "model_devices" not in cpu_only.machine  # nothing to name: llama.cpp's own choice is the same anywhere


def test_several_emulated_gpus_are_planned_one_per_cap_with_their_own_placeholder() -> None:
    snapshot = take_snapshot()
    snapshot = dataclasses.replace(snapshot, gpus=(), cpu=dataclasses.replace(snapshot.cpu, physical_cores=8))
    target = local_target(snapshot, parse_launch_flags(["-c", "2048"]), ProcessFlags(), (96, 48), False, None)
    assert [(d.name, d.profile, d.free_bytes) for d in target.planned_devices] == [
        ("RPC0[127.0.0.1:50052]", RPC, 96 * 2**20), ("RPC0[127.0.0.1:50053]", RPC, 48 * 2**20)]
    assert target.planned_rpc == ("127.0.0.1:50052", "127.0.0.1:50053")
    assert target.machine["emulated_gpu_mib"] == [96, 48]
    assert target.machine_dir.startswith("emulated-96+48MiB-")
    assert target.physical_cores == 6  # a core for each emulated GPU's server
    assert "2 cores left to the 2 emulated GPUs' servers: trials use up to 6 threads" in target.notes


@pytest.mark.parametrize(("machine", "flags", "searched"), [
    ("gpu-2x3090", [], ("layer", "tensor")),
    ("gpu-2x3090", ["-sm", "layer"], None),  # the user's -sm
    ("gpu-2x3090", ["-ts", "1,1"], None),  # a placement the user fixed
    ("gpu-2x3090", ["-fa", "off"], None),  # llama.cpp refuses tensor mode without flash attention
    ("gpu-16gb", [], None),  # one GPU
])
def test_split_mode_is_searched_where_tensor_mode_runs_and_the_flags_leave_it(
        machine: str, flags: list[str], searched: tuple[str, ...] | None) -> None:
    from optuna.distributions import CategoricalDistribution

    from fitter.gguf.model_spec import load_model_spec
    from fitter.tune.targets import plan_request, sim_target
    from tests.models import model_file
    from tests.tune.options import tune_options

    spec = load_model_spec(str(model_file("qwen3-14b", sparse=True)))
    o = tune_options(model=spec.path, spec=spec, base=parse_launch_flags(["-c", "4096", *flags]), backend="sim",
                     machine=machine)
    target = sim_target(machine, None, spec, 0)
    req = plan_request(o, target, target.planned_devices, ())
    assert req.distributions.get("split-mode") == (CategoricalDistribution(searched) if searched else None)
    # a MoE model on llama.cpp's deny-list: its placement's own modes, layer or one GPU, without tensor
    deepseek = load_model_spec(str(model_file("deepseek2-tiny", sparse=True)))
    o = tune_options(model=deepseek.path, spec=deepseek, base=parse_launch_flags(["-c", "4096", *flags]),
                     backend="sim", machine=machine)
    modes = plan_request(o, target, target.planned_devices, ()).distributions.get("split-mode")
    spread = machine == "gpu-2x3090" and not {"-sm", "-ts"} & set(flags)  # per-device placement searched
    assert modes == (CategoricalDistribution(("layer", "none")) if spread else None)


def test_emulated_gpus_given_without_a_fit_target_take_the_demos_share_of_each() -> None:
    # the demo's 16 MiB of 96 (so --emulated-gpu 96 is the automatic demo), never above llama.cpp's 1024 MiB
    assert emulated_fit_targets((96,)) == (16,) and emulated_fit_targets((64, 48)) == (10, 8)
    assert emulated_fit_targets((8192, 4)) == (1024, 0)
    snapshot = dataclasses.replace(take_snapshot(), gpus=())
    base = parse_launch_flags(["-c", "2048"])
    given = local_target(snapshot, base, ProcessFlags(), (64, 48), False, None)
    assert given.default_fit_target == (10, 8)
    assert "fit target 10,8 MiB on the emulated GPU (the demo's share of 16 MiB in 96; --fit-target MiB[,MiB…] to " \
           "choose)" in given.notes
    chosen = local_target(snapshot, base, ProcessFlags(), (64, 48), False, (4,))
    assert chosen.default_fit_target is None and not any("fit target" in n for n in chosen.notes)
