"""Load a model through llama-cpp-python with a LaunchConfig and capture everything llama.cpp logs.

The edge to the real llama.cpp: no fitter estimates here, only the translation of llama-server's flags into
the C API (`llama_model_params`, `llama_context_params`) the way llama-server's `common_model_params_to_llama`
and `common_context_params_to_llama` do it (common/common.cpp, llama.cpp 0c1e570), then a load, a context, and
the freeing of both.

Every load runs in a child process (`python -m fitter.llama_cpp_loader`), so an abort inside llama.cpp
(GGML_ABORT, an unreachable RPC server) cannot kill the caller and no llama.cpp log or backend state leaks
into it. The child streams the log to a file as it arrives, so the log survives a crash.

Translation notes (where the C API and llama-server differ, llama-server wins):
- `-c 0` is passed as n_ctx 0: llama.cpp then uses the model's training context, as llama-server does.
- `--swa-full` is always set from the config: the C API defaults to true, llama-server to false.
- `-np`: n_seq_max = config.n_seq_max (auto = 4) and kv_unified = config.unified.
- n_outputs_max: llama-server sets it to min(n_batch, n_parallel × (1 + n_draft)) (tools/server/
  server-context.cpp `server_output_limits`), not the C API's n_batch; this sizes the logits in the compute
  buffer. Without speculative decoding that is min(-b, slots), with one output per sequence.
- `-lm/--load-mode` (`--no-mmap` is the older spelling of `-lm none`): mmap modes → load_mode AUTO (mmap unless a
  device cannot map), others → NONE.
- `-ngl auto` (-1) is passed as -1, which the C API reads as "all layers": `--fit` is not in libllama.
- `-ot`/`-cmoe`/`-ncmoe` rules are resolved by buffer type name over the ggml devices, as common/arg.cpp does.
- Threads: 1 for generation and batch (these machines have 2 cores; threads do not change memory).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitter.launch_config import LaunchConfig, TensorOverride
from fitter.llama_logs import LoggedBuffer, parse_buffer_lines

__all__ = ["CaptureResult", "llama_cpp_info", "load_and_capture"]

# llama.h enum llama_load_mode / enum llama_flash_attn_type
LOAD_MODE_AUTO = -1
LOAD_MODE_NONE = 0
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
_LOG_ERROR, _LOG_CONT = 4, 5  # ggml.h enum ggml_log_level (llama-cpp-python's _logger.py comment is stale)
_TAIL = 4000  # characters of a crashed child's stderr/log kept in the error
_ABORT_RE = re.compile(r"^\S+\.(?:c|cc|cpp|h):\d+: .+$", re.MULTILINE)


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


# ---------------------------------------------------------------------------------------------------------------
# Parent side


def load_and_capture(
    model_path: str | Path,
    config: LaunchConfig,
    *,
    timeout: float = 600.0,
    n_outputs_max: int | None = None,
) -> CaptureResult:
    """Load `model_path` (the first shard of a split model) and build a context as `config` says, in a child.

    `n_outputs_max` None follows llama-server (min(-b, slots)); 0 gives the C API default (n_batch).
    Never raises for llama.cpp failures: they come back as ok=False with the error and the log so far.
    """
    request = {
        "model": str(model_path),
        "config": _config_to_json(config),
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
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)  # so `-m fitter…` resolves from any directory
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("GGML_NO_BACKTRACE", "1")  # an abort would otherwise run gdb for a backtrace
        cmd = [sys.executable, "-m", "fitter.llama_cpp_loader", str(req), str(res), str(log)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace", timeout=timeout)
            rc: int | None = proc.returncode
            stderr = proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, stderr = None, _text(e.stderr)
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
        aborts = [m.group(0) for m in _ABORT_RE.finditer(stderr)]  # GGML_ABORT: "file.cpp:123: message"
        tail = "\n".join(aborts) if aborts else (stderr.strip() or log_text.strip())[-_TAIL:]
        return CaptureResult(ok=False, log=log_text, buffers=buffers, error=f"{why}: {tail}" if tail else why,
                             returncode=rc)


def _text(x: str | bytes | None) -> str:
    if x is None:
        return ""
    return x.decode(errors="replace") if isinstance(x, bytes) else x


def _config_to_json(config: LaunchConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _config_from_json(data: dict[str, Any]) -> LaunchConfig:
    data = dict(data)
    data["overrides"] = tuple(TensorOverride(o["pattern"], o["buft"]) for o in data.get("overrides", ()))
    for key in ("tensor_split", "rpc", "flags"):
        data[key] = tuple(data.get(key, ()))
    return LaunchConfig(**data)


# ---------------------------------------------------------------------------------------------------------------
# Child side: everything below runs only in `python -m fitter.llama_cpp_loader`.


class _Ggml:
    """ggml's device registry through the very copies libllama links against (the `.so.0` sonames).

    Loading `libggml-base.so` (a separate file with the same contents) would map a second ggml whose buffer
    type pointers never compare equal to libllama's.
    """

    def __init__(self, lib_dir: Path) -> None:
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so.0"))
        self.ggml = ctypes.CDLL(str(lib_dir / "libggml.so.0"))
        vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        self._sig(self.ggml, "ggml_backend_dev_count", [], sz)
        self._sig(self.ggml, "ggml_backend_dev_get", [sz], vp)
        self._sig(self.ggml, "ggml_backend_reg_by_name", [cp], vp)
        self._sig(self.ggml, "ggml_backend_register", [vp], None)
        self._sig(self.base, "ggml_backend_dev_buffer_type", [vp], vp)
        self._sig(self.base, "ggml_backend_dev_name", [vp], cp)
        self._sig(self.base, "ggml_backend_buft_name", [vp], cp)
        self._sig(self.base, "ggml_backend_cpu_buffer_type", [], vp)
        self._sig(self.base, "ggml_backend_reg_get_proc_address", [vp, cp], vp)

    def build(self) -> dict[str, str]:
        """The commit and version ggml was built from, as its own library reports them (ggml.c ggml_commit())."""
        out: dict[str, str] = {}
        for name in ("ggml_commit", "ggml_version"):
            fn = getattr(self.base, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = [], ctypes.c_char_p
                out[name] = (fn() or b"").decode(errors="replace")
        return out

    @staticmethod
    def _sig(lib: ctypes.CDLL, name: str, argtypes: list[Any], restype: Any) -> None:
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype

    def buffer_types(self) -> dict[str, int]:
        """Name → buffer type of every device's default buffer type (common/arg.cpp parse_tensor_buffer_overrides)."""
        out: dict[str, int] = {}
        for i in range(self.ggml.ggml_backend_dev_count()):
            dev = self.ggml.ggml_backend_dev_get(i)
            buft = self.base.ggml_backend_dev_buffer_type(dev)
            if buft:
                out[self.base.ggml_backend_buft_name(buft).decode()] = buft
        return out

    def cpu_buffer_type(self) -> int:
        return int(self.base.ggml_backend_cpu_buffer_type())

    def add_rpc_servers(self, servers: tuple[str, ...]) -> None:
        """common/arg.cpp add_rpc_devices. An unreachable server aborts this (child) process."""
        reg = self.ggml.ggml_backend_reg_by_name(b"RPC")
        if not reg:
            raise RuntimeError("--rpc: this llama.cpp build has no RPC backend (build with -DGGML_RPC=ON)")
        addr = self.base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
        if not addr:
            raise RuntimeError("--rpc: the RPC backend lacks ggml_backend_rpc_add_server")
        add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(addr)
        for server in servers:
            self.ggml.ggml_backend_register(add_server(server.encode()))


