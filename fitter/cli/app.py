"""fitter's command line: thin commands over the library; FitterError → one line on stderr and exit code 2.

Imports stay light (no optuna, pandas or llama_cpp when the parser is built): `fitter estimate` must finish in well
under a second. Each command module registers its own subparser; the llama.cpp flags it takes are the ones
fitter.flags registered (fitter.flags.parse.add_launch_arguments), parsed with the rest and read from the namespace
(fitter.cli.common.launch_args), which also records which of them were given.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from fitter import __version__
from fitter.errors import FitterError
from fitter.flags.vocabulary import speculative_flag, unmodelled_speculation

# The modules that register the commands, and the commands each registers: a command line naming one of them builds
# only that module's parsers, so `fitter estimate` does not import what `fitter tune` needs.
COMMANDS = {"estimate": ("estimate",), "fit": ("fit",), "bench": ("bench",), "tune": ("tune",), "grid": ("grid",),
            "results": ("export", "report"), "check": ("check",), "serve": ("serve",), "quality": ("quality",),
            "misc": ("machines", "demo-model", "probe")}
PASS_THROUGH = ("serve",)  # commands that pass the flags after `--` to the program they start (their ns.extra)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other bad input
        print(f"fitter: error: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every command's parser; only the named command's when `argv` starts with a command."""
    parser = _Parser(prog="fitter", description="Find the fastest llama.cpp launch settings a machine can hold.")
    parser.add_argument("--version", action="version", version=f"fitter {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    named = [m for m, commands in COMMANDS.items() if argv and argv[0] in commands]
    for module in named or COMMANDS:
        importlib.import_module(f"fitter.cli.{module}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    draft = next((t for t in argv[1:] if speculative_flag(t)), None)
    if draft is not None:
        print(f"fitter: error: {unmodelled_speculation(draft)}", file=sys.stderr)
        return 2
    parser = build_parser(argv)
    extra: list[str] | None = None
    if argv and argv[0] in PASS_THROUGH and "--" in argv:  # what follows `--` is the program's, not fitter's
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    try:
        ns = parser.parse_args(argv)  # a rule flag's value is read as it is parsed (-ncmoe x: one line, exit 2)
        if extra is not None:
            ns.extra = extra
        result: int = ns.func(ns)
        return result
    except FitterError as e:
        print(f"fitter: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
