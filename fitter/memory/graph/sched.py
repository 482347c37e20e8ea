"""ggml_backend_sched's backend assignment and graph splitting, on fitter's shape-only graphs.

Mirrors ggml/src/ggml-backend.cpp `ggml_backend_sched_split_graph` for one device plus the CPU, or several devices
without pipeline parallelism: pass 1 puts ops next to their weights (and graph inputs on the CPU), pass 2 spreads
device assignments up and down the graph, pass 4 gives views and sources their producer's backend, pass 5 cuts the
graph where the backend changes and copies every input a split reads from another backend into that split's
buffer. The copy of a graph as ggml-alloc then sees it (input dependency, input copy, split nodes) is returned with
each tensor's buffer, so `fitter.memory.graph.ggml_graph.allocate_buffers` gives each backend's compute buffer.

Backends are indices, devices first and the CPU last; every buffer type belongs to exactly one backend (the CPU
backend accepts all host buffer types). Which ops a device runs is its backend's (fitter.memory.graph.op_rules): RPC
supports every op fitter builds (ggml-rpc.cpp), CUDA has flash-attention kernels for some shapes and types only
(fitter.memory.graph.cuda_ops.cuda_supports_op), Vulkan takes no tensor past its buffer range
(fitter.memory.graph.vulkan_ops);
the passes that spread or choose a backend skip a device that does not support the op
(`ggml_backend_sched_set_if_supported`, pass 3), a weight whose device cannot run its op is read from where it is by
whichever backend runs the op (a split input, `ggml_backend_sched_backend_from_buffer` answering -1), and a node that
writes into a device's buffer the device cannot run aborts the load as llama.cpp does ("pre-allocated tensor …
that cannot run the operation": `ScheduleError`). Op offload: an op whose weight lives on the CPU moves to the
first device that wants it (pass 1, "1.off": CUDA and Vulkan take ops of a batch of 32 or more), and pass 5 then
copies the weight into that device's compute buffer, one split per foreign weight.
"""

from __future__ import annotations

from collections.abc import Callable

from fitter.errors import LaunchConfigError
from fitter.memory.graph import cuda_ops as cuda
from fitter.memory.graph.ggml_graph import VIEW_OPS, Graph, Tensor
from fitter.memory.graph.op_rules import CPU_RULES, OpRules
from fitter.memory.graph.vulkan_reorder import MAX_SRC, reorder


class ScheduleError(LaunchConfigError):
    """llama.cpp aborts scheduling this graph (a pre-allocated tensor in a buffer whose backend cannot run its op)."""


def _buffer_backend(t: Tensor) -> int:
    """Backend owning the buffer a tensor already lives in (weights, KV cache, views of them), or -1."""
    root = t.view_src if t.view_src is not None else t
    return root.backend if root.has_data else -1


