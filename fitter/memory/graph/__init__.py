"""The compute-graph replay: the worst-case graph llama.cpp reserves, rebuilt from shapes, scheduled onto backends
(with each backend's op support) and allocated as ggml-alloc does, to size the compute buffers."""