class _BuftOverride(ctypes.Structure):
    # include/llama.h struct llama_model_tensor_buft_override (not wrapped by llama-cpp-python)
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _ggml_type(name: str) -> int:
    from gguf.constants import GGMLQuantizationType  # same numbering as enum ggml_type

    return int(GGMLQuantizationType[name.upper()])


class _LogSink:
    """A llama_log_set callback that appends every piece (CONT pieces included) to a file as it arrives."""

    def __init__(self, path: Path) -> None:
        import llama_cpp

        self.file = path.open("a", encoding="utf-8", errors="replace")
        self.errors: list[str] = []  # GGML_LOG_LEVEL_ERROR pieces (and their CONT pieces)
        self._last_level = 0
        self.callback = llama_cpp.llama_log_callback(self._on_log)  # kept alive as long as the sink

    def _on_log(self, level: int, text: bytes | None, user_data: Any) -> None:
        if level != _LOG_CONT:
            self._last_level = level
        if text:
            piece = text.decode("utf-8", errors="replace")
            self.file.write(piece)
            self.file.flush()
            if self._last_level == _LOG_ERROR:
                self.errors.append(piece)

    def error_text(self) -> str:
        return " ".join(line.strip() for line in "".join(self.errors).splitlines() if line.strip())

    def close(self) -> None:
        self.file.close()



