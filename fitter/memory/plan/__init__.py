"""The memory plan: every buffer llama.cpp allocates for a model, a launch config and devices (`estimate`), the
weights' placement, the KV cache, and the kinds taken from llama.cpp's own projection where fitter has no rule."""
