"""The package's plan holds: packages by concept, imports only downward, no import cycle, small modules."""

from __future__ import annotations

import ast
from pathlib import Path

import fitter

ROOT = Path(fitter.__file__).resolve().parent
# Lower imports nothing higher: the flow of the README's Layout section, leaves first.
LAYERS = ("errors", "paths", "units", "noise", "process", "ports", "gguf", "flags", "workload", "memory", "machine",
          "measure", "sim", "search", "storage", "results", "tune", "check", "grid", "export", "serve", "report", "cli")
MAX_LINES = 520


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, top_level_only: bool, modules: dict[str, Path]) -> set[str]:
    """The fitter modules `path` imports: `from pkg import sub` is an import of pkg.sub, not of pkg's __init__."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name in modules}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else -1  # `fitter` itself: a leaf


def test_every_module_belongs_to_a_package_of_the_plan() -> None:
    strays = [m for m in _modules() if m != "fitter" and m.split(".")[1] not in LAYERS]
    assert strays == []


def test_imports_only_go_down_the_layers() -> None:
    modules = _modules()
    upward = []
    for module, path in modules.items():
        for target in _imports(path, False, modules):
            if _layer(target) > _layer(module):
                upward.append(f"{module} imports {target}")
    assert upward == []


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {m: {t for t in _imports(p, True, modules) if t != m} for m, p in modules.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_module_is_much_over_500_lines() -> None:
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_only_the_storage_adapter_reaches_optunas_private_api() -> None:
    # Study._storage, Study._study_id, Trial._trial_id: fitter.storage.studies's adapter holds every use
    private = {"_storage", "_study_id", "_trial_id"}
    users = {m for m, p in _modules().items() if m != "fitter.storage.optuna_api"
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in private}
    assert users == set()


# Names that say one thing: a module name or a public top-level name means one thing in the package. cli/ names its
# modules after the commands (cli/fit.py is `fitter fit`), and each command module has its `register`.
CONVENTIONS = {"register", "main"}


def test_no_two_modules_share_a_name_outside_the_cli() -> None:
    by_name: dict[str, list[str]] = {}
    for module, path in _modules().items():
        if path.name != "__init__.py" and not module.startswith("fitter.cli."):
            by_name.setdefault(path.stem, []).append(module)
    assert {name: found for name, found in by_name.items() if len(found) > 1} == {}


def test_no_public_name_is_defined_twice() -> None:
    where: dict[str, list[str]] = {}
    for module, path in _modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(module)
    assert {name: found for name, found in where.items() if len(found) > 1 and name not in CONVENTIONS} == {}


def _room(module: str) -> str:
    """A module's room: its package under fitter (a subpackage of measure is a room of its own), or the leaf itself."""
    parts = module.split(".")
    if len(parts) > 3 or (len(parts) == 3 and (ROOT / parts[1] / parts[2]).is_dir()):
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else "fitter"


def test_no_import_circle_between_rooms() -> None:
    # every import counts, a function's too: measure's rooms (its runners, the emulator, llama.cpp's builds) and the
    # packages above them form no circle, so each can be read knowing only the rooms below it
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        for target in _imports(path, False, modules):
            if _room(target) != _room(module):
                graph.setdefault(_room(module), set()).add(_room(target))

    def below(start: str) -> set[str]:  # every room `start` reaches
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if a in below(b)) == []
