"""fitter never hands a command line to a shell: every child gets an argv list, so a model path or flag is one
argument whatever it contains. Checked on the package's source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import fitter

ROOT = Path(fitter.__file__).resolve().parent
# calls that run their argument through /bin/sh (subprocess.getoutput and friends pass shell=True themselves)
SHELL_CALLS = {("os", "system"), ("os", "popen"), ("subprocess", "getoutput"), ("subprocess", "getstatusoutput"),
               ("asyncio", "create_subprocess_shell"), ("pty", "spawn")}


def shell_uses(source: str, filename: str) -> list[str]:
    """`file:line: what` for each shell=<anything but False>, each call of SHELL_CALLS (by `module.name` or a name
    imported from the module) and each import of one of them."""
    found = []
    imported: set[str] = set()
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if (node.module, alias.name) in SHELL_CALLS:
                    imported.add(alias.asname or alias.name)
                    found.append(f"{filename}:{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"{filename}:{node.lineno}: shell={ast.unparse(kw.value)}")
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in SHELL_CALLS:
            found.append(f"{filename}:{node.lineno}: {f.value.id}.{f.attr}()")
        elif isinstance(f, ast.Name) and f.id in imported:
            found.append(f"{filename}:{node.lineno}: {f.id}()")
    return found


def test_the_checker_finds_each_way_to_a_shell() -> None:
    source = """
import os, subprocess
from os import popen as p
subprocess.run("ls", shell=True)
subprocess.Popen(["ls"], shell=flag)
subprocess.run(["ls"], shell=False)
os.system("ls")
p("ls")
subprocess.getoutput("ls")
"""
    assert shell_uses(source, "x.py") == [
        "x.py:3: from os import popen", "x.py:4: shell=True", "x.py:5: shell=flag", "x.py:7: os.system()",
        "x.py:8: p()", "x.py:9: subprocess.getoutput()"]


def test_no_shell_anywhere_in_the_package() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        found += shell_uses(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT.parent)))
    assert found == []
