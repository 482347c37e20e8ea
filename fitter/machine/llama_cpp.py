"""The llama.cpp this machine has through llama-cpp-python: its version, llama.cpp's own support queries, ggml's
backends and devices, and the commit its libggml was built from.

The libraries are opened by soname (`lib/libggml-base.so.0`, `libggml.so.0`): the very copies libllama links
against (the unversioned `.so` would be a second ggml whose buffer types never compare equal to libllama's).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from fitter.errors import FitterError

REINSTALL_GPU_BUILD = (
    'CMAKE_ARGS="-DGGML_CUDA=on -DGGML_RPC=ON" pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36'
)
GGML_DEVICE_TYPES = ("cpu", "gpu", "igpu", "accel", "meta")  # ggml-backend.h enum ggml_backend_dev_type
NON_GPU_BACKENDS = frozenset({"CPU", "RPC", "BLAS"})


@dataclass(frozen=True)
class BackendDevice:
    name: str
    description: str
    type: str  # GGML_DEVICE_TYPES


@dataclass(frozen=True)
class BackendReg:
    name: str
    devices: int


@dataclass(frozen=True)
class LlamaCppInfo:
    installed: bool
    version: str | None = None
    supports_gpu_offload: bool | None = None
    supports_rpc: bool | None = None
    system_info: str | None = None
    backends: tuple[BackendReg, ...] | None = None  # None: ggml's registry could not be read
    devices: tuple[BackendDevice, ...] | None = None
    error: str | None = None

    @property
    def gpu_backend(self) -> bool | None:
        """Whether ggml has a GPU device; None when its devices could not be listed and llama.cpp's answer is yes."""
        if self.devices is not None:
            return any(d.type in ("gpu", "igpu") for d in self.devices)
        return False if not self.installed or self.supports_gpu_offload is False else None


def gpu_build_problem(info: LlamaCppInfo) -> str | None:
    """Why this llama-cpp-python cannot offload to a GPU, with the reinstall line; None when it can."""
    fix = f"reinstall it with CUDA: {REINSTALL_GPU_BUILD}"
    if not info.installed:
        return f"{info.error or 'llama-cpp-python is not installed'}; {fix}"
    if info.gpu_backend or (info.gpu_backend is None and info.supports_gpu_offload):
        return None  # a GPU device, or devices unknown and llama.cpp says it can offload
    gpu_regs = [b.name for b in info.backends or () if b.name not in NON_GPU_BACKENDS]
    if gpu_regs:
        return (f"llama-cpp-python {info.version} has the {', '.join(gpu_regs)} backend but it finds no GPU: "
                "check the NVIDIA driver (nvidia-smi)")
    names = ", ".join(b.name for b in info.backends) if info.backends else "unknown"
    why = " (llama_supports_gpu_offload() is true only through the RPC backend)" if info.supports_gpu_offload else ""
    return f"llama-cpp-python {info.version} is a CPU build (backends: {names}){why}; {fix}"


def require_gpu_build(info: LlamaCppInfo | None = None) -> LlamaCppInfo:
    """The llama-cpp-python build info, or a FitterError naming the reinstall line when it cannot use a GPU."""
    info = info if info is not None else detect_llama_cpp()
    problem = gpu_build_problem(info)
    if problem:
        raise FitterError(problem)
    return info


def detect_llama_cpp() -> LlamaCppInfo:
    """The installed llama-cpp-python: version, llama.cpp's own support queries, and ggml's backends and devices."""
    try:
        import llama_cpp
    except ImportError as e:
        if e.name == "llama_cpp":
            return LlamaCppInfo(installed=False, error="llama-cpp-python is not installed")
        return LlamaCppInfo(installed=False, error=f"llama-cpp-python failed to import: {e}")
    except Exception as e:  # its shared library failed to load (RuntimeError, OSError)
        return LlamaCppInfo(installed=False, error=f"llama-cpp-python failed to import: {type(e).__name__}: {e}")
    version = _text(getattr(llama_cpp, "__version__", None))
    try:
        offload = bool(llama_cpp.llama_supports_gpu_offload())
        rpc = bool(llama_cpp.llama_supports_rpc())
        system_info = (_text(llama_cpp.llama_print_system_info()) or "").strip().removesuffix("|").strip()
    except Exception as e:
        return LlamaCppInfo(installed=True, version=version, error=f"llama.cpp query failed: {type(e).__name__}: {e}")
    lib_dir = lib_dir_of(Path(llama_cpp.__file__).parent)
    error = None
    try:
        backends, devices = _ggml_registry(lib_dir)
    except (OSError, AttributeError) as e:
        backends, devices, error = None, None, f"could not list ggml's devices in {lib_dir}: {e}"
    return LlamaCppInfo(True, version, offload, rpc, system_info, backends, devices, error)


