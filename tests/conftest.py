"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _fitter_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep every test's cache (generated models, results) out of the user's ~/.cache/fitter."""
    home = tmp_path / "home"
    monkeypatch.setenv("FITTER_HOME", str(home))
    return home
