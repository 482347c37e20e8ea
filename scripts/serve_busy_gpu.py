"""Figure for docs/serve.md: `fitter serve` of examples/demo-result (tuned on a 96 MiB emulated GPU, fit target
16 MiB) on a 96 MiB emulated GPU while a second process holds part of it (EmulatedGpu.hold): what it served, whether
llama-server loaded and answered, the bytes llama.cpp allocated on the GPU against the plan, and its status after
SIGINT. Run from the repository root: python scripts/serve_busy_gpu.py [HELD_MIB ...]"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from fitter import ports
from fitter.measure.emulator.emulated_gpu import EmulatedGpu
from fitter.measure.llamacpp.tools import built_tools

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(port: int, path: str, body: dict[str, object] | None = None) -> dict[str, object]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode() if body else None,
                                 {"Content-Type": "application/json"})
    with OPENER.open(req, timeout=60) as resp:
        out: dict[str, object] = json.loads(resp.read())
        return out


def one(held_mib: int, tools: Path, log: Path) -> str:
    port = ports.pick_free_port("figure")
    with EmulatedGpu(96, beside=tools / "llama-server") as gpu:
        gpu.hold(held_mib * 2**20)
        with log.open("w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "fitter.cli", "serve", "examples/demo-result", "--llama-cpp",
                                     str(tools), "--rpc", gpu.endpoint, "--min-ctx", "1024", "--", "--port",
                                     str(port)], stderr=f)
        healthy, tokens, used = False, 0, 0
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and not healthy:
            try:
                healthy = _get(port, "/health") == {"status": "ok"}
            except OSError:
                time.sleep(0.2)
        if healthy:
            used = gpu.stats().used_bytes
            tokens = int(_get(port, "/completion", {"prompt": "Hello", "n_predict": 8})["tokens_predicted"])  # type: ignore[call-overload]
            proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    text = log.read_text()
    reason = next((line for line in text.splitlines() if line.startswith(("fitter: serve: b", "fitter: error"))), "")
    served = re.search(r"serving (.*?)(?: \(\d|:? it$|$)", reason)
    what = "nothing (refused)" if not healthy else (served.group(1) if served else "?")
    return (f"| {held_mib} | {96 - held_mib} | {what} | {'yes' if healthy else 'no'} | {used} | {tokens} | {rc} |\n"
            f"  {reason}")


def main(argv: list[str]) -> int:
    tools = built_tools()
    if tools is None:
        print("build fitter's pinned llama.cpp first: python -m fitter.measure.llamacpp.tools", file=sys.stderr)
        return 2
    print("| held MiB | free MiB | served | loaded | bytes on the GPU | tokens | exit |")
    with tempfile.TemporaryDirectory() as tmp:
        for held in [int(x) for x in argv] or [0, 20, 50, 60]:
            print(one(held, tools, Path(tmp) / f"serve-{held}.log"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
