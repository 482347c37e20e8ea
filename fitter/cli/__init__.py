"""fitter's command line: argparse and each command's I/O edge (`fitter.cli.app.main`)."""

from __future__ import annotations

from fitter.cli.app import main

__all__ = ["main"]
