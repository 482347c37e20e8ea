"""Memory a CUDA device gives away outside llama.cpp's buffers: its own line per device, on top of which the fit
target (`--fit-target`) stays the user's free margin.

llama.cpp logs every buffer it allocates, but a CUDA process also holds what no log line shows; llama.cpp's own fit
leaves its 1024 MiB target for all of it. A default by GPU class, each part with its source:

- the CUDA context: about 3.5 MiB per streaming multiprocessor (451–456 MiB unaccounted per RTX 4090, 128 SMs, at
  exit: llama.cpp PR #15860; 107 MiB on an RTX 4060 Ti, 34 SMs: PR #23604); a GPU whose SM count NVML does not give
  is taken as an RTX 4090's 453 MiB;
- one cuBLAS workspace per stream in use (llama.cpp uses one): 32 MiB from compute capability 9.0 (Hopper) on,
  else 4 MiB (ggml/src/ggml-cuda/common.cuh `ggml_backend_cuda_context::cublas_handle`); unknown: 32 MiB;
- the CUDA memory pool's high-water mark (temporaries such as f16 copies of weights for cuBLAS; the VMM pool never
  shrinks): not predicted from the header; the measurement below replaces the whole default.

Once a trial has run with NVML on this machine, what NVML saw fitter's process use on the device beyond the buffers
llama.cpp logged replaces the default (fitter.machine.measured_overhead keeps it per machine fingerprint and driver).
"""

from __future__ import annotations

from dataclasses import dataclass

from fitter.units import MIB

CONTEXT_BYTES_PER_SM = 3.5 * MIB  # PR #15860 (RTX 4090) and PR #23604 (RTX 4060 Ti)
CONTEXT_UNKNOWN_BYTES = 453 * MIB  # an RTX 4090's, PR #15860
CORES_PER_SM = {7: 64, 8: 128, 9: 128, 10: 128, 12: 128}  # FP32 cores per SM by major compute capability (8.0: 64)


@dataclass(frozen=True)
class Overhead:
    bytes: int
    source: str  # what the number is and where it comes from


def sm_count(cuda_cores: int | None, compute_capability: tuple[int, int] | None) -> int | None:
    """Streaming multiprocessors from NVML's core count (nvmlDeviceGetNumGpuCores) and the compute capability."""
    if not cuda_cores or compute_capability is None:
        return None
    per_sm = 64 if compute_capability == (8, 0) else CORES_PER_SM.get(compute_capability[0])
    return cuda_cores // per_sm if per_sm else None


def default_overhead(name: str | None = None, compute_capability: tuple[int, int] | None = None,
                     sms: int | None = None) -> Overhead:
    """The default for a GPU of this class (what NVML tells of it; nothing for a hypothetical `--devices cuda:MiB`)."""
    if sms:
        context = round(sms * CONTEXT_BYTES_PER_SM)
        context_source = f"CUDA context ~3.5 MiB × {sms} SMs (llama.cpp PR #15860, #23604)"
    else:
        context = CONTEXT_UNKNOWN_BYTES
        context_source = "CUDA context 453 MiB, an RTX 4090's (llama.cpp PR #15860; SM count unknown)"
    if compute_capability is None:
        cublas, cublas_source = 32 * MIB, "cuBLAS workspace 32 MiB (compute capability unknown)"
    else:
        hopper = compute_capability >= (9, 0)
        cublas = (32 if hopper else 4) * MIB
        cublas_source = (f"cuBLAS workspace {cublas // MIB} MiB (cc {compute_capability[0]}.{compute_capability[1]}, "
                         "ggml-cuda common.cuh)")
    who = f"{name}: " if name else ""
    return Overhead(context + cublas, f"default for {who}{context_source} + {cublas_source}; the CUDA pool is not "
                                      "predicted (a measured trial replaces this)")


def measured_overhead(nbytes: int, where: str) -> Overhead:
    return Overhead(max(0, nbytes), f"measured by NVML on this machine ({where}): fitter's process on the device "
                                    "beyond llama.cpp's logged buffers")
