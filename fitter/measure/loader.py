"""Load a model through llama-cpp-python with a LaunchConfig and capture everything llama.cpp logs.

The edge to the real llama.cpp: no fitter estimates here, only the translation of llama-server's flags into
the C API (`llama_model_params`, `llama_context_params`) the way llama-server's `common_model_params_to_llama`
and `common_context_params_to_llama` do it (common/common.cpp, llama.cpp 0c1e570), then a load, a context, and
the freeing of both.

Every load runs in a child process (`python -m fitter.measure.loader`), so an abort inside llama.cpp
(GGML_ABORT, an unreachable RPC server) cannot kill the caller and no llama.cpp log or backend state leaks
into it. The child streams the log to a file as it arrives, so the log survives a crash.

The translation of the flags is fitter.measure.capi's.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitter import process
from fitter.flags import LaunchConfig
from fitter.machine.llama_cpp import lib_dir_of
from fitter.measure.capi import (
    Ggml,
    LogSink,
    build_context_params,
    build_model_params,
    build_mtmd_params,
    config_from_json,
    config_to_json,
)
from fitter.measure.logs import abort_lines, parse_buffer_lines
from fitter.measure.types import LoggedBuffer

__all__ = ["CaptureResult", "llama_cpp_info", "load_and_capture"]
_TAIL = 4000  # characters of a crashed child's stderr/log kept in the error


@dataclass(frozen=True)
class CaptureResult:
    ok: bool
    log: str  # everything llama.cpp (and ggml) logged, pieces joined
    buffers: list[LoggedBuffer]
    error: str | None
    llama_cpp_version: str | None = None
    system_info: str | None = None  # llama_print_system_info()
    supports_rpc: bool | None = None
    returncode: int | None = None  # the child's exit status (negative: killed by that signal)
    seconds: float = 0.0  # load + context creation inside the child


def load_and_capture(
    model_path: str | Path,
    config: LaunchConfig,
    *,
    timeout: float = 600.0,
    n_outputs_max: int | None = None,
) -> CaptureResult:
    """Load `model_path` (the first shard of a split model) and build a context as `config` says, in a child.

    `n_outputs_max` None follows the config's program (`config.consumer`); 0 gives the C API default (n_batch).
    Never raises for llama.cpp failures: they come back as ok=False with the error and the log so far.
    """
    request = {
        "model": str(model_path),
        "config": config_to_json(config),
        "n_outputs_max": n_outputs_max,
    }
    return _run_child("load", request, timeout)


def llama_cpp_info(timeout: float = 120.0) -> dict[str, Any]:
    """The installed llama-cpp-python's version, system info and RPC support, read in a child process."""
    res = _run_child("info", {}, timeout)
    if not res.ok:
        raise RuntimeError(f"could not read llama-cpp-python's build info: {res.error}")
    return {"version": res.llama_cpp_version, "system_info": res.system_info, "supports_rpc": res.supports_rpc}


def _run_child(mode: str, request: dict[str, Any], timeout: float) -> CaptureResult:
    with tempfile.TemporaryDirectory(prefix="fitter-llama-") as tmp:
        d = Path(tmp)
        req, res, log = d / "request.json", d / "result.json", d / "llama.log"
        req.write_text(json.dumps({"mode": mode, **request}))
        cmd = process.python_module("fitter.measure.loader", str(req), str(res), str(log))
        rc: int | None
        try:
            rc, _, stderr = process.run(cmd, timeout, env=process.child_env())
        except subprocess.TimeoutExpired as e:
            rc, stderr = None, str(e.stderr or "")
        log_text = log.read_text(errors="replace") if log.exists() else ""
        buffers = parse_buffer_lines(log_text)
        if res.exists():
            out = json.loads(res.read_text())
            return CaptureResult(
                ok=bool(out["ok"]),
                log=log_text,
                buffers=buffers,
                error=out.get("error"),
                llama_cpp_version=out.get("version"),
                system_info=out.get("system_info"),
                supports_rpc=out.get("supports_rpc"),
                returncode=rc,
                seconds=float(out.get("seconds", 0.0)),
            )
        if rc is None:
            why = f"llama.cpp child timed out after {timeout:g} s"
        elif rc < 0:
            why = f"llama.cpp child was killed by signal {-rc} (an abort inside llama.cpp)"
        else:
            why = f"llama.cpp child exited with status {rc} without a result"
        aborts = abort_lines(stderr)
        tail = "\n".join(aborts) if aborts else (stderr.strip() or log_text.strip())[-_TAIL:]
        return CaptureResult(ok=False, log=log_text, buffers=buffers, error=f"{why}: {tail}" if tail else why,
                             returncode=rc)


def _child_load(request: dict[str, Any], log_path: Path) -> dict[str, Any]:
    import llama_cpp

    out: dict[str, Any] = {
        "ok": False,
        "error": None,
        "version": getattr(llama_cpp, "__version__", None),
        "system_info": None,
        "supports_rpc": None,
        "seconds": 0.0,
    }
    llama_cpp.llama_backend_init()
    out["system_info"] = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    out["supports_rpc"] = bool(llama_cpp.llama_supports_rpc())
    if request["mode"] == "info":
        out["ok"] = True
        return out

    config = config_from_json(request["config"])
    sink = LogSink(log_path)
    old_cb, old_ud = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(old_cb), ctypes.byref(old_ud))
    llama_cpp.llama_log_set(sink.callback, ctypes.c_void_p(0))
    model = ctx = None
    t0 = time.perf_counter()
    try:
        ggml = Ggml(lib_dir_of(Path(llama_cpp.__file__).parent))
        if config.rpc:
            ggml.add_rpc_servers(config.rpc)
        keep_alive: list[Any] = []
        mparams = build_model_params(config, ggml, keep_alive)

        model = llama_cpp.llama_model_load_from_file(str(request["model"]).encode(), mparams)
        if not model:
            out["error"] = "llama_model_load_from_file failed: " + (sink.error_text() or "see the log")
            return out

        cparams = build_context_params(config, request.get("n_outputs_max"))
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            out["error"] = "llama_init_from_model failed: " + (sink.error_text() or "see the log")
            return out
        if config.mmproj:  # the projector, last, as llama-server loads it
            from llama_cpp import mtmd_cpp

            mtmd_cpp.mtmd_log_set(sink.callback, ctypes.c_void_p(0))  # clip's lines into the same log
            mctx = mtmd_cpp.mtmd_init_from_file(config.mmproj.encode(), model, build_mtmd_params(config, ggml))
            if not mctx:
                out["error"] = "mtmd_init_from_file failed: " + (sink.error_text() or "see the log")
                return out
            mtmd_cpp.mtmd_free(mctx)
        out["ok"] = True
        return out
    except Exception as e:  # a Python-side failure (bad buffer type name, …): report, don't crash
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        out["seconds"] = round(time.perf_counter() - t0, 3)
        if ctx:
            llama_cpp.llama_free(ctx)
        if model:
            llama_cpp.llama_model_free(model)
        llama_cpp.llama_log_set(old_cb, old_ud)
        sink.close()
        llama_cpp.llama_backend_free()


def _main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m fitter.measure.loader REQUEST.json RESULT.json LOG.txt", file=sys.stderr)
        return 2
    req_path, res_path, log_path = (Path(a) for a in argv)
    request = json.loads(req_path.read_text())
    result = _child_load(request, log_path)
    tmp = res_path.with_suffix(".part")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, res_path)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
