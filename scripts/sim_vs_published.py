"""Published llama.cpp measurements against fitter's simulated machines: per sweep (one machine, one variable
changed), the published and the simulated prefill and decode speeds, the error, and whether the simulator ranks the
sweep's configs as measured.

The points (tests/golden/published.json) are those of /work/shared/published/points.json whose machine a profile in
fitter/sim/machines/ describes from spec sheets, with the launch each one ran (flags as fitter parses them, the
program, the prompt and generation lengths, the threads). The models are fitter's real-shaped header-only GGUFs
(fitter.gguf.shapes SHAPES, written sparse: no weights, nothing downloaded). `magnitudes` lists the speeds a
sweep's errors count (a stand-in CPU or GPU makes the others meaningless), `ranks` the speeds whose order is
checked (`excluded` says why one is not); `known_misranked` names the orders the sim gets wrong, and why.
Two configs whose published speeds differ by less than the sweep's `noise` (the spread its source implies) are a tie
either order satisfies.

    python scripts/sim_vs_published.py            # the table (docs/sim.md)
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fitter.flags import parse_launch_flags
from fitter.gguf.demo_models import SHAPES, write_model
from fitter.gguf.model_spec import ModelSpec, load_model_spec
from fitter.measure.types import BenchSpec
from fitter.sim import SimRunner, load_machine, out_of_memory, speeds

POINTS = Path(__file__).resolve().parents[1] / "tests" / "golden" / "published.json"
_TEMPORARY = tempfile.TemporaryDirectory(prefix="fitter-published-")  # removed at exit
_DIR = Path(_TEMPORARY.name)


@cache
def model_spec(shape: str, weight_type: str | None) -> ModelSpec:
    """The real-shaped header-only model (weight_type: the published file's non-expert type, where it differs)."""
    s = SHAPES[shape] if weight_type is None else replace(SHAPES[shape], weight_type=weight_type)
    name = f"{shape}-{weight_type or 'shipped'}.gguf"
    return load_model_spec(str(write_model(s, _DIR / name, sparse=True)[0]))


def simulate(sweep: dict[str, Any], point: dict[str, Any]) -> tuple[float | None, float | None, str]:
    """(pp, tg, outcome) of one published point on its sweep's machine, noise-free; None where not published."""
    machine = load_machine(sweep["machine"])
    runner = SimRunner(machine, model_spec(sweep["shape"], sweep["weight_type"]))
    flags = list(point["flags"])
    if point["consumer"] == "llama-bench":  # llama-bench's context: -p + -n (fitter writes it as -c)
        flags += ["-c", str((point["pp_prompt"] or 0) + (point["tg_gen"] or 0) + (point["tg_depth"] or 0))]
    plan = runner.plan(parse_launch_flags(flags, point["consumer"]))
    failed = out_of_memory(machine, plan)
    outcome = "ok" if failed is None else f"oom on {failed[1]}"
    pp = tg = None
    if point["pp_prompt"]:
        pp = speeds(machine, plan, BenchSpec(n_prompt=point["pp_prompt"], n_gen=0, threads=point["threads"]))[0]
    if point["tg_gen"]:
        tg = speeds(machine, plan, BenchSpec(n_prompt=0, n_gen=point["tg_gen"], n_depth=point["tg_depth"],
                                             threads=point["threads"]))[1]
    return pp, tg, outcome


def ranked_right(published: list[float], simulated: list[float], noise: float) -> bool:
    """Every pair of configs the source tells apart (published speeds more than `noise` apart) in the published
    order by the simulator."""
    for i, (a, sa) in enumerate(zip(published, simulated, strict=True)):
        for b, sb in zip(published[i + 1:], simulated[i + 1:], strict=True):
            if abs(a - b) > noise * max(a, b) and (a > b) != (sa > sb):
                return False
    return True


def sweeps() -> list[dict[str, Any]]:
    return list(json.loads(POINTS.read_text())["sweeps"])


def compare() -> list[dict[str, Any]]:
    """Per sweep: its rows (id, published and simulated pp and tg, outcome) and its ranking verdict per speed."""
    out = []
    for sweep in sweeps():
        rows = []
        for p in sweep["points"]:
            pp, tg, outcome = simulate(sweep, p)
            rows.append({"id": p["id"], "pp": p["pp_tps"], "sim_pp": pp, "tg": p["tg_tps"], "sim_tg": tg,
                         "outcome": outcome})
        ranks = {}
        for k in sweep["ranks"]:
            pairs = [(r[k], r[f"sim_{k}"]) for r in rows if r[k] is not None and r[f"sim_{k}"] is not None]
            if len(pairs) > 1:
                ranks[k] = ranked_right([a for a, _ in pairs], [b for _, b in pairs], sweep["noise"])
        out.append({"sweep": sweep, "rows": rows, "ranks": ranks})
    return out


def _err(pub: float | None, sim: float | None) -> float | None:
    return None if pub is None or sim is None else sim / pub - 1


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    results = compare()
    errors: dict[str, list[float]] = {"pp": [], "tg": []}
    print(f"{'sweep / point':34} {'machine':22} {'pp pub':>8} {'pp sim':>8} {'err':>6} "
          f"{'tg pub':>7} {'tg sim':>7} {'err':>6}  outcome")
    for r in results:
        sweep = r["sweep"]
        ranks = ", ".join(f"{k} {'ranked as published' if v else 'MIS-RANKED'}" for k, v in r["ranks"].items())
        print(f"{sweep['sweep']} (errors counted: {', '.join(sweep['magnitudes']) or 'none'}; {ranks or 'one point'})")
        if sweep.get("excluded"):
            print(f"  not compared: {sweep['excluded']}")
        for row in r["rows"]:
            e = {k: _err(row[k], row[f"sim_{k}"]) for k in ("pp", "tg")}
            for k in ("pp", "tg"):
                if e[k] is not None and k in sweep["magnitudes"]:
                    errors[k].append(e[k])
            print(f"  {row['id']:32} {sweep['machine']:22} {_fmt(row['pp'], '8.1f')} {_fmt(row['sim_pp'], '8.1f')} "
                  f"{_fmt(e['pp'], '+6.0%')} {_fmt(row['tg'], '7.2f')} {_fmt(row['sim_tg'], '7.2f')} "
                  f"{_fmt(e['tg'], '+6.0%')}  {row['outcome']}")
    for k, v in errors.items():
        if v:
            a = [abs(x) for x in v]
            print(f"{k}: {len(v)} points, median |error| {statistics.median(a):.0%}, worst {max(v, key=abs):+.0%}")
    right = sum(all(r["ranks"].values()) for r in results if r["ranks"])
    print(f"sweeps ranked as published: {right} of {sum(bool(r['ranks']) for r in results)}")


if __name__ == "__main__":
    main()
