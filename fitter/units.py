"""Byte units, as llama.cpp prints them (MiB = 2**20 bytes)."""

from __future__ import annotations

MIB = 1024 * 1024
GIB = 1024 * MIB
