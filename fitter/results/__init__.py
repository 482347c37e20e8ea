"""What a tune leaves: pareto.json, typed and read by one loader (`pareto`), a measurement as recorded and the one
VRAM rule (`measurement`), trials.csv (`trials`) and the one Pareto table (`table`) that tune prints and report
writes. export, report and check read results through this package."""
