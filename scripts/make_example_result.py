"""Regenerate `examples/demo-result/`, the small tuning result the analysis notebook and its test run on.

It comes from a real `fitter tune` of the demo model on fitter's emulated GPU (the same command on every machine,
so the example never depends on this machine's GPUs), never from an edited file:

    .venv/bin/python scripts/make_example_result.py            # ~25 s on 2 cores (the tune), plus setup

The tune writes into a temporary results root; its `pareto.json`, `trials.csv` and `study.db` are copied flat into
`examples/demo-result/` (no model/machine/build folders), with a README.md saying what produced them. One field is
rewritten: `pareto.json`'s `study.storage` (the temporary `sqlite:///…/study.db`) becomes the relative `study.db`.
`model.path` is left as the tune recorded it (the demo model in the cache of the machine that ran it); nothing that
reads the example may depend on it. The copied `study.db` is VACUUMed to keep it small.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "examples" / "demo-result"
# The demo model on a 96 MiB emulated GPU with a 16 MiB fit target (what `fitter tune` picks by itself on a machine
# without a GPU, given explicitly so a GPU machine produces the same kind of example), short runs at -c 4096.
TUNE_ARGS = ["--emulated-gpu", "96", "--fit-target", "16", "-p", "64", "-n", "16", "-r", "2", "-c", "4096",
             "--seed", "0"]
# 12 launched trials: past the structured first trials (baseline, decode-first, prefill-first, min-vram,
# neighbours), so TPE proposes some configs the estimator screens out and the example has PRUNED trials to show
TRIALS = 12
FILES = ("pareto.json", "trials.csv", "study.db")


def tune_args(trials: int) -> list[str]:
    return ["--trials", str(trials), *TUNE_ARGS]


def tune(results: Path, trials: int) -> Path:
    """Run the tune into `results` and return the one result folder it wrote."""
    argv = [sys.executable, "-m", "fitter.cli", "tune", *tune_args(trials), "--results", str(results)]
    print("running:", " ".join(argv[1:]), file=sys.stderr)
    subprocess.run(argv, check=True, cwd=ROOT)
    found = sorted(results.glob("*/*/*/pareto.json"))
    if len(found) != 1:
        raise SystemExit(f"expected one result folder under {results}, found {[str(p.parent) for p in found]}")
    return found[0].parent


def copy_result(src: Path, out: Path) -> dict[str, Any]:
    """Copy the three files flat into `out`; rewrite study.storage; VACUUM the study. Returns pareto.json."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in FILES:
        shutil.copy2(src / name, out / name)
    doc: dict[str, Any] = json.loads((out / "pareto.json").read_text())
    doc["study"]["storage"] = "study.db"  # the only rewrite: the temporary sqlite:///… path is gone
    (out / "pareto.json").write_text(json.dumps(doc, indent=1) + "\n")
    con = sqlite3.connect(out / "study.db")
    try:
        con.execute("VACUUM")
    finally:
        con.close()
    return doc


def readme(doc: dict[str, Any], when: str, args: list[str]) -> str:
    machine = doc["machine"]
    study = doc["study"]
    llama = doc["llama_cpp"]
    picks = ", ".join(f"{k} = trial {v}" for k, v in doc["picks"].items()) or "none"
    machine_json = json.dumps(machine, indent=1, sort_keys=True)
    return f"""# Example tuning result: the demo model on fitter's emulated GPU

Produced by `scripts/make_example_result.py`, which runs a real

```
fitter tune {" ".join(args)}
```

(the demo model, `{doc["model"]["name"]}`, on a {machine.get("emulated_gpu_mib", "?")} MiB emulated GPU: real
placement and out-of-memory, CPU speed) and copies the result folder's `pareto.json`, `trials.csv` and `study.db`
here. **Regenerate it with the script; never edit these files by hand.** The only rewrite is `pareto.json`'s
`study.storage`, made the relative `study.db`; `model.path` is where the demo model was on the machine that ran it.

- run: {when}, llama.cpp {llama.get("commit")} ({llama.get("source", "?")})
- {study["trials"]} trials: {study["launched"]} launched, {study["screened_out"]} screened out by the estimator,
  {study["answered_from_storage"]} answered from storage; {study["wall_s"]:.0f} s
- picks: {picks}

`notebooks/analysis.ipynb` reads it (and any other result folder). The machine, from `pareto.json`:

```json
{machine_json}
```
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=OUT, help=f"where to write the example (default {OUT})")
    ap.add_argument("--trials", type=int, default=TRIALS, help=f"launched trials (default {TRIALS})")
    ns = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fitter-example-") as tmp:
        src = tune(Path(tmp) / "results", ns.trials)
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        doc = copy_result(src, ns.out)
    (ns.out / "README.md").write_text(readme(doc, when, tune_args(ns.trials)))
    sizes = ", ".join(f"{n} {(ns.out / n).stat().st_size // 1024} KiB" for n in FILES)
    print(f"wrote {ns.out}: {sizes}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