def _ggml_registry(lib_dir: Path) -> tuple[tuple[BackendReg, ...], tuple[BackendDevice, ...]]:
    """ggml's backend registries and devices, through the copies libllama links against (the `.so.0` sonames)."""
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so.0"))
    ggml = ctypes.CDLL(str(lib_dir / "libggml.so.0"))
    vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    for lib, name, argtypes, restype in (
        (ggml, "ggml_backend_reg_count", [], sz), (ggml, "ggml_backend_reg_get", [sz], vp),
        (ggml, "ggml_backend_dev_count", [], sz), (ggml, "ggml_backend_dev_get", [sz], vp),
        (base, "ggml_backend_reg_name", [vp], cp), (base, "ggml_backend_reg_dev_count", [vp], sz),
        (base, "ggml_backend_dev_name", [vp], cp), (base, "ggml_backend_dev_description", [vp], cp),
        (base, "ggml_backend_dev_type", [vp], ctypes.c_int),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    regs = []
    for i in range(ggml.ggml_backend_reg_count()):
        reg = ggml.ggml_backend_reg_get(i)
        name = _text(base.ggml_backend_reg_name(reg)) or "?"
        regs.append(BackendReg(name, int(base.ggml_backend_reg_dev_count(reg))))
    devices = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        kind = int(base.ggml_backend_dev_type(dev))
        devices.append(BackendDevice(
            _text(base.ggml_backend_dev_name(dev)) or "?",
            _text(base.ggml_backend_dev_description(dev)) or "",
            GGML_DEVICE_TYPES[kind] if 0 <= kind < len(GGML_DEVICE_TYPES) else str(kind),
        ))
    return tuple(regs), tuple(devices)


def _text(x: object) -> str | None:
    if x is None:
        return None
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


def lib_dir_of(package_dir: Path) -> Path:
    """Where llama-cpp-python loads libllama and ggml from: $LLAMA_CPP_LIB_PATH, else its package's lib/."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")  # llama_cpp/_ctypes_extensions.py honours it
    return Path(override) if override else package_dir / "lib"


def llama_cpp_python_lib_dir() -> Path | None:
    """The installed llama-cpp-python's library folder, found without importing it (it loads libllama at import);
    None when it is not installed."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return None
    return lib_dir_of(Path(spec.origin).parent)


def llama_cpp_python_version() -> str | None:
    import importlib.metadata  # ~50 ms (email, zipfile, …): only when asked

    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def ggml_build(lib_dir: Path) -> dict[str, str]:
    """The commit and version ggml was built from, as its own library reports them (ggml/src/ggml.c ggml_commit(),
    ggml_version()); {} where the library or the functions are missing. Loading libggml-base starts no backend."""
    try:
        base = ctypes.CDLL(str(lib_dir / "libggml-base.so.0"))
    except OSError:
        return {}
    out: dict[str, str] = {}
    for name in ("ggml_commit", "ggml_version"):
        fn = getattr(base, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = [], ctypes.c_char_p
            out[name] = (fn() or b"").decode(errors="replace")
    return out


def llama_cpp_python_build() -> dict[str, str]:
    """{"commit", "source", "version"} of the llama.cpp llama-cpp-python measures with, read from its libggml-base
    without importing it; the commit "unknown" when it is not installed or does not say."""
    lib_dir = llama_cpp_python_lib_dir()
    version = llama_cpp_python_version()
    build = ggml_build(lib_dir) if lib_dir is not None else {}
    return {"commit": build.get("ggml_commit") or "unknown",
            "source": f"ggml_commit() of the libggml-base loaded by llama-cpp-python {version}",
            "version": str(version)}


def llama_cpp_python_problem() -> str | None:
    """Why llama-cpp-python cannot run llama.cpp here (not installed, no libraries), without importing it; None when
    it can."""
    lib_dir = llama_cpp_python_lib_dir()
    if lib_dir is None:
        return "llama-cpp-python is not installed"
    if not (lib_dir / "libggml-base.so.0").is_file():
        return f"llama-cpp-python has no llama.cpp libraries in {lib_dir}"
    return None
