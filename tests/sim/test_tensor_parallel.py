"""-sm tensor in the simulator (fitter/sim/tensor_parallel.py): every GPU at once on its share, all-reduced per
subgraph over the GPUs' link."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import ModelSpec, load_model_spec
from fitter.measure.types import BenchSpec
from fitter.memory.plan.tensor_split import device_shares, row_parallel
from fitter.sim import Machine, SimRunner, load_machine, speeds
from fitter.sim.physics import ubatch_seconds, ubatch_stages
from fitter.sim.tensor_parallel import allreduce_seconds
from tests.models import model_file

FLAGS = ["-c", "8192", "-fa", "on", "-ngl", "all"]
BENCH = BenchSpec(threads=8, n_prompt=512, n_gen=128)
# qwen3-14b's decode under -sm tensor over -sm layer on gpu-2x3090: bridged, then staged through the host
BRIDGED, HOST_30, HOST_250 = 1.625, 1.424, 0.652


@cache
def spec(shape: str) -> ModelSpec:
    return load_model_spec(str(model_file(shape, sparse=True)))


def _decode(m: Machine, shape: str, flags: list[str]) -> float:
    r = SimRunner(m, spec(shape))
    return speeds(m, r.plan(parse_launch_flags(flags)), BENCH)[1]


def _through_host(m: Machine, latency_us: float) -> Machine:
    """The machine's GPUs with no peer link: every copy staged through host memory."""
    return replace(m, gpus=tuple(replace(g, peer_gbps=0.0, host_copy_latency_us=latency_us) for g in m.gpus))


def test_the_butterfly_takes_ceil_log2_steps_and_a_copy_back_past_a_power_of_two() -> None:
    m = load_machine("gpu-4090-2x3060")  # no peer links; PCIe 24, 6, 6 GB/s; launches 4, 5, 5 μs
    b = 5120 * 4.0
    # 2 GPUs: one copy each way at once over the pair's link, then an ADD
    assert allreduce_seconds(m, ["CUDA0", "CUDA1"], b) == pytest.approx(30e-6 + b / 24e9 + b / 6e9 + 5e-6, rel=1e-12)
    # 3 GPUs: the fold, one butterfly step, the copy back; each step as slow as the slowest pair (the two 3060s)
    slowest = 30e-6 + b / 6e9 + b / 6e9
    assert allreduce_seconds(m, ["CUDA0", "CUDA1", "CUDA2"], b) == pytest.approx(3 * slowest + 2 * 5e-6, rel=1e-12)
    assert allreduce_seconds(m, ["CUDA0"], b) == 0.0
    bridged = load_machine("gpu-2x3090")  # NVLink: 10 μs, 45 GB/s
    assert bridged.copy_seconds("CUDA0", "CUDA1", b) == pytest.approx(10e-6 + b / 45e9, rel=1e-12)
    assert _through_host(bridged, 30).copy_seconds("CUDA0", "CUDA1", b) == pytest.approx(30e-6 + 2 * b / 12e9)


def test_row_parallel_weights_and_shares() -> None:
    s = spec("qwen3-14b")
    assert [row_parallel(f"blk.3.{n}.weight", s.arch) for n in ("attn_output", "ffn_down", "attn_q", "ffn_up",
                                                                 "attn_norm")] == [True, True, False, False, False]
    assert not row_parallel("blk.3.attn_output.bias", s.arch)
    types = {t.name: t.type for t in s.tensors}
    q = next(t for t in s.tensors if t.name == "blk.0.attn_q.weight")
    assert device_shares(s, q.name, q.type, q.ne, 2, (), types) == [0.5, 0.5]  # whole query groups, even
    norm = next(t for t in s.tensors if t.name == "blk.0.attn_norm.weight")
    assert device_shares(s, norm.name, norm.type, norm.ne, 2, (), types) == [1.0, 1.0]  # mirrored: read by both


def test_tensor_mode_decode_beats_layers_over_a_fast_link_and_loses_over_a_slow_one() -> None:
    # qwen3-14b on two 24 GB 3090s, which hold it either way: -sm layer reads half the layers on one GPU and then the
    # other half on the other; -sm tensor reads half of every split weight on both at once, and all-reduces after
    # each layer's attn_output and ffn_down, a latency per token each
    m = load_machine("gpu-2x3090")
    layer, tensor = ["-sm", "layer"], ["-sm", "tensor"]
    bridged = _decode(m, "qwen3-14b", [*FLAGS, *tensor]) / _decode(m, "qwen3-14b", [*FLAGS, *layer])
    # both GPUs' bandwidth at once (at most 2x), less the 80 all-reduces, the mirrored norms and the output's gather
    assert bridged == pytest.approx(BRIDGED, rel=1e-3) and 1.5 < bridged < 2
    # staged through the host at 30 μs a copy (the other shipped profiles' figure) tensor still wins; at 250 μs the
    # 80 copies a token outweigh the halved reads
    host = _through_host(m, 30)
    assert _decode(host, "qwen3-14b", [*FLAGS, *tensor]) / _decode(host, "qwen3-14b", [*FLAGS, *layer]) == \
        pytest.approx(HOST_30, rel=1e-3)
    slow = _through_host(m, 250)
    ratio = _decode(slow, "qwen3-14b", [*FLAGS, *tensor]) / _decode(slow, "qwen3-14b", [*FLAGS, *layer])
    assert ratio == pytest.approx(HOST_250, rel=1e-3) and ratio < 1
    # the difference is the all-reduces alone: 2 per layer, one copy and one ADD each on two GPUs
    s = spec("qwen3-14b")
    plan = SimRunner(m, s).plan(parse_launch_flags([*FLAGS, *tensor]))
    per_token = 2 * s.n_layer * (slow.copy_seconds("CUDA0", "CUDA1", s.n_embd * 4.0)
                                 - m.copy_seconds("CUDA0", "CUDA1", s.n_embd * 4.0))
    assert ubatch_seconds(slow, plan, 1, 4096, 8) - ubatch_seconds(m, plan, 1, 4096, 8) == pytest.approx(
        per_token, rel=1e-9)


def test_tensor_mode_runs_no_op_offload_and_the_cpu_keeps_its_layers() -> None:
    # -ngl 20 of 40: under -sm layer op offload copies the CPU's 20 layers' weights to CUDA0 for a 512-token ubatch;
    # the Meta device offloads no op, so under -sm tensor the CPU computes them itself
    m = load_machine("gpu-2x3090")
    r = SimRunner(m, spec("qwen3-14b"))
    flags = ["-c", "8192", "-fa", "on", "-ngl", "20"]
    tensor = ubatch_stages(m, r.plan(parse_launch_flags([*flags, "-sm", "tensor"])), 512, 256, 8)
    layer = ubatch_stages(m, r.plan(parse_launch_flags(flags)), 512, 256, 8)
    assert set(tensor) == {"CPU", "Meta()"} and set(layer) == {"CPU", "CUDA0", "CUDA1"}
    assert tensor["CPU"] > 100 * layer["CPU"]
