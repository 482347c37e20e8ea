"""fitter.memory.plan.host: the host RAM a plan holds while serving, by how the operating system treats it."""

from __future__ import annotations

from fitter.flags import parse_launch_flags
from fitter.gguf.model_spec import load_model_spec
from fitter.memory.backends.devices import CPU_AVX2
from fitter.memory.backends.registry import parse_devices
from fitter.memory.plan.estimator import MemoryPlan, estimate
from fitter.memory.plan.host import PAGE, host_memory
from fitter.units import MIB
from tests.models import model_file


def _plan(flags: list[str], devices: str = "none") -> MemoryPlan:
    spec = load_model_spec(str(model_file("gpt-oss-tiny")))
    return estimate(spec, parse_launch_flags(flags), parse_devices(devices), CPU_AVX2)


def _bytes(plan: MemoryPlan, buft: str) -> int:
    return sum(b.bytes for b in plan.buffers if b.buft == buft)


def test_a_mapped_model_holds_the_pages_of_its_cpu_tensors_and_the_rest_is_its_own_buffers() -> None:
    plan = _plan(["-c", "512", "-ngl", "0"])
    host = host_memory(plan)
    # the repacked weights are copies in the process's own memory; the mapped range they lie in is read once
    assert host.mapped == 69 * PAGE < _bytes(plan, "CPU_Mapped") + PAGE
    assert host.anonymous == _bytes(plan, "CPU_REPACK") + _bytes(plan, "CPU") == 3391520
    assert (host.pinned, host.shared, host.prompt_cache) == (0, 0, 8192 * MIB)  # llama-server's default cache
    assert host.total == host.mapped + host.anonymous + 8192 * MIB


def test_gpu_tensors_inside_the_mapped_range_are_not_resident_unless_mlocked() -> None:
    plan = _plan(["-c", "512", "-ngl", "all", "-ncmoe", "1"], "rpc:127.0.0.1:50052")
    assert _bytes(plan, "CPU_Mapped") == 237120  # llama.cpp's logged range: the token embedding to layer 0's experts
    assert host_memory(plan).mapped == 21 * PAGE  # the CPU's own tensors' pages only
    # -lm mmap+mlock locks each mapping from its start to the last CPU tensor's end, whole pages
    locked = host_memory(_plan(["-c", "512", "-ngl", "all", "-ncmoe", "1", "-lm", "mmap+mlock"],
                               "rpc:127.0.0.1:50052"))
    assert (locked.mapped, locked.locked) == (62 * PAGE, True)


def test_pinned_host_buffers_and_the_prompt_caches_limits() -> None:
    loaded = _plan(["-c", "512", "-ngl", "all", "-ncmoe", "1", "-lm", "none", "-cram", "-1"], "cuda:8192")
    host = host_memory(loaded)
    assert (host.mapped, host.anonymous) == (0, 0)
    assert host.pinned == _bytes(loaded, "CUDA_Host") == 2830368  # the experts, compute and output in CUDA_Host
    # no size limit: at most a full context's tokens, so the KV cache's bytes
    assert host.prompt_cache == sum(b.bytes for b in loaded.buffers if b.kind == "kv") == 262144
    on_host = host_memory(_plan(["-c", "512", "-ngl", "all", "-nkvo", "-cram", "0"], "cuda:8192"))
    assert (on_host.anonymous, on_host.prompt_cache) == (262144, 0)  # -nkvo: the KV cache in the host's memory


def test_the_c_apis_programs_keep_no_prompt_cache() -> None:
    spec = load_model_spec(str(model_file("gpt-oss-tiny")))
    plan = estimate(spec, parse_launch_flags(["-c", "512"], "llama-cpp-python"), (), CPU_AVX2)
    assert host_memory(plan).prompt_cache == 0