def build_model_params(config: LaunchConfig, ggml: _Ggml, keep_alive: list[Any]) -> Any:
    """`llama_model_params` for `config` as llama-server sets them (common_model_params_to_llama).

    The ctypes arrays the params point to (tensor split, override rules and their patterns) are appended to
    `keep_alive`, which must outlive the params. RPC servers must already be registered (`_Ggml.add_rpc_servers`).
    """
    import llama_cpp

    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = config.n_gpu_layers
    mparams.main_gpu = config.main_gpu
    mparams.load_mode = LOAD_MODE_AUTO if config.mmap else LOAD_MODE_NONE
    mparams.use_extra_bufts = not config.no_repack
    if config.tensor_split:
        n_max = int(llama_cpp.llama_max_devices())
        split = (ctypes.c_float * n_max)(*[float(x) for x in config.tensor_split[:n_max]])
        keep_alive.append(split)
        mparams.tensor_split = split
    if config.overrides:
        by_name = ggml.buffer_types()
        by_name.setdefault("CPU", ggml.cpu_buffer_type())
        rules = (_BuftOverride * (len(config.overrides) + 1))()  # zero-filled: the last one terminates
        for i, rule in enumerate(config.overrides):
            if rule.buft not in by_name:
                raise RuntimeError(
                    f"-ot {rule.pattern}={rule.buft}: unknown buffer type; available: {', '.join(sorted(by_name))}"
                )
            pattern = ctypes.create_string_buffer(rule.pattern.encode())
            keep_alive.append(pattern)
            rules[i].pattern = ctypes.cast(pattern, ctypes.c_char_p)
            rules[i].buft = by_name[rule.buft]
        keep_alive.append(rules)
        mparams.tensor_buft_overrides = ctypes.cast(rules, ctypes.c_void_p)
    return mparams


def build_context_params(
    config: LaunchConfig, n_outputs_max: int | None = None, threads: int = 1, threads_batch: int | None = None
) -> Any:
    """`llama_context_params` for `config` as llama-server sets them (common_context_params_to_llama).

    `n_outputs_max` None follows llama-server (min(-b, slots), one output per sequence); 0 gives the C API default.
    """
    import llama_cpp

    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = config.ctx_size
    cparams.n_batch = config.batch_size
    cparams.n_ubatch = config.ubatch_size
    cparams.n_seq_max = config.n_seq_max
    cparams.kv_unified = config.unified
    cparams.swa_full = config.swa_full
    cparams.flash_attn_type = FLASH_ATTN[config.flash_attn]
    cparams.type_k = _ggml_type(config.cache_type_k)
    cparams.type_v = _ggml_type(config.cache_type_v)
    cparams.offload_kqv = not config.no_kv_offload
    cparams.op_offload = not config.no_op_offload
    cparams.n_threads = threads
    cparams.n_threads_batch = threads if threads_batch is None else threads_batch
    if n_outputs_max is None:  # llama-server: min(n_batch, n_parallel * (1 + n_draft)), at least 1; one per seq
        cparams.n_outputs_max = max(1, min(config.batch_size, config.n_seq_max))
        cparams.n_outputs_max_per_seq = 1
    else:
        cparams.n_outputs_max = int(n_outputs_max)
    return cparams


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

    config = _config_from_json(request["config"])
    sink = _LogSink(log_path)
    old_cb, old_ud = llama_cpp.llama_log_callback(), ctypes.c_void_p()
    llama_cpp.llama_log_get(ctypes.byref(old_cb), ctypes.byref(old_ud))
    llama_cpp.llama_log_set(sink.callback, ctypes.c_void_p(0))
    model = ctx = None
    t0 = time.perf_counter()
    try:
        ggml = _Ggml(Path(llama_cpp.__file__).parent / "lib")
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
        print("usage: python -m fitter.llama_cpp_loader REQUEST.json RESULT.json LOG.txt", file=sys.stderr)
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
