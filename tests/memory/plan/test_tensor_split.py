"""fitter.memory.plan.tensor_split: llama_meta_device_get_split_state's arithmetic on worked cases (the expected
slices derived by hand from src/llama-model.cpp), and -sm tensor's refusals."""

from __future__ import annotations

import pytest

from fitter.errors import LaunchConfigError
from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import CUDA, Device
from fitter.memory.plan.estimator import estimate
from fitter.memory.plan.tensor_split import meta_device, split_rows
from tests.memory.plan.test_estimator import _plan
from tests.models import model_file


@pytest.mark.parametrize(("ne", "g", "n", "rot", "ts", "out"), [
    # Llama-3-8B-like K rows (8 KV heads of 128, g_kv 128) on 3 GPUs: 341 -> 256, 682 -> 640, the rest last
    (1024, 128, 3, 0, (), [256, 384, 384]),
    (1024, 128, 3, 1, (), [384, 256, 384]),  # the next layer rotates who rounds down
    (1024, 128, 3, 2, (), [384, 384, 256]),
    (14336, 256, 3, 0, (), [4608, 4864, 4864]),  # an FFN of a 256-block ffn_down
    (128256, 1, 3, 2, (), [42752, 42752, 42752]),  # output.weight: granularity 1, rotation n_layer % 3
    (14336, 256, 2, 0, (3.0, 1.0), [10752, 3584]),  # -ts 3,1
    (14336, 256, 2, 1, (3.0, 1.0), [10752, 3584]),  # rotated: the scan starts at device 1's share, 1 then 3
    (128, 128, 2, 0, (), [0, 128]),  # fewer KV heads than devices' worth: the first gets none
    (512, 1, 3, 0, (3.0, 1.0), [384, 128, 0]),  # -ts 3,1 on three devices: the third has no share
])
def test_split_rows_rounds_down_to_the_granularity_and_rotates(ne: int, g: int, n: int, rot: int,
                                                               ts: tuple[float, ...], out: list[int]) -> None:
    assert split_rows(ne, g, n, rot, ts) == out
    assert sum(out) == ne


def test_the_meta_device_sums_memory_and_takes_the_largest_alignment() -> None:
    a, b = Device("CUDA0", CUDA, 4 << 30, 3 << 30), Device("CUDA1", CUDA, 2 << 30, 1 << 30)
    meta = meta_device((a, b))
    assert (meta.name, meta.total_bytes, meta.free_bytes) == ("Meta()", 6 << 30, 4 << 30)
    assert (meta.profile.alignment, meta.profile.host_buft, meta.profile.op_offload) == (128, "CUDA_Host", False)


def test_every_device_holds_the_whole_compute_buffer() -> None:
    _, plan = _plan("demo", ["-c", "512", "-sm", "tensor"], devices="cuda:4096,2048")
    compute = [b for b in plan.buffers if b.kind == "compute" and b.device != "CPU"]
    assert [b.device for b in compute] == ["CUDA0", "CUDA1"]
    assert compute[0].bytes == compute[1].bytes
    assert any("llama.cpp turns flash attention on" in w for w in plan.warnings)
    assert plan.context.flash_attn and not plan.context.v_trans


def test_a_deny_listed_architecture_is_refused() -> None:
    spec = load_model_spec(str(model_file("deepseek2-tiny")))
    with pytest.raises(LaunchConfigError, match=r"^-sm tensor: llama.cpp has no tensor split for architecture "
                                                r"'deepseek2' \(LLAMA_SPLIT_MODE_TENSOR not implemented for it\)"):
        estimate(spec, parse_launch_flags(["-sm", "tensor"], "llama-server"),
                 (Device("CUDA0", CUDA, 1 << 30, 1 << 30), Device("CUDA1", CUDA, 1 << 30, 1 << 30)))


def test_more_than_sixteen_devices_are_refused() -> None:
    with pytest.raises(LaunchConfigError, match=r"^-sm tensor: 17 devices, past the 16"):
        _plan("demo", ["-c", "512", "-sm", "tensor"], devices="cuda:" + ",".join(["1024"] * 17))
