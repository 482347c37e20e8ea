"""GGUF files: the header reader (metadata and tensor table, no tensor data), the model spec llama.cpp's memory
rules need, and fitter's synthetic models (the demo model, tiny test models, real-shaped headers)."""

from __future__ import annotations

from fitter.gguf.header import GGUFHeader, TensorInfo, read_header
from fitter.gguf.model_spec import ModelSpec, Role, TensorSpec, load_model_spec, model_spec

__all__ = ["GGUFHeader", "ModelSpec", "Role", "TensorInfo", "TensorSpec", "load_model_spec", "model_spec",
           "read_header"]
