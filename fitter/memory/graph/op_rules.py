"""How a device's backend treats the compute graph: which ops it runs and the bytes it gives a tensor.

One value per device backend in a `BackendMap` (fitter.memory.graph.graphs), made from the device's profile
(fitter.memory.backends.devices.DeviceProfile.ops): the CPU and llama.cpp's RPC backend run every op fitter builds at
ggml_nbytes (ggml-rpc.cpp answers supports_op for every op), CUDA's rules are fitter.memory.graph.cuda_ops', Vulkan's
fitter.memory.graph.vulkan_ops'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fitter.memory.graph import cuda_ops, vulkan_ops
from fitter.memory.graph.ggml_graph import Tensor

KINDS = ("cpu", "cuda", "vulkan")


@dataclass(frozen=True)
class OpRules:
    kind: str = "cpu"  # KINDS
    max_bytes: int | None = None  # Vulkan: the largest tensor the device's ops take (maxStorageBufferRange)
    graph_optimize: bool = True  # Vulkan: its graph_optimize reorders each split (fitter.memory.graph.vulkan_reorder)

    @property
    def reorders(self) -> bool:
        """The backend reorders the splits it runs before they are allocated (ggml-vulkan's graph_optimize;
        GGML_VK_DISABLE_GRAPH_OPTIMIZE turns it off). CUDA's only adds allocation dependencies for fused MoE ops
        (ggml_backend_cuda_graph_optimize): not modelled, its emulation cannot show it."""
        return self.kind == "vulkan" and self.graph_optimize

    def supports(self, t: Tensor) -> bool:
        """ggml_backend_dev_supports_op for this backend."""
        if self.kind == "cuda":
            return cuda_ops.cuda_supports_op(t)
        if self.kind == "vulkan":
            return vulkan_ops.vulkan_supports_op(t, self.max_bytes)
        return True

    def alloc_size(self) -> Callable[[Tensor], int] | None:
        """ggml_backend_buft_get_alloc_size of the device's buffer type (None: ggml_nbytes)."""
        return cuda_ops.cuda_alloc_size if self.kind == "cuda" else None


CPU_RULES = OpRules()