def schedule(graph: Graph, n_backends: int, offload_min_batch: tuple[int | None, ...] = (),
             ops: tuple[OpRules, ...] = (), n_copies: int = 1) -> tuple[Graph, Callable[[Tensor], int]]:
    """`offload_min_batch[b]`: the batch from which device b takes over ops with CPU weights (None: never);
    `ops[b]`: device b's backend rules (none given: the CPU's, every op); `n_copies`: the scheduler's input copies (4
    with pipeline parallelism, GGML_SCHED_MAX_COPIES; else 1)."""
    cpu = n_backends - 1
    backend: dict[Tensor | None, int] = {}  # tensors hash by identity; None is never a key

    def get(t: Tensor | None) -> int:
        return backend.get(t, -1)

    def supports_op(t: Tensor, b: int) -> bool:
        return (ops[b] if b < len(ops) else CPU_RULES).supports(t)

    def from_buffer(t: Tensor, op: Tensor) -> int:
        """ggml_backend_sched_backend_from_buffer: the backend owning t's buffer when it can run `op`, else -1."""
        b = _buffer_backend(t)
        return b if b != -1 and supports_op(op, b) else -1

    def from_cur(t: Tensor) -> int:
        """ggml_backend_sched_backend_id_from_cur."""
        b = from_buffer(t, t)
        if b != -1:
            return b
        owner = _buffer_backend(t)
        if owner != -1:  # pre-allocated, and its backend cannot run the op: llama.cpp aborts (GGML_ABORT)
            root = t.view_src if t.view_src is not None else t
            raise ScheduleError(f"llama.cpp aborts this config: {root.name or 'a tensor'} lives on device {owner} "
                                f"whose backend cannot run its {t.op} ({t.nbytes} bytes; ggml-backend.cpp: "
                                "\"pre-allocated tensor in a buffer that cannot run the operation\")")
        if t.is_input:
            return cpu
        if t.op not in ("ROPE", "FLASH_ATTN_EXT"):
            for s in t.src:
                if s is not None and s.has_data and s.is_weight:
                    src_backend = from_buffer(s, t)
                    if src_backend == cpu:  # a host weight: does a device want the op? ("1.off")
                        for dev, min_batch in enumerate(offload_min_batch[:cpu]):
                            if min_batch is not None and supports_op(t, dev) and cuda.op_batch_size(t) >= min_batch:
                                return dev
                    return src_backend
        return -1

    # pass 1
    for leaf in graph.leafs:
        backend[leaf] = from_cur(leaf)
    for node in graph.nodes:
        backend[node] = node.pinned if node.pinned != -1 else from_cur(node)
    # pass 2: spread devices down and up, then any backend down and up
    compute_nodes = [n for n in graph.nodes if n.op not in VIEW_OPS]
    for order, skip_cpu in ((compute_nodes, True), (compute_nodes[::-1], True), (compute_nodes, False),
                            (compute_nodes[::-1], False)):
        cur = -1
        for node in order:
            b = backend[node]
            if b != -1:
                cur = -1 if (skip_cpu and b == cpu) else b
            elif cur != -1 and supports_op(node, cur):  # ggml_backend_sched_set_if_supported
                backend[node] = cur

    def supported(t: Tensor, b: int) -> bool:
        """ggml_backend_sched_buffer_supported: can backend b read t where it is?"""
        owner = _buffer_backend(t)
        if owner == -1:
            owner = get(t)
            if owner == -1 and t.view_src is not None:
                owner = get(t.view_src)
        return owner == b

    # pass 3: nodes still unassigned go where most of their inputs are
    for node in compute_nodes:
        if backend[node] == -1:
            best, best_n = -1, -1
            for b in range(n_backends):
                if not supports_op(node, b):
                    continue
                n = sum(1 for s in node.src if s is not None
                        and (get(s) != -1 or get(s.view_src) != -1) and supported(s, b))
                if n > best_n:
                    best, best_n = b, n
            backend[node] = best
    # pass 4: views and remaining sources
    for node in graph.nodes:
        if node.view_src is not None and backend[node] == -1:
            backend[node] = get(node.view_src)
        for s in node.src:
            if s is not None and get(s) == -1:
                backend[s] = get(s.view_src) if s.view_src is not None else backend[node]
        if backend[node] == -1:
            backend[node] = 0
    # pass 5: splits and input copies
    copy = Graph()
    uses: dict[Tensor, int] = {}  # each node's uses in the graph (ggml_node_get_use_count), before any redirect
    for node in graph.nodes:
        for s in node.src:
            if s is not None:
                uses[s] = uses.get(s, 0) + 1
    copy.leafs = list(graph.leafs)
    copies: dict[tuple[Tensor, int], Tensor] = {}
    pending: list[Tensor] = []  # nodes of the current split
    inputs: list[Tensor] = []
    first = next((n for n in graph.nodes if n.op not in VIEW_OPS), None)
    cur = backend[first] if first is not None else cpu

    split_inputs: list[Tensor] = []  # every split's input copies, in split order (the current copy of each)

    def flush() -> None:
        for inp in inputs:
            split_inputs.append(copies[(inp, split_backend)])
            dep = Tensor(inp.type, inp.ne, inp.nb, "NONE", (inp,),
                         inp.view_src if inp.view_src is not None else inp)
            backend[dep] = get(inp)
            copy.nodes.append(dep)  # keeps the source alive until it is copied
            cpy = copies[(inp, split_backend)]
            copy.nodes.append(cpy)  # allocated at the start of the split
        rules = ops[split_backend] if split_backend < len(ops) else CPU_RULES
        if rules.reorders:  # the backend's graph_optimize, and the allocation dependencies it asks for
            nodes, deps = reorder(pending, lambda t: uses.get(t, 0))
        else:
            nodes, deps = list(pending), {}
        for node in nodes:
            copy.nodes.append(node)
            kept = deps.get(node, [])
            for k in range(0, len(kept), MAX_SRC):  # a view of the first, reading them all (ggml-backend.cpp)
                first = kept[k]
                dep = Tensor(first.type, first.ne, first.nb, "NONE", tuple(kept[k:k + MAX_SRC]),
                             first.view_src if first.view_src is not None else first)
                backend[dep] = split_backend
                copy.nodes.append(dep)
        pending.clear()
        inputs.clear()

    split_backend = cur
    for node in graph.nodes:
        if node.op in VIEW_OPS:
            pending.append(node)
            continue
        b = backend[node]
        new_split = b != split_backend
        if not new_split and inputs:
            new_split = any(s is not None and s.has_data and s.is_weight and get(s) != split_backend
                            and not supported(s, split_backend) for s in node.src)
        if new_split:
            flush()
            split_backend = b
        srcs: list[Tensor | None] | None = None  # a copy of node.src once one source is redirected
        for j, s in enumerate(node.src):
            if s is None or backend.get(s, -1) == split_backend or supported(s, split_backend):
                continue
            key = (s, split_backend)
            if key not in copies:
                cpy = Tensor(s.type, s.ne, s.nb, "NONE", name=s.name + "#copy")
                backend[cpy] = split_backend
                copies[key] = cpy
                inputs.append(s)
            if srcs is None:
                srcs = list(node.src)
            srcs[j] = copies[key]
        if srcs is not None:
            node.src = tuple(srcs)
        pending.append(node)
    flush()
    if n_copies > 1:
        _pipeline_copies(graph, copy, split_inputs, backend, n_copies)
    return copy, lambda t: backend.get(t, cpu)


def _pipeline_copies(graph: Graph, copy: Graph, split_inputs: list[Tensor], backend: dict[Tensor | None, int],
                     n_copies: int) -> None:
    """ggml_backend_sched_split_graph with n_copies > 1: pass 6 gives every graph input n_copies copies on its
    backend (the input itself is the current one), each split input has n_copies copies (pass 5), all flagged input
    and output so ggml-alloc never frees them, and all are added as leafs ahead of the graph's own, so they are
    allocated first: graph inputs, then split inputs in split order."""
    leafs: list[Tensor] = []
    for current in [leaf for leaf in graph.leafs if leaf.is_input] + split_inputs:
        for c in range(n_copies):
            t = current if c == 0 else Tensor(current.type, current.ne, current.nb, "NONE",
                                              name=f"{current.name}#{c}")
            backend[t] = backend[current]
            copy.kept.add(t)
            leafs.append(t)
    copy.leafs = leafs + copy.leafs
