#!/usr/bin/env bash
# The real-GPU check, for a machine with an NVIDIA GPU, nvcc and cmake but no network (the device tool's H200),
# in at most 10 minutes on 16 cores:
#   1. build llama-cpp-python 0.3.36 with CUDA for this GPU's architecture only, from the source
#      scripts/pack_gpu_check.py packed into .gpu-check/ (carry it: `carry: [".gpu-check"]`), with RPC on as in CI;
#   2. record `make_goldens.py --device cuda` on a subset of models that runs in about 5 minutes
#      -> tests/golden/cuda.json (tests/memory/test_golden.py checks the estimator's CUDA profile against it);
#   3. record the memory outside llama.cpp's buffers per step (context, load, context, first prefill)
#      -> tests/golden/cuda-overhead.json (scripts/gpu_overhead.py).
# Results are copied to $OUT when it is set (the device tool brings that folder back).
#
#   python scripts/pack_gpu_check.py                # here, once
#   bash scripts/gpu_check.sh [--models a,b]        # there
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS="gpt-oss-tiny,qwen3moe-tiny,llama-tiny,demo"
if [[ "${1:-}" == "--models" ]]; then MODELS="$2"; fi
OVERHEAD_MODELS="gpt-oss-tiny,demo"
PACK=.gpu-check
SITE=/tmp/fitter-gpu-site
t0=$(date +%s)
log() { echo "gpu_check [$(( $(date +%s) - t0 )) s]: $*" >&2; }

command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: not a machine with an NVIDIA GPU" >&2; exit 2; }
command -v nvcc >/dev/null || { echo "gpu_check: no nvcc on PATH" >&2; exit 2; }
src=$(ls "$PACK"/llama-cpp-python-*-cuda-src.tar.gz 2>/dev/null | head -1)
[[ -n "$src" ]] || { echo "gpu_check: $PACK has no source: run python scripts/pack_gpu_check.py here first" >&2; exit 2; }
PY=${PYTHON:-python3}

# compute capability 9.0 -> CUDA architecture 90 (Hopper: 90a would add wgmma kernels llama.cpp does not need here)
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' ')
arch=${cc/./}
log "GPU $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1), cc $cc"

log "installing the carried wheels"
"$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$PACK"/wheels/*.whl
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

log "building llama-cpp-python with CUDA for sm_$arch on $(nproc) cores"
commit=$(tar xzf "$src" -O --wildcards '*/.git/modules/vendor/llama.cpp/HEAD' | cut -c1-7)
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$arch -DGGML_RPC=ON -DGGML_NATIVE=OFF -DLLAMA_BUILD_COMMIT=$commit"
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" "$src"
"$PY" -c "import llama_cpp; assert llama_cpp.llama_supports_gpu_offload(), 'built without GPU offload'"
log "built ($commit)"

log "goldens on CUDA0: $MODELS"
"$PY" scripts/make_goldens.py --device cuda --models "$MODELS" --jobs 1
log "overhead outside llama.cpp's buffers"
"$PY" scripts/gpu_overhead.py --models "$OVERHEAD_MODELS"
if [[ -n "${OUT:-}" ]]; then
    cp tests/golden/cuda.json tests/golden/cuda-overhead.json "$OUT"/
fi
log "done"
