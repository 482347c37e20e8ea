"""gguf's constant tables without gguf's package __init__.

`import gguf` (or any `gguf.<module>`) runs gguf/__init__.py, which imports numpy and every reader and writer:
0.17 s of the 0.5 s `fitter estimate` may take (measured with `python -X importtime`). The tables fitter needs
live in gguf/constants.py, which imports only the standard library, so it is loaded on its own, under its real
name: a later `import gguf` reuses this very module, so enum members stay identical.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING


def _constants() -> ModuleType:
    if "gguf.constants" in sys.modules:
        return sys.modules["gguf.constants"]
    package = importlib.util.find_spec("gguf")  # locates the package without executing it
    if package is None or package.origin is None:
        raise ImportError("the gguf package is not installed (pip install gguf)")
    spec = importlib.util.spec_from_file_location("gguf.constants", Path(package.origin).parent / "constants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gguf.constants"] = module
    spec.loader.exec_module(module)
    return module


if TYPE_CHECKING:  # the type checker reads the real module's annotations
    from gguf.constants import (
        GGML_QUANT_SIZES,
        GGUF_DEFAULT_ALIGNMENT,
        MODEL_TENSOR,
        TENSOR_NAMES,
        GGMLQuantizationType,
        GGUFValueType,
    )
else:
    constants = _constants()
    GGML_QUANT_SIZES = constants.GGML_QUANT_SIZES
    GGUF_DEFAULT_ALIGNMENT = constants.GGUF_DEFAULT_ALIGNMENT
    GGMLQuantizationType = constants.GGMLQuantizationType
    GGUFValueType = constants.GGUFValueType
    MODEL_TENSOR = constants.MODEL_TENSOR
    TENSOR_NAMES = constants.TENSOR_NAMES

__all__ = ["GGML_QUANT_SIZES", "GGUF_DEFAULT_ALIGNMENT", "MODEL_TENSOR", "TENSOR_NAMES", "GGMLQuantizationType",
           "GGUFValueType"]
