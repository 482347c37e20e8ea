"""`fitter export` and `fitter report`: a tuning result for a launcher, and as tables and figures."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fitter.export.launchers import FORMATS
from fitter.tune.result import POLICIES


def cmd_export(ns: argparse.Namespace, flags: list[str]) -> int:
    from fitter.export.launchers import render
    from fitter.tune.result import load_result

    print(render(load_result(ns.result), ns.policy, ns.format))
    return 0


def cmd_report(ns: argparse.Namespace, flags: list[str]) -> int:
    """`fitter report RESULT [--out DIR] [--json]`."""
    import optuna

    from fitter.report import dashboard_command, load_result, write_report
    from fitter.report.tables import pareto_text, trials_text

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # fitter says what it skipped itself
    result = load_result(Path(ns.result))
    out = Path(ns.out) if ns.out else result.folder / "report"
    report = write_report(result, out)
    dashboard = dashboard_command(result)
    for note in report.notes:
        print(f"fitter: warning: {note}", file=sys.stderr)
    if ns.json:
        print(json.dumps({**report.json(), "dashboard": dashboard}, indent=1))
        return 0
    print(trials_text(report.trials))
    print()
    print(pareto_text(report.front))
    print(f"\nreport: {out}")
    for p in report.files:
        print(f"  {p.name}")
    if dashboard:
        print(f"browse the study live: {dashboard}")
    return 0


def register(sub: Any) -> None:
    export = sub.add_parser("export", help="a tuned config for a launcher (llama-server, llama-swap, python, ...)",
                            description="Render the picked config of a tuning result (the folder with pareto.json) "
                            "for a launcher, pinning everything llama-server would otherwise decide itself.")
    export.add_argument("result", help="a results folder (or its pareto.json)")
    export.add_argument("--policy", default="balanced", choices=POLICIES)
    export.add_argument("--format", default="server", choices=FORMATS)
    export.set_defaults(func=cmd_export)

    report = sub.add_parser(
        "report", help="tables and figures of a tuning result, finished or still running",
        description="The trials table, the Pareto front with ratios over llama.cpp's own choice, and figures (PNG and "
        "an offline report.html): decode vs VRAM, optimisation history, parameter importances, predicted vs "
        "measured device memory. Reads the study without changing it.")
    report.add_argument("result", help="a results folder with study.db (or its pareto.json)")
    report.add_argument("--out", metavar="DIR",
                        help="where to write the CSVs, PNGs and report.html (default: RESULT/report)")
    report.add_argument("--json", action="store_true", help="the tables, warnings and file paths as JSON")
    report.set_defaults(func=cmd_report)
