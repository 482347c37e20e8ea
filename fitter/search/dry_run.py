"""`fitter tune --dry-run`: the space, the feasible region and the planned first trials, nothing launched."""

from __future__ import annotations

from fitter.search.plan import Screener, structured_start
from fitter.search.request import TuneRequest, candidate, combos
from fitter.search.screen import device_totals
from fitter.units import MIB


def dry_run_text(req: TuneRequest, source: str) -> str:
    """The space, the feasible region and the planned first trials; nothing launched."""
    screener = Screener(req)
    lines = [f"workload: {req.workload.label()} ({req.workload.source})", f"space {source}:"]
    for k, d in req.distributions.items():
        lines.append(f"  {k}: {d}")
    lines.append("feasible region (each batch/KV/flash-attention combination at its best placement):")
    n_feasible = 0
    for c in combos(req):
        placed = screener.placement(screener._with_threads(c))
        label = " ".join(f"{k}={v}" for k, v in c.items())
        if placed is None:
            lines.append(f"  {label}: nothing fits")
            continue
        n_feasible += 1
        place = {k: placed[k] for k in ("n-cpu-moe", "n-gpu-layers", "expert-order") if k in placed}
        plan = screener(candidate(req, placed)).plan
        used = ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in device_totals(plan).items()) if plan else ""
        lines.append(f"  {label}: {place or 'fits'} ({used})")
    lines.append(f"{n_feasible} of {len(combos(req))} combinations fit; budgets: "
                 + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in req.budgets.devices.items())
                 + f", host {(req.budgets.host or 0) / MIB:.0f} MiB")
    lines.append("planned first trials (after the baseline, llama.cpp's own --fit):")
    for p in structured_start(req, screener):
        lines.append(f"  {p.phase}: {' '.join(candidate(req, p.params).flags)}")
    return "\n".join(lines)
