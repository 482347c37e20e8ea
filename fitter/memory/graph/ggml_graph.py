"""A shape-only model of a ggml compute graph and of ggml-alloc, to size llama.cpp's compute buffers.

Only what decides memory is modelled: each tensor's type, shape and strides, which op made it, its sources, whether
it is a view, and the input/output flags. Nodes enter the graph in the order `ggml_build_forward_expand` gives them
(ggml/src/ggml.c `ggml_visit_parents_graph`: sources depth-first, then the node), and `allocate` repeats
ggml/src/ggml-alloc.c `ggml_gallocr_alloc_graph_impl` with its dynamic best-fit allocator (`ggml_dyn_tallocr`):
leafs first, then every node in order, parents freed after their last consumer, and element-wise ops writing over
a parent they are the last consumer of. The buffer llama.cpp logs is that allocator's high-water mark.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fitter.gguf._constants import GGML_QUANT_SIZES, GGMLQuantizationType

# ggml/src/ggml-alloc.c ggml_op_can_inplace
INPLACE_OPS = frozenset({
    "FILL", "SCALE", "DIAG_MASK_ZERO", "DIAG_MASK_INF", "ADD", "ADD_ID", "ADD1", "SUB", "MUL", "DIV", "SQR", "SQRT",
    "LOG", "UNARY", "ROPE", "ROPE_BACK", "SILU_BACK", "RMS_NORM", "RMS_NORM_BACK", "CLAMP", "SOFT_MAX",
    "SOFT_MAX_BACK",
})
VIEW_OPS = frozenset({"VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})


_TYPE_SIZES: dict[str, tuple[int, int]] = {}  # by the name as given: the enum look-up is a replay's hottest call


def type_size(type_name: str) -> tuple[int, int]:
    """(block size, bytes per block) of a ggml type, from gguf's table."""
    size = _TYPE_SIZES.get(type_name)
    if size is None:
        size = _TYPE_SIZES[type_name] = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]]
    return size


@dataclass(eq=False, slots=True)
class Tensor:
    type: str
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    op: str = "NONE"
    src: tuple[Tensor | None, ...] = ()
    view_src: Tensor | None = None  # the root tensor whose memory a view shares
    view_offs: int = 0
    has_data: bool = False  # weights and KV cache: allocated outside the compute buffer
    is_input: bool = False
    is_output: bool = False
    name: str = ""
    # Scheduling (fitter.memory.graph.sched): where a tensor with data lives, whether it is a weight (buffer usage
    # WEIGHTS, as opposed to a KV cache), and a backend llama.cpp pins a node to
    # (ggml_backend_sched_set_tensor_backend).
    backend: int = -1
    is_weight: bool = False
    pinned: int = -1
    _nbytes: int = field(default=-1, repr=False)  # type, ne and nb never change once a tensor is made

    @property
    def nbytes(self) -> int:
        """ggml_nbytes (ggml/src/ggml.c)."""
        if self._nbytes < 0:
            self._nbytes = self._count_bytes()
        return self._nbytes

    def _count_bytes(self) -> int:
        if any(n == 0 for n in self.ne):
            return 0
        block, size = type_size(self.type)
        if block == 1:
            n = size
            for i in range(4):
                n += (self.ne[i] - 1) * self.nb[i]
            return n
        n = self.ne[0] * self.nb[0] // block
        for i in range(1, 4):
            n += (self.ne[i] - 1) * self.nb[i]
        return n


