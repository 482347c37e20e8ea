"""fitter's command line: thin commands over the library; FitterError → one line on stderr and exit code 2.

Imports stay light (no optuna, pandas or llama_cpp when the parser is built): `fitter estimate` must finish in well
under a second. Each command module registers its own subparser; the llama.cpp flags a command passes on are the
ones fitter.flags registered, and every other option a command registered is fitter's own (`own_options`).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from fitter import __version__
from fitter.cli import bench, check, estimate, fit, grid, misc, results, tune
from fitter.cli.common import llama_flags, own_options
from fitter.errors import FitterError
from fitter.flags.vocabulary import launch_flags

COMMANDS = (estimate, fit, bench, tune, grid, results, check, misc)
_LAUNCH = {name for f in launch_flags() for name in f.names}  # passed on; everything else a command takes is its own


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other bad input
        print(f"fitter: error: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fitter", description="Find the fastest llama.cpp launch settings a machine can hold.")
    parser.add_argument("--version", action="version", version=f"fitter {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    command = next(p for name, p in _subparsers(parser).items() if name == ns.command)
    flags = llama_flags(argv, getattr(ns, "model", None), own_options(command, _LAUNCH))
    try:
        result: int = ns.func(ns, flags)
        return result
    except FitterError as e:
        print(f"fitter: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}
