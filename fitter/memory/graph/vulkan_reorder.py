"""ggml-vulkan's reordering of each split it runs, which decides the order ggml-alloc places its compute buffer in.

ggml-backend.cpp `ggml_backend_sched_split_graph` hands every split to its backend's `graph_optimize` before the
graph copy is allocated; ggml-vulkan's (ggml/src/ggml-vulkan/ggml-vulkan.cpp `ggml_vk_graph_optimize`, llama.cpp
0c1e570) moves independent nodes forward so they can run concurrently and keeps fusable runs together, and for the
fused top-k MoE runs it asks the scheduler to keep the run's external inputs alive until its last node
(`add_pattern_alloc_deps`; the scheduler adds a dependency node after that node, ggml-backend.cpp). The buffer's peak
follows the new order: on lavapipe the Vulkan compute buffer of the demo model is 2-5 % off without this, exact with
it (tests/golden/vulkan-emulated.json; GGML_VK_DISABLE_GRAPH_OPTIMIZE turns it off in llama.cpp and here).

`reorder` is a line-for-line port over fitter's shape-only tensors. Patterns of ops fitter's graphs never build (the
snake activation, sparse attention's top-k, DeepSeek-V4's hyper-connections) can never match and are left out;
every UNARY fitter builds (SiLU, sigmoid, softplus) is one ggml-vulkan fuses with a following MUL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fitter.memory.graph.ggml_graph import Tensor, type_size

MAX_SRC = 10  # GGML_MAX_SRC
NUM_TO_CHECK = 20  # how far ahead a node may be pulled from
_EMPTY = frozenset({"NONE", "RESHAPE", "TRANSPOSE", "VIEW", "PERMUTE"})

# ggml-vulkan-types.h: the runs ggml-vulkan fuses, kept in order (the top-k MoE ones with their inputs kept alive)
TOPK_MOE_PATTERNS = (
    ("SOFT_MAX", "RESHAPE", "ARGSORT", "VIEW", "GET_ROWS", "RESHAPE", "SUM_ROWS", "CLAMP", "DIV", "RESHAPE"),
    ("UNARY", "RESHAPE", "ADD", "ARGSORT", "VIEW", "GET_ROWS", "RESHAPE", "SUM_ROWS", "CLAMP", "DIV", "RESHAPE"),
    ("UNARY", "SQRT", "RESHAPE", "ADD", "ARGSORT", "VIEW", "GET_ROWS", "RESHAPE", "SUM_ROWS", "CLAMP", "DIV",
     "RESHAPE"),
    ("SOFT_MAX", "RESHAPE", "ARGSORT", "VIEW", "GET_ROWS"),
    ("ARGSORT", "VIEW", "GET_ROWS", "RESHAPE", "SOFT_MAX", "RESHAPE"),
)
KEPT_PATTERNS = (
    ("RMS_NORM", "MUL", "ADD", "MUL"),
    ("RMS_NORM", "MUL", "ADD"),
    ("RMS_NORM", "MUL", "ROPE", "VIEW", "SET_ROWS"),
    ("RMS_NORM", "VIEW", "SET_ROWS"),
    ("ROPE", "VIEW", "SET_ROWS"),
)
_ALL_PATTERNS = (*TOPK_MOE_PATTERNS, *KEPT_PATTERNS)
# a node may follow the last one of the current set even though it reads it: the pairs ggml-vulkan fuses
_ADJACENT_FUSIONS = frozenset({("MUL_MAT", "ADD"), ("MUL_MAT_ID", "ADD_ID"), ("MUL_MAT_ID", "MUL"), ("ADD", "ADD"),
                               ("SSM_CONV", "ADD"), ("SSM_CONV", "UNARY")})


def _base(t: Tensor) -> Tensor:
    return t.view_src if t.view_src is not None else t


def _src(t: Tensor, s: int) -> Tensor | None:
    return t.src[s] if s < len(t.src) else None


def _is_src_of(dst: Tensor, src: Tensor) -> bool:
    for s in range(MAX_SRC):
        d_s = _src(dst, s)
        if d_s is src:
            return True
        if dst.op in _EMPTY or src.op in _EMPTY:
            continue
        # a source view of dst may read storage written through another view by src
        if d_s is not None and _base(d_s) is _base(src):
            return True
        # moving dst forward may overwrite storage still read through a view by src
        s_s = _src(src, s)
        if s_s is not None and _base(dst) is _base(s_s):
            return True
    return _base(dst) is _base(src)


def _contiguous_1(t: Tensor) -> bool:
    """ggml_is_contiguous_1 (ggml_is_contiguous_m_n(t, 1, 4))."""
    block, size = type_size(t.type)
    if t.ne[0] != block and t.nb[0] != size:
        return False
    next_nb = size * (t.ne[0] // block)
    for i in range(1, 4):
        if i > 1:
            if t.ne[i] != 1 and t.nb[i] != next_nb:
                return False
            next_nb *= t.ne[i]
        else:
            next_nb = t.ne[i] * t.nb[i]
    return True


def _can_repeat(t0: Tensor, t1: Tensor) -> bool:
    if any(n == 0 for n in t0.ne):
        return any(n == 0 for n in t1.ne)
    return all(b % a == 0 for a, b in zip(t0.ne, t1.ne, strict=True))


def _can_fuse_unary_mul(unary: Tensor, mul: Tensor) -> bool:
    """ggml_vk_can_fuse_unary_mul (every UNARY fitter builds is one of GELU, SIGMOID, SILU, SOFTPLUS)."""
    if unary.type not in ("F32", "F16") or unary.type != mul.type:
        return False
    if _src(mul, 0) is not unary and _src(mul, 1) is not unary:
        return False
    other = _src(mul, 1) if _src(mul, 0) is unary else _src(mul, 0)
    first = _src(unary, 0)
    if other is None or first is None or other.type != unary.type:
        return False
    if not _contiguous_1(other) or not _contiguous_1(first):
        return False
    mul0 = _src(mul, 0)
    if mul0 is unary:
        return _can_repeat(other, unary)
    return mul0 is not None and _can_repeat(unary, mul0)


def reorder(nodes: Sequence[Tensor], use_count: Callable[[Tensor], int]
            ) -> tuple[list[Tensor], dict[Tensor, list[Tensor]]]:
    """ggml_vk_graph_optimize on one split: its nodes in the new order, and the allocation dependencies it asks for
    (a node → the tensors to keep alive until it has run). `use_count`: a node's uses in the whole graph
    (ggml_node_get_use_count)."""
    n = len(nodes)
    used = [False] * n
    used_set: set[Tensor] = set()
    new_order: list[Tensor] = []
    deps: dict[Tensor, list[Tensor]] = {}
    first_unused = 0

    def match(pattern: tuple[str, ...], start: int) -> bool:
        if start + len(pattern) > n:
            return False
        return all(nodes[start + j].op == op and not used[start + j] for j, op in enumerate(pattern))

    def keep(pattern: tuple[str, ...]) -> bool:
        nonlocal first_unused
        if not match(pattern, first_unused):
            return False
        for j in range(len(pattern)):
            new_order.append(nodes[first_unused + j])
            used_set.add(nodes[first_unused + j])
            used[first_unused + j] = True
        while first_unused < n and used[first_unused]:
            first_unused += 1
        return True

    def keep_topk_moe(pattern: tuple[str, ...]) -> bool:
        if not match(pattern, first_unused):
            return False
        last = first_unused + len(pattern) - 1
        if last + 1 < n and nodes[last + 1].op == "SCALE":  # some variants fuse a trailing scale
            last += 1
        seen: set[Tensor] = set()  # keep the run's external inputs alive through its fused output
        for j in range(len(pattern)):
            node = nodes[first_unused + j]
            for s in node.src:
                if s is not None and s not in seen:
                    seen.add(s)
                    kept = deps.setdefault(nodes[last], [])
                    if not any(k is s for k in kept):
                        kept.append(s)
            seen.add(node)
        return keep(pattern)

    def can_pull_set_rows(idxs: tuple[int, int, int]) -> bool:
        """ggml_can_fuse_subgraph_ext(graph, idxs, 3, ops, &set_rows_idx, 1) with the ops the nodes have."""
        members = [nodes[i] for i in idxs]
        for i, node in enumerate(members):
            if node.op == "NONE":  # not computed (GGML_TENSOR_FLAG_COMPUTE)
                return False
            if i == 2:  # the output
                continue
            if node.is_output:
                return False
            uses = sum(1 for other in members[i + 1:] for s in other.src if s is node)
            if uses != use_count(node):
                return False
            root = node.view_src
            if root is not None and not any(m is root for m in members) and not root.is_weight:
                return False
        return True

    while first_unused < n:
        if any(keep_topk_moe(p) for p in TOPK_MOE_PATTERNS) or any(keep(p) for p in KEPT_PATTERNS):
            continue
        current = [first_unused]
        for j in range(first_unused + 1, min(first_unused + NUM_TO_CHECK, n)):
            if used[j] or nodes[j].op in _EMPTY or any(match(p, j) for p in _ALL_PATTERNS):
                continue
            ok = True
            for c in range(first_unused, j):
                if used[c] or not _is_src_of(nodes[j], nodes[c]):
                    continue
                back = c == current[-1]
                between = all(used[v] or nodes[v].op in _EMPTY for v in range(c + 1, j))
                pair = (nodes[c].op, nodes[j].op)
                if back and between and pair in (("RMS_NORM", "MUL"), ("UNARY", "MUL")):
                    continue
                if back and j == c + 1 and pair in _ADJACENT_FUSIONS:
                    continue
                ok = False
                break
            if not ok:
                continue
            current.append(j)
            rope_idx = j
            if nodes[j].op == "MUL" and nodes[j - 1].op == "RMS_NORM":  # RMS_NORM + MUL: a ROPE that uses it
                for k in range(j + 1, min(j + 15, n)):
                    node = nodes[k]
                    s1, s2 = _src(node, 1), _src(node, 2)
                    if (node.op == "ROPE" and _src(node, 0) is nodes[j] and s1 is not None and s1.op == "NONE"
                            and (s2 is None or s2.op == "NONE")):
                        rope_idx = k
                        current.append(k)
                        used[k] = True
                        break
            if nodes[rope_idx].op in ("ROPE", "RMS_NORM"):  # ROPE/RMS_NORM + VIEW + SET_ROWS made consecutive
                view_idx = set_rows_idx = -1
                for k in range(rope_idx + 1, min(rope_idx + 15, n)):
                    if used[k]:
                        continue
                    node = nodes[k]
                    if view_idx == -1 and node.op == "VIEW" and _src(node, 0) is nodes[rope_idx]:
                        view_idx = k
                        continue
                    if view_idx != -1 and node.op == "SET_ROWS" and _src(node, 0) is nodes[view_idx]:
                        set_rows_idx = k
                        break
                if set_rows_idx != -1:
                    can_pull = can_pull_set_rows((rope_idx, view_idx, set_rows_idx))
                    for c in range(rope_idx + 1, set_rows_idx):
                        if not can_pull:
                            break
                        if (not used[c] and c != view_idx and nodes[c].op not in _EMPTY
                                and _is_src_of(nodes[set_rows_idx], nodes[c])):
                            can_pull = False
                    if can_pull:
                        current += [view_idx, set_rows_idx]
                        used[view_idx] = used[set_rows_idx] = True
            pulls = {("MUL_MAT_ID", "ADD_ID"): "MUL", ("MUL_MAT", "ADD"): "ADD"}
            follower = pulls.get((nodes[j - 1].op, nodes[j].op))
            if follower is not None:  # MUL_MAT_ID + ADD_ID + MUL, MUL_MAT + ADD + ADD
                for k in range(j + 1, min(j + 15, n)):
                    node = nodes[k]
                    s1 = _src(node, 1)
                    if (node.op == follower and _src(node, 0) is nodes[j] and s1 is not None
                            and (s1.op == "NONE" or s1 in used_set)):
                        current.append(k)
                        used[k] = True
                        break
            if nodes[j].op == "UNARY":  # UNARY + MUL: the consuming MUL pulled forward
                for k in range(j + 1, min(j + 15, n)):
                    mul = nodes[k]
                    if mul.op != "MUL" or (_src(mul, 0) is not nodes[j] and _src(mul, 1) is not nodes[j]):
                        continue
                    other = _src(mul, 1) if _src(mul, 0) is nodes[j] else _src(mul, 0)
                    if other is None or not (other.op == "NONE" or other in used_set):
                        continue
                    if not _can_fuse_unary_mul(nodes[j], mul):
                        continue
                    current.append(k)
                    used[k] = True
                    break
        if nodes[current[-1]].op != "ADD":  # the views, unless that splits an add from what it feeds
            for j in range(first_unused + 1, min(first_unused + NUM_TO_CHECK, n)):
                if used[j] or nodes[j].op not in _EMPTY:
                    continue
                if all(used[c] or not _is_src_of(nodes[j], nodes[c]) or c in current
                       for c in range(first_unused, j)):
                    current.append(j)
        for c in current:
            new_order.append(nodes[c])
            used_set.add(nodes[c])
            used[c] = True
        while first_unused < n and used[first_unused]:
            first_unused += 1
    return new_order, deps
