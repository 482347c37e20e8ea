"""The user's prompts (`--prompts FILE`, or `prompts = "FILE"` in a workload): the text decode is measured on.

Speculative decoding's speed depends on how many drafted tokens the model accepts, i.e. on the text: synthetic
tokens say nothing about it, so a speculation is measured only on prompts the user gives. A file is either JSON
lines (`.jsonl`: each line a JSON string or an object with a "prompt" string) or plain text, one prompt per
paragraph (prompts separated by blank lines). What a result records is the file, the count and the SHA-256 of its
bytes, so a check re-reads the same prompts or says they changed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fitter.errors import FitterError


class PromptsError(FitterError):
    """A prompts file that cannot be read as prompts."""


@dataclass(frozen=True)
class Prompts:
    file: str
    sha256: str
    texts: tuple[str, ...] = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "count": len(self.texts), "sha256": self.sha256}

    @staticmethod
    def from_json(data: Any, where: str) -> Prompts:
        """The prompts a result records, read again from their file; a file whose bytes changed is refused."""
        if not isinstance(data, dict) or not isinstance(data.get("file"), str):
            raise PromptsError(f"{where}: \"prompts\" must be a table with a \"file\", got {data!r}")
        prompts = read_prompts(data["file"])
        if data.get("sha256") not in (None, prompts.sha256):
            raise PromptsError(f"{data['file']}: not the prompts the result was measured with (SHA-256 "
                               f"{prompts.sha256}, recorded {data['sha256']}); a check decodes the same text")
        return prompts


def read_prompts(path: str) -> Prompts:
    """The prompts in `path` (JSON lines or blank-line-separated text), at least one, none empty."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise PromptsError(f"--prompts {path}: no such file") from None
    except OSError as e:
        raise PromptsError(f"--prompts {path}: cannot read it: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptsError(f"{path}: not UTF-8 text (byte {e.start}); prompts are text") from None
    texts = _json_lines(text, path) if path.endswith(".jsonl") else _paragraphs(text)
    if not texts:
        raise PromptsError(f"{path}: no prompts (JSON lines, or text with one prompt per paragraph)")
    # recorded absolute, as the model's path is: a check run from another folder reads the same file
    return Prompts(str(Path(path).resolve()), hashlib.sha256(raw).hexdigest(), tuple(texts))


def _json_lines(text: str, path: str) -> list[str]:
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptsError(f"{path}:{i}: not JSON: {e.msg}") from None
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptsError(f"{path}:{i}: expected a JSON string or {{\"prompt\": \"...\"}} with text, got "
                               f"{line.strip()[:60]!r}")
        out.append(prompt)
    return out


def _paragraphs(text: str) -> list[str]:
    out, current = [], []
    for line in text.splitlines():
        if line.strip():
            current.append(line)
        elif current:
            out.append("\n".join(current))
            current = []
    if current:
        out.append("\n".join(current))
    return out
