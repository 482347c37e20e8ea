"""`fitter serve`: a tuning result served with the fastest measured config of a policy that fits the memory free at
launch (`choice`), llama-server run under fitter with signals passed on (`supervise`)."""
