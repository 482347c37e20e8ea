"""`fitter check`: a pick re-measured later and compared with what was recorded, beyond noise, and whether it still
fits (`run`)."""
