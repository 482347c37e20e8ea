"""`python -m fitter.cli …`: the `fitter` command."""

from __future__ import annotations

from fitter.cli.app import main

raise SystemExit(main())
