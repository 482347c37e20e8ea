"""Backends as data: the devices a plan reasons about, each with its backend's buffer rules (one row per backend
llama.cpp ships), and the memory a device uses outside llama.cpp's buffers."""
