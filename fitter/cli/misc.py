"""`fitter machines`, `fitter demo-model` and `fitter probe`: the simulated machines, the demo model and test shapes,
and what this machine offers llama.cpp."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fitter.errors import FitterError


def cmd_machines(ns: argparse.Namespace) -> int:
    from fitter.sim import machines_table

    print(machines_table())
    return 0


def cmd_demo_model(ns: argparse.Namespace) -> int:
    from fitter.gguf.demo_models import SHAPES, demo_model_path, write_model

    if ns.shape not in SHAPES:
        raise FitterError(f"demo-model --shape {ns.shape!r}: unknown shape; known: {', '.join(sorted(SHAPES))}")
    if ns.shape == "demo":
        path = demo_model_path(Path(ns.out) if ns.out else None)
        print(path)
        return 0
    if not ns.out:
        raise FitterError(f"demo-model --shape {ns.shape}: give --out PATH for shapes other than the demo")
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    for p in write_model(SHAPES[ns.shape], Path(ns.out), sparse=ns.sparse, n_shards=ns.shards):
        print(p)
    return 0


def cmd_probe(ns: argparse.Namespace) -> int:
    from fitter.machine.probe import probe, probe_json, probe_table

    result = probe()
    print(json.dumps(probe_json(result), indent=1) if ns.json else probe_table(result))
    return 0


def register(sub: Any) -> None:
    machines = sub.add_parser("machines", help="the shipped simulated machines (--backend sim --machine NAME)",
                              description="The simulated machines fitter ships (fitter/sim/machines/*.toml): "
                              "physical parameters only; `--backend sim --machine NAME|FILE` runs bench and tune on "
                              "them.")
    machines.set_defaults(func=cmd_machines)

    demo = sub.add_parser("demo-model", help="write the demo model (or a test shape) and print its path")
    demo.add_argument("--out", help="where to write it (default: fitter's cache)")
    demo.add_argument("--shape", default="demo", help="demo (default) or a test shape, e.g. gpt-oss-120b")
    demo.add_argument("--sparse", action="store_true", help="header only; the data region is a hole")
    demo.add_argument("--shards", type=int, default=1)
    demo.set_defaults(func=cmd_demo_model)

    probe = sub.add_parser("probe", help="report this machine's GPUs, CPU, RAM and llama.cpp build",
                           description="Report what this machine offers llama.cpp: NVIDIA GPUs (NVML), CPU topology "
                           "and ISA, RAM, and the installed llama-cpp-python build.")
    probe.add_argument("--json", action="store_true", help="machine-readable output (shape: fitter/machine/probe.py)")
    probe.set_defaults(func=cmd_probe)
