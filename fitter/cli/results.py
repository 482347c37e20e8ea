"""`fitter export` and `fitter report`: a tuning result for a launcher, and as tables and figures."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fitter.cli.common import log, warn
from fitter.errors import FitterError
from fitter.export.launchers import FORMATS
from fitter.flags.consumers import CONSUMER_NAMES
from fitter.results.pareto import POLICIES
from fitter.units import MIB


def cmd_export(ns: argparse.Namespace) -> int:
    """The pick for a launcher. A format read by another program than the one the result was tuned for (or
    `--for`) is re-planned for it first: what changed goes with the export, and a plan over the recorded budget is
    refused with the excess unless --force."""
    from fitter.export.launchers import pick, render
    from fitter.export.replan import FORMAT_CONSUMER, replan
    from fitter.results.pareto import load_result

    doc = load_result(ns.result)
    target = ns.consumer or FORMAT_CONSUMER.get(ns.format, doc.consumer)
    if ns.format == "launcher" and target != "llama-server":
        raise FitterError(f"--format launcher --for {target}: the launcher runs llama-server; drop --for")
    if ns.consumer and ns.format in FORMAT_CONSUMER and FORMAT_CONSUMER[ns.format] != ns.consumer:
        fits = [f for f in FORMATS if FORMAT_CONSUMER.get(f, ns.consumer) == ns.consumer]
        raise FitterError(f"--for {ns.consumer} --format {ns.format}: that format is read by "
                          f"{FORMAT_CONSUMER[ns.format]}; for {ns.consumer} choose --format {' or '.join(fits)}, "
                          "or drop --for")
    if ns.format == "launcher":  # the choice `fitter serve` makes, as a script (fitter.export.launcher_script)
        from fitter.export.launcher_script import render_launcher

        print(render_launcher(doc, ns.policy, _result_model(doc, ns.model)), end="")
        return 0
    note = None
    if target != doc.consumer:
        p = pick(doc, ns.policy)
        spec = _result_model(doc, ns.model)
        from fitter.gguf.model_spec import with_draft
        from fitter.gguf.projector import with_projector

        if p.config.draft_model:  # the draft's memory is the pick's too (fitter.gguf.model_spec.with_draft)
            spec = with_draft(spec, p.config.draft_model)
        if p.config.mmproj:  # and the projector's
            spec = with_projector(spec, p.config.mmproj)
        plan = replan(doc, p.entry, p.config, target, spec)
        note = plan.note()
        log(f"fitter: export: {note}")
        if not plan.fits:
            excess = ", ".join(f"{name} by {over / MIB:.2f} MiB" for name, over in plan.over.items())
            message = (f"{doc.source}: the {ns.policy} pick (trial {p.trial}) run by {target} is over the budget it "
                       f"was tuned under: {excess}")
            if not ns.force:
                raise FitterError(f"{message}; tune with --for {target}, or --force to print it anyway")
            warn(message)
    print(render(doc, ns.policy, ns.format, note), end="")
    return 0


def _result_model(doc: Any, override: str | None) -> Any:
    """The tuned model's spec (its header only), at the recorded path or --model; the identity must match."""
    from fitter.gguf.model_spec import load_model_spec

    path = override or doc.model.get("path")
    if not path:
        raise FitterError(f"{doc.source}: no model.path; re-planning for another program needs the model's "
                          "header: give --model PATH")
    try:
        spec = load_model_spec(str(path))
    except FitterError as e:  # the path came from the result: name it too
        raise FitterError(f"{e}; re-planning for another program needs the header of the model {doc.source} was "
                          "tuned on: give --model PATH") from None
    recorded = doc.model.get("identity")
    if recorded and spec.identity != recorded:
        raise FitterError(f"{path}: not the tuned model (header identity {spec.identity}, {doc.source} records "
                          f"{recorded})")
    return spec


def cmd_report(ns: argparse.Namespace) -> int:
    """`fitter report RESULT [--out DIR] [--json]`."""
    import optuna

    from fitter.report import dashboard_command, load_study_result, write_report
    from fitter.report.tables import pareto_text, trials_text

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # fitter says what it skipped itself
    result = load_study_result(Path(ns.result))
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
    export.add_argument("--format", default="server", choices=(*FORMATS, "launcher"),
                        help="server, preset-ini and llama-swap are read by llama-server, python by llama-cpp-python; "
                        "launcher: a sh script that runs the first config that fits the GPUs' free memory at start")
    export.add_argument("--for", dest="consumer", choices=CONSUMER_NAMES, default=None, metavar="PROGRAM",
                        help="the program that will run it (default: the format's; json: the one it was tuned for); "
                        "another program than the tuned one re-plans the config and says what changed")
    export.add_argument("--model", metavar="PATH", help="the tuned GGUF at another path, for a re-plan")
    export.add_argument("--force", action="store_true",
                        help="print a re-planned config even when it is over the budget it was tuned under")
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
