"""The host RAM a plan holds while serving, by how the operating system treats it: what a host budget must count.

llama.cpp's logged host buffers are not what RAM holds. Under mmap the `CPU_Mapped` buffer is the byte range of
each shard spanning its CPU tensors (llama_model_loader::get_mapping_range), GPU tensors between them included; the
GPU's are read once to upload them and stay as clean page cache the kernel reclaims, so the RAM a served model keeps
is its CPU tensors' bytes. With `-lm mmap+mlock` the loader locks each mapping from its start to the end of the last
CPU tensor (src/llama-model-loader.cpp load_all_data: `lmlock->grow_to(offs + n_size)`): that prefix is resident and
cannot be reclaimed. Every other host buffer (weights read into RAM with `-lm none|mlock|dio`, repacked weights, a
KV cache under `-nkvo`, compute, output) is anonymous memory; a device's pinned host buffer type (CUDA_Host,
Vulkan_Host) is page-locked too. A device that shares the host's memory (an integrated GPU, Apple silicon) draws on
the same RAM. And llama-server keeps its prompt cache there (tools/server/server-task.cpp server_prompt_cache): up to
`--cache-ram` MiB (8192 by default; 0 none; -1 no size limit, only the context's tokens, so at most a full
context's KV state).
"""

from __future__ import annotations

from dataclasses import dataclass

from fitter.memory.plan.buffers import CPU
from fitter.memory.plan.estimator import MemoryPlan
from fitter.units import MIB

PAGE = 4096  # Linux's page (x86-64, arm64): a mapping is resident, and mlock'ed, in pages (macOS arm64: 16 KiB)


@dataclass(frozen=True)
class HostMemory:
    mapped: int  # model file pages the CPU reads while serving (page cache, needed resident for speed)
    locked: bool  # the mapped pages are mlock'ed (-lm mmap+mlock): not reclaimable
    anonymous: int  # host buffers of the process's own memory: weights read into RAM, repacked weights, KV, compute
    pinned: int  # page-locked host buffers of a device's host buffer type (CUDA_Host, Vulkan_Host, …)
    shared: int  # buffers of devices that share the host's memory (integrated GPUs, Apple silicon)
    prompt_cache: int  # llama-server's prompt cache at its limit (--cache-ram)

    @property
    def total(self) -> int:
        return self.mapped + self.anonymous + self.pinned + self.shared + self.prompt_cache

    def line(self) -> str:
        """The estimate's one line on host RAM."""
        parts = [f"mapped weights {self.mapped / MIB:.2f}" + (" (mlock'ed)" if self.locked else ""),
                 f"own buffers {self.anonymous / MIB:.2f}"]
        if self.pinned:
            parts.append(f"pinned {self.pinned / MIB:.2f}")
        if self.shared:
            parts.append(f"shared with the GPU {self.shared / MIB:.2f}")
        if self.prompt_cache:
            parts.append(f"prompt cache up to {self.prompt_cache / MIB:.2f} (--cache-ram)")
        return f"host RAM while serving: {self.total / MIB:.2f} MiB: " + ", ".join(parts)


def host_memory(plan: MemoryPlan) -> HostMemory:
    """The plan's host RAM (the module's rules); a draft model's buffers and weights count too."""
    config = plan.config
    pinned_bufts = {d.profile.host_buft for d in plan.devices if d.profile.host_buft}
    mapped = anonymous = pinned = shared = 0
    unified = {d.name for d in plan.devices if d.profile.unified}
    for b in plan.buffers:
        if b.device in unified:
            shared += b.bytes
        elif b.device != CPU or b.buft == "CPU_Mapped":
            continue
        elif b.buft in pinned_bufts:
            pinned += b.bytes
        else:
            anonymous += b.bytes
    locked = config.load_mode == "mmap+mlock"
    for p in (plan, plan.draft) if plan.draft is not None else (plan,):
        if p.config.mmap:
            mapped += _mapped_pages(p, locked)
    return HostMemory(mapped, locked, anonymous, pinned, shared, _prompt_cache(plan))


def _mapped_pages(plan: MemoryPlan, locked: bool) -> int:
    """The pages of each shard the CPU's tensors lie on (a page is resident or not); mlock'ed: the shard's prefix up
    to the last of them, which llama_mlock::grow_to locks whole pages of (src/llama-mmap.cpp)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for placed in plan.placements:
        if placed.buft == CPU:
            t = placed.tensor
            spans.setdefault(t.shard, []).append((t.offset // PAGE, -(-(t.offset + t.n_bytes) // PAGE)))
    pages = 0
    for shard in spans.values():
        if locked:
            pages += max(end for _, end in shard)
            continue
        reach = 0
        for start, end in sorted(shard):  # the union of the tensors' page ranges
            pages += max(0, end - max(start, reach))
            reach = max(reach, end)
    return pages * PAGE


def _prompt_cache(plan: MemoryPlan) -> int:
    mib = plan.config.cache_ram_mib
    if mib >= 0:
        return mib * MIB
    # no size limit: the cache keeps at most the context's tokens (server_prompt_cache's limit_tokens = n_ctx), each
    # with its state, so at most the KV cache (and recurrent state) of a full context
    return sum(b.bytes for b in plan.buffers if b.kind == "kv")
