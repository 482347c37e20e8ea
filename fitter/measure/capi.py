"""llama-server's flags as llama.cpp's C API takes them, through llama-cpp-python's ctypes bindings: the model and
context parameters (common/common.cpp `common_model_params_to_llama`, `common_context_params_to_llama`, llama.cpp
0c1e570), tensor overrides as `tensor_buft_overrides`, ggml's device registry and RPC servers, and a log sink for
`llama_log_set`. Used inside the child processes only (fitter.measure.loader, fitter.measure.worker); a LaunchConfig
crosses into them as JSON (`config_to_json`).

Translation notes (where the C API and llama-server differ, llama-server wins):
- `-c 0` is passed as n_ctx 0: llama.cpp then uses the model's training context, as llama-server does.
- `--swa-full` is always set from the config: the C API defaults to true, llama-server to false.
- `-np`: n_seq_max = config.n_seq_max (auto = 4) and kv_unified = config.unified.
- n_outputs_max: llama-server (and llama-cli, which runs it) sets it to min(n_batch, n_parallel × (1 + n_draft))
  (tools/server/server-context.cpp `server_output_limits`); the C API default 0, which llama_context reads as
  n_batch, is what llama-cpp-python and llama-bench keep. The config's consumer (`--for`) decides; this sizes the
  logits in the compute buffer. Without speculative decoding the servers' is min(-b, slots), one per sequence.
- `-lm/--load-mode` (`--no-mmap` is the older spelling of `-lm none`): mmap modes → load_mode AUTO (mmap unless a
  device cannot map), others → NONE.
- `-ngl auto` (-1) is passed as -1, which the C API reads as "all layers": `--fit` is not in libllama.
- `-ot`/`-cmoe`/`-ncmoe` rules are resolved by buffer type name over the ggml devices, as common/arg.cpp does.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from pathlib import Path
from typing import Any

from fitter.flags import LaunchConfig, TensorOverride
from fitter.flags.config import SPLIT_MODES
from fitter.flags.consumers import consumer
from fitter.measure.emulator.capdev import CUDA_RPC_ENV
from fitter.memory.backends.devices import OFFLOAD_MIN_BATCH_ENV, offload_min_batch

# llama.h enum llama_load_mode / enum llama_flash_attn_type
LOAD_MODE_AUTO = -1
LOAD_MODE_NONE = 0
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
_LOG_ERROR, _LOG_CONT = 4, 5  # ggml.h enum ggml_log_level (llama-cpp-python's _logger.py comment is stale)


def config_to_json(config: LaunchConfig) -> dict[str, Any]:
    return {**dataclasses.asdict(config), "given": sorted(config.given)}


def config_from_json(data: dict[str, Any]) -> LaunchConfig:
    data = dict(data)
    for key in ("overrides", "draft_overrides"):
        data[key] = tuple(TensorOverride(o["pattern"], o["buft"]) for o in data.get(key, ()))
    for key in ("tensor_split", "rpc", "device_names"):
        data[key] = tuple(data.get(key, ()))
    data["given"] = frozenset(data.get("given", ()))
    return LaunchConfig(**data)


class Ggml:
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
        self._sig(self.base, "ggml_backend_dev_type", [vp], ctypes.c_int)
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

    def device(self, name: str) -> int:
        """ggml_backend_dev_by_name, as -dev reads a name (a CPU device, or none, is an invalid device)."""
        for i in range(self.ggml.ggml_backend_dev_count()):
            dev = self.ggml.ggml_backend_dev_get(i)
            if self.base.ggml_backend_dev_name(dev).decode() == name and self.base.ggml_backend_dev_type(dev) != 0:
                return int(dev)
        raise RuntimeError(f"-dev {name}: invalid device (llama.cpp lists no such device here)")

    def add_rpc_servers(self, servers: tuple[str, ...]) -> None:
        """common/arg.cpp add_rpc_devices. An unreachable server aborts this (child) process."""
        reg = self.ggml.ggml_backend_reg_by_name(b"RPC")
        if not reg:
            raise RuntimeError("--rpc: this llama.cpp build has no RPC backend (build with -DGGML_RPC=ON)")
        addr = self.base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
        if not addr:
            raise RuntimeError("--rpc: the RPC backend lacks ggml_backend_rpc_add_server")
        add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(addr)
        cuda_shaped = set(filter(None, os.environ.get(CUDA_RPC_ENV, "").split(",")))
        for server in servers:
            server_reg = add_server(server.encode())
            self.ggml.ggml_backend_register(server_reg)
            if server in cuda_shaped:
                self._cudafy(server_reg, server)

    def _cudafy(self, reg: int, server: str) -> None:
        """Give the devices of an RPC server CUDA's scheduling rules (fitter/measure/emulator/native/cudadev.c): the
        CUDA-shaped emulated GPU, whose server already answers with CUDA's buffer sizes."""
        from fitter.measure.emulator.capdev import cuda_library

        lib = ctypes.CDLL(str(cuda_library()))
        lib.fitter_cudadev_patch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        lib.fitter_cudadev_patch.restype = ctypes.c_int
        self._sig(self.base, "ggml_backend_reg_dev_count", [ctypes.c_void_p], ctypes.c_size_t)
        self._sig(self.base, "ggml_backend_reg_dev_get", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p)
        min_batch = offload_min_batch(os.environ.get(OFFLOAD_MIN_BATCH_ENV))  # as ggml-cuda.cu reads it
        for i in range(self.base.ggml_backend_reg_dev_count(reg)):
            rc = lib.fitter_cudadev_patch(self.base.ggml_backend_reg_dev_get(reg, i), self.cpu_buffer_type(),
                                          min_batch)
            if rc != 0:
                raise RuntimeError(f"--rpc {server}: cannot give it CUDA's rules (cudadev.c status {rc}: "
                                   "this ggml's op numbering differs from llama.cpp 0c1e570's)")
        self._cuda_lib = lib  # the patched device points into it: keep it loaded


