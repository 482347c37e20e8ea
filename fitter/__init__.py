"""fitter: find the fastest llama.cpp launch settings a machine can hold."""

from __future__ import annotations

__version__ = "0.1.0"

# The llama.cpp source the estimator's rules were matched against: the copy vendored in
# llama-cpp-python 0.3.36 (pinned in pyproject.toml). Reported beside every estimate.
LLAMA_CPP_TARGET = {"commit": "0c1e570", "source": "llama-cpp-python 0.3.36 vendored llama.cpp"}