def contiguous_strides(type_name: str, ne: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    block, size = type_size(type_name)
    nb0 = size
    nb1 = nb0 * (ne[0] // block)
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


def _ne4(ne: tuple[int, ...]) -> tuple[int, int, int, int]:
    padded = (*ne, 1, 1, 1, 1)
    return (padded[0], padded[1], padded[2], padded[3])


def new(type_name: str, *ne: int, op: str = "NONE", src: tuple[Tensor | None, ...] = (), name: str = "") -> Tensor:
    ne4 = _ne4(ne)
    return Tensor(type_name, ne4, contiguous_strides(type_name, ne4), op, src, name=name)


def data_tensor(type_name: str, *ne: int, name: str = "", backend: int = -1, weight: bool = True) -> Tensor:
    """A weight or a KV cache tensor: it has memory of its own, outside the compute buffer."""
    t = new(type_name, *ne, name=name)
    t.has_data = True
    t.backend = backend
    t.is_weight = weight
    return t


def input_tensor(type_name: str, *ne: int, name: str = "") -> Tensor:
    t = new(type_name, *ne, name=name)
    t.is_input = True
    return t


def _view(a: Tensor, op: str, ne: tuple[int, ...], nb: tuple[int, ...], offset: int = 0) -> Tensor:
    root = a.view_src if a.view_src is not None else a
    offs = (a.view_offs if a.view_src is not None else 0) + offset
    return Tensor(a.type, _ne4(ne), (nb[0], nb[1], nb[2], nb[3]), op, (a,), root, offs, name=a.name)


# --- views -------------------------------------------------------------------------------------------------------


def reshape(a: Tensor, *ne: int) -> Tensor:
    ne4 = _ne4(ne)
    return _view(a, "RESHAPE", ne4, contiguous_strides(a.type, ne4))


def view(a: Tensor, ne: tuple[int, ...], nb_rest: tuple[int, ...], offset: int = 0) -> Tensor:
    """ggml_view_Nd: ne[0..N) with strides nb1..nb(N-1) given; nb0 is the element size."""
    ne4 = _ne4(ne)
    nb = [a.nb[0], *nb_rest]
    while len(nb) < 4:
        nb.append(nb[-1] * ne4[len(nb) - 1])
    return _view(a, "VIEW", ne4, tuple(nb), offset)


def permute(a: Tensor, p0: int, p1: int, p2: int, p3: int) -> Tensor:
    ne = [0, 0, 0, 0]
    nb = [0, 0, 0, 0]
    for src_axis, dst_axis in enumerate((p0, p1, p2, p3)):
        ne[dst_axis] = a.ne[src_axis]
        nb[dst_axis] = a.nb[src_axis]
    return _view(a, "PERMUTE", tuple(ne), tuple(nb))


def transpose(a: Tensor) -> Tensor:
    return permute(a, 1, 0, 2, 3)


# --- ops that make new tensors -------------------------------------------------------------------------------------


def dup_op(op: str, a: Tensor, *src: Tensor | None) -> Tensor:
    """Ops whose result has a's type and shape, contiguous (ggml_dup_tensor): add, mul, rms_norm, rope, …"""
    return new(a.type, *a.ne, op=op, src=(a, *src))


def mul_mat(a: Tensor, b: Tensor) -> Tensor:
    return new("F32", a.ne[1], b.ne[1], b.ne[2], b.ne[3], op="MUL_MAT", src=(a, b))


def mul_mat_id(w: Tensor, b: Tensor, ids: Tensor) -> Tensor:
    return new("F32", w.ne[1], ids.ne[0], b.ne[2], 1, op="MUL_MAT_ID", src=(w, b, ids))


def get_rows(a: Tensor, ids: Tensor) -> Tensor:
    out_type = "I32" if a.type == "I32" else "F32"
    return new(out_type, a.ne[0], ids.ne[0], ids.ne[1], ids.ne[2], op="GET_ROWS", src=(a, ids))


def cont(a: Tensor, *ne: int) -> Tensor:
    return new(a.type, *(ne or a.ne), op="CONT", src=(a,))


def glu(op: str, a: Tensor, b: Tensor) -> Tensor:
    return new(a.type, *a.ne, op=op, src=(a, b))


def argsort_top_k(a: Tensor, k: int) -> Tensor:
    s = new("I32", *a.ne, op="ARGSORT", src=(a,))
    return view(s, (k, s.ne[1], s.ne[2], s.ne[3]), (s.nb[1], s.nb[2], s.nb[3]))


def flash_attn_ext(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, sinks: Tensor | None) -> Tensor:
    return new("F32", v.ne[0], q.ne[2], q.ne[1], q.ne[3], op="FLASH_ATTN_EXT", src=(q, k, v, mask, sinks))


def set_rows(dst: Tensor, rows: Tensor, idxs: Tensor) -> Tensor:
    """Writes into dst (a KV cache view): the result is a view, nothing is allocated."""
    t = _view(dst, "SET_ROWS", dst.ne, dst.nb)
    t.src = (dst, rows, idxs)
    return t


def concat(a: Tensor, b: Tensor) -> Tensor:
    """ggml_concat along dim 0."""
    return new(a.type, a.ne[0] + b.ne[0], a.ne[1], a.ne[2], a.ne[3], op="CONCAT", src=(a, b))


def sum_rows(a: Tensor) -> Tensor:
    return new("F32", 1, a.ne[1], a.ne[2], a.ne[3], op="SUM_ROWS", src=(a,))


def clamp(a: Tensor) -> Tensor:
    return dup_op("CLAMP", a)


# --- the graph ----------------------------------------------------------------------------------------------------


@dataclass
class Graph:
    nodes: list[Tensor] = field(default_factory=list)
    leafs: list[Tensor] = field(default_factory=list)
    _seen: set[int] = field(default_factory=set)
    # tensors the scheduler flags input and output so ggml-alloc never frees or reuses them: with pipeline
    # parallelism, every copy of a graph input and of a split input (ggml-backend.cpp, n_copies > 1)
    kept: set[Tensor] = field(default_factory=set)

    def expand(self, t: Tensor) -> Tensor:
        """ggml_build_forward_expand: add t and its unseen ancestors, sources first."""
        stack: list[tuple[Tensor, int]] = [(t, 0)]
        while stack:
            node, i = stack.pop()
            if i == 0:
                if id(node) in self._seen:
                    continue
                self._seen.add(id(node))
            if i < len(node.src):
                stack.append((node, i + 1))
                s = node.src[i]
                if s is not None and id(s) not in self._seen:
                    stack.append((s, 0))
                continue
            if node.op == "NONE":
                self.leafs.append(node)
            else:
                self.nodes.append(node)
        return t


# --- ggml-alloc ---------------------------------------------------------------------------------------------------

MAX_CHUNKS = 16  # GGML_VBUFFER_MAX_CHUNKS, ggml-alloc.c
_CHUNK_BITS = 56  # a chunked allocator's address: chunk << _CHUNK_BITS | offset (offsets stay far below 2**56)


@dataclass(frozen=True)
class BufferType:
    """What ggml-alloc sizes a compute buffer by: the buffer type's alignment (ggml_backend_buft_get_alignment), its
    maximum buffer size (ggml_backend_buft_get_max_size: past it the allocation is split into chunks, one backend
    buffer each; None: no maximum), and the bytes its alloc_buffer adds to each buffer it makes (ggml-vulkan's
    pinned host type adds 32, `ggml_backend_vk_host_buffer_type_alloc_buffer`)."""

    alignment: int
    max_size: int | None = None
    extra: int = 0

    def bytes(self, chunks: tuple[int, ...]) -> int:
        """The size llama.cpp logs for a buffer of these chunks (ggml_vbuffer_size: each chunk's buffer)."""
        return sum(chunks) + self.extra * len(chunks)


class _DynAllocator:
    """ggml_dyn_tallocr with one chunk (CPU and device buffers have no practical maximum size)."""

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.blocks: list[list[int]] = [[0, 1 << 62]]  # sorted [offset, size]; the last one is the open end
        self.max_size = 0

    def chunks(self) -> tuple[int, ...]:
        return (self.max_size,) if self.max_size else ()

    def _align(self, n: int) -> int:
        return (n + self.alignment - 1) // self.alignment * self.alignment

    def alloc(self, size: int) -> int:
        a = self.alignment
        size = (size + a - 1) // a * a
        blocks = self.blocks
        best, best_size = len(blocks) - 1, -1  # the open end unless a block fits (the best fit, the last of equals)
        for i in range(len(blocks) - 1):
            bsize = blocks[i][1]
            if bsize >= size and (best_size == -1 or bsize <= best_size):
                best, best_size = i, bsize
        block = blocks[best]
        offset = block[0]
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del blocks[best]
        if offset + size > self.max_size:
            self.max_size = offset + size
        return offset

    def free(self, offset: int, size: int) -> None:
        size = self._align(size)
        blocks = self.blocks
        for i, block in enumerate(blocks):
            if block[0] + block[1] == offset:
                block[1] += size
                if i < len(blocks) - 1 and block[0] + block[1] == blocks[i + 1][0]:
                    block[1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if offset + size == block[0]:
                block[0] = offset
                block[1] += size
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == block[0]:
                    blocks[i - 1][1] += block[1]
                    del blocks[i]
                return
        pos = 0
        while pos < len(blocks) and blocks[pos][0] < offset:
            pos += 1
        blocks.insert(pos, [offset, size])


class _ChunkedAllocator:
    """ggml_dyn_tallocr of a buffer type with a maximum size: free blocks per chunk, a new chunk when none has room
    (ggml-alloc.c `ggml_dyn_tallocr_alloc`, `ggml_dyn_tallocr_new_chunk`, `ggml_dyn_tallocr_free_bytes`). An address
    is `chunk << _CHUNK_BITS | offset`."""

    def __init__(self, alignment: int, max_chunk: int) -> None:
        self.alignment = alignment
        self.max_chunk = min(max_chunk, (1 << 63) - 1)  # SIZE_MAX/2
        self.blocks: list[list[list[int]]] = []  # per chunk: sorted [offset, size]; the last one the chunk's end
        self.max_sizes: list[int] = []

    def chunks(self) -> tuple[int, ...]:
        return tuple(self.max_sizes)

    def _align(self, n: int) -> int:
        return (n + self.alignment - 1) // self.alignment * self.alignment

    def alloc(self, size: int) -> int:
        size = self._align(size)
        best_chunk = best_block = -1
        for c, blocks in enumerate(self.blocks):  # the best fit besides each chunk's last block; a later chunk's wins
            best_fit = None
            for i in range(len(blocks) - 1):
                bsize = blocks[i][1]
                if bsize >= size and (best_fit is None or bsize <= best_fit):
                    best_chunk, best_block, best_fit = c, i, bsize
        if best_block == -1:  # a chunk's last block, preferring the one that grows its chunk least
            best_reuse: int | None = None
            for c, blocks in enumerate(self.blocks):
                if not blocks:
                    continue
                last = blocks[-1]
                reuse = self.max_sizes[c] - last[0] - size
                better_reuse = (best_reuse is None or best_reuse < 0) and (best_reuse is None or reuse > best_reuse)
                better_fit = reuse >= 0 and best_reuse is not None and reuse < best_reuse
                if last[1] >= size and (better_reuse or better_fit):
                    best_chunk, best_block, best_reuse = c, len(blocks) - 1, reuse
        if best_block == -1:
            room = max(size, self.max_chunk) if len(self.blocks) < MAX_CHUNKS - 1 else (1 << 63) - 1
            self.blocks.append([[0, room]])
            self.max_sizes.append(0)
            best_chunk, best_block = len(self.blocks) - 1, 0
        blocks = self.blocks[best_chunk]
        block = blocks[best_block]
        offset = block[0]
        block[0] += size
        block[1] -= size
        if block[1] == 0:
            del blocks[best_block]
        self.max_sizes[best_chunk] = max(self.max_sizes[best_chunk], offset + size)
        return best_chunk << _CHUNK_BITS | offset

    def free(self, address: int, size: int) -> None:
        size = self._align(size)
        blocks = self.blocks[address >> _CHUNK_BITS]
        offset = address & ((1 << _CHUNK_BITS) - 1)
        for i, block in enumerate(blocks):
            if block[0] + block[1] == offset:
                block[1] += size
                if i < len(blocks) - 1 and block[0] + block[1] == blocks[i + 1][0]:
                    block[1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if offset + size == block[0]:
                block[0] = offset
                block[1] += size
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == block[0]:
                    blocks[i - 1][1] += block[1]
                    del blocks[i]
                return
        pos = 0
        while pos < len(blocks) and blocks[pos][0] < offset:
            pos += 1
        blocks.insert(pos, [offset, size])


@dataclass(slots=True)
class _Hash:
    n_children: int = 0
    n_views: int = 0
    allocated: bool = False
    buffer: int = 0
    offset: int = -1


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


def _nbytes(t: Tensor) -> int:
    return t.nbytes


def allocate(graph: Graph, alignment: int) -> int:
    """Peak bytes of ggml_gallocr_alloc_graph_impl over this graph: the compute buffer size."""
    return sum(allocate_buffers(graph, [BufferType(alignment)], lambda t: 0)[0])


def allocate_buffers(graph: Graph, bufts: Sequence[BufferType], buffer_of: Callable[[Tensor], int],
                     sizes: Sequence[Callable[[Tensor], int] | None] | None = None) -> list[tuple[int, ...]]:
    """ggml_gallocr with one buffer per backend: the peak bytes of each of its chunks (one chunk unless its buffer
    type has a maximum size; none if nothing was allocated in it). `buffer_of` gives a tensor's buffer (ggml-alloc
    takes it from node_buffer_ids / leaf_buffer_ids, which the scheduler fills with backends); `sizes[i]` is buffer
    i's ggml_backend_buft_get_alloc_size (None: ggml_nbytes)."""
    allocs = [_DynAllocator(b.alignment) if b.max_size is None else _ChunkedAllocator(b.alignment, b.max_size)
              for b in bufts]
    size_fns = [f or _nbytes for f in (sizes or [None] * len(bufts))]
    known: list[dict[Tensor, int]] = [{} for _ in bufts]  # sizes per buffer: nothing they depend on changes
    # Every tensor the graph reaches gets its entry first (tensors hash by identity), so the loops index directly.
    info: dict[Tensor, _Hash] = {}
    for t in (*graph.leafs, *graph.nodes):
        for x in (t, *t.src):
            if x is not None and x not in info:
                info[x] = _Hash()
                if x.view_src is not None and x.view_src not in info:
                    info[x.view_src] = _Hash()

    def size(t: Tensor, buffer_id: int) -> int:
        sizes = known[buffer_id]
        n = sizes.get(t)
        if n is None:
            n = sizes[t] = size_fns[buffer_id](t)
        return n

    def allocate_node(node: Tensor, buffer_id: int) -> None:
        hn = info[node]
        if node.has_data or hn.allocated or node.view_src is not None:
            return
        hn.allocated = True
        if node.op in INPLACE_OPS:
            for parent in node.src:
                if parent is None:
                    continue
                p_hn = info[parent]
                # Only a tensor this allocator placed can be reused (views and weights never are), never a graph
                # output, only with the same layout, and only by its last consumer.
                if not p_hn.allocated or parent.is_output or parent in kept or not _same_layout(node, parent):
                    continue
                if p_hn.n_children == 1 and p_hn.n_views == 0:
                    hn.buffer, hn.offset = p_hn.buffer, p_hn.offset
                    p_hn.allocated = False
                    alloc = allocs[hn.buffer]
                    p_size = alloc._align(size(parent, p_hn.buffer))
                    n_size = alloc._align(size(node, hn.buffer))
                    if p_size > n_size:  # ggml_gallocr_free_extra_space
                        alloc.free(hn.offset + n_size, p_size - n_size)
                    return
        hn.buffer = buffer_id
        hn.offset = allocs[buffer_id].alloc(size(node, buffer_id))

    kept = graph.kept

    def free_node(node: Tensor, hn: _Hash) -> None:
        if node.is_output or node in kept:
            return
        allocs[hn.buffer].free(hn.offset, size(node, hn.buffer))
        hn.allocated = False

    for leaf in graph.leafs:
        allocate_node(leaf, buffer_of(leaf))
    for node in graph.nodes:
        if node.view_src is not None and node.op != "NONE":
            info[node.view_src].n_views += 1
        if node.is_input:
            allocate_node(node, buffer_of(node))
        for s in node.src:
            if s is None:
                continue
            info[s].n_children += 1
            if s.is_input:
                allocate_node(s, buffer_of(node))
    for node in graph.nodes:
        buffer_id = buffer_of(node)
        srcs = node.src
        for parent in srcs:
            # allocate_node's own early return, checked here: most parents are weights, views or placed already
            if parent is not None and not parent.has_data and parent.view_src is None and not info[parent].allocated:
                allocate_node(parent, buffer_id)
        if not node.has_data and node.view_src is None:
            allocate_node(node, buffer_id)
        for parent in srcs:
            if parent is None:
                continue
            p_hn = info[parent]
            p_hn.n_children -= 1
            if p_hn.n_children == 0 and p_hn.n_views == 0:
                root = parent.view_src
                if root is not None:
                    r_hn = info[root]
                    r_hn.n_views -= 1
                    if r_hn.n_views == 0 and r_hn.n_children == 0 and r_hn.allocated:
                        free_node(root, r_hn)
                elif p_hn.allocated:
                    free_node(parent, p_hn)
    return [a.chunks() for a in allocs]