class _BuftOverride(ctypes.Structure):
    # include/llama.h struct llama_model_tensor_buft_override (not wrapped by llama-cpp-python)
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _ggml_type(name: str) -> int:
    from gguf.constants import GGMLQuantizationType  # same numbering as enum ggml_type

    return int(GGMLQuantizationType[name.upper()])


class LogSink:
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


def build_model_params(config: LaunchConfig, ggml: Ggml, keep_alive: list[Any]) -> Any:
    """`llama_model_params` for `config` as llama-server sets them (common_model_params_to_llama).

    The ctypes arrays the params point to (tensor split, override rules and their patterns) are appended to
    `keep_alive`, which must outlive the params. RPC servers must already be registered (`Ggml.add_rpc_servers`).
    """
    import llama_cpp

    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = config.n_gpu_layers
    mparams.main_gpu = config.main_gpu
    mparams.split_mode = SPLIT_MODES.index(config.split_mode)  # enum llama_split_mode
    mparams.load_mode = LOAD_MODE_AUTO if config.mmap else LOAD_MODE_NONE
    mparams.use_extra_bufts = not config.no_repack
    if config.tensor_split:
        n_max = int(llama_cpp.llama_max_devices())
        split = (ctypes.c_float * n_max)(*[float(x) for x in config.tensor_split[:n_max]])
        keep_alive.append(split)
        mparams.tensor_split = split
    if config.device_names:  # common/arg.cpp parse_device_list: NULL-terminated, `none` alone is just the NULL
        names = () if config.device_names == ("none",) else config.device_names
        devs = (ctypes.c_void_p * (len(names) + 1))(*[ggml.device(name) for name in names], None)
        keep_alive.append(devs)
        mparams.devices = ctypes.cast(devs, ctypes.c_void_p)
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
    """`llama_context_params` for `config` as its program (`config.consumer`) sets them: llama-server's
    common_context_params_to_llama, or the C API's defaults under llama-cpp-python and llama-bench.

    `n_outputs_max` None follows the program (servers: min(-b, slots), one output per sequence; C API: 0 = n_batch);
    a number overrides it (llama-fit-params keeps common.h's 0).
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
    program = consumer(config.consumer)
    if n_outputs_max is None and program.outputs_per_slot:  # servers: min(n_batch, n_parallel * (1 + n_draft))
        cparams.n_outputs_max = program.n_outputs_max(config.batch_size, config.n_seq_max)
        cparams.n_outputs_max_per_seq = 1
    elif n_outputs_max is not None:
        cparams.n_outputs_max = int(n_outputs_max)
    # else the C API default stays: 0, which llama_context reads as n_batch
    return cparams


def build_mtmd_params(config: LaunchConfig, ggml: Ggml, threads: int = 1) -> Any:
    """`mtmd_context_params` as llama-server fills them for --mmproj (tools/server/server-context.cpp load_model;
    common/arg.cpp: -mmdev, else -dev's first device; `none` or --no-mmproj-offload the CPU)."""
    from llama_cpp import mtmd_cpp

    params = mtmd_cpp.mtmd_context_params_default()
    params.print_timings = False
    params.n_threads = threads
    params.flash_attn_type = FLASH_ATTN[config.flash_attn]
    params.warmup = True
    name = config.mmproj_device or (config.device_names[0] if config.device_names else "")
    params.use_gpu = name != "none"
    if params.use_gpu and name:
        params.device = ctypes.c_void_p(ggml.device(name))
    return params

