"""C sources fitter compiles at first use (see fitter.emulated_gpu)."""
