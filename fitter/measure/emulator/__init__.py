"""The emulated GPU: capped llama.cpp RPC devices that give real placement and real out-of-memory at CPU speed
(`emulated_gpu`), the server's memory cap and the CUDA-shaped device's rules (`capdev` + `native/`)."""
