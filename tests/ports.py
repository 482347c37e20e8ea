"""A port taken between fitter's pick and its server's bind, as another program would take it."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from fitter import ports

# how the other program holds the port: bound only (a bind without SO_REUSEADDR still refuses others), listening, or
# listening with SO_REUSEPORT (a server that sets it too, as llama-server does with --reuse-port, binds beside it)
OCCUPANTS = ("bound", "listening", "shared")


@contextlib.contextmanager
def first_pick_taken(monkeypatch: pytest.MonkeyPatch, how: str) -> Iterator[list[int]]:
    """Every port fitter picks, in order; the first is taken by this process right after the pick."""
    picks: list[int] = []
    held: list[socket.socket] = []
    real = ports.pick_free_port

    def pick(what: str, tries: int = 20) -> int:
        port = real(what, tries)
        picks.append(port)
        if len(picks) == 1:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            if how == "shared":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((ports.HOST, port))
            if how != "bound":
                s.listen()
        return port

    monkeypatch.setattr(ports, "pick_free_port", pick)
    try:
        yield picks
    finally:
        for s in held:
            s.close()
