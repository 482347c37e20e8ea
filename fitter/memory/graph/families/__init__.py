"""Each family's graph builder: the layers of one group of llama.cpp's src/models/*.cpp, from the shared blocks of
fitter.memory.graph.builder."""
