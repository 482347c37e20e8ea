"""C sources fitter compiles at first use (see fitter.measure.emulator.emulated_gpu)."""
