"""C sources fitter compiles at first use (see fitter.measure.emulated_gpu)."""
