"""A tuning result and a planned study as text: the table `fitter tune` prints, and `--dry-run`'s report."""

from __future__ import annotations

from typing import Any

from fitter.flags.vocabulary import SEARCHED
from fitter.measure.noise import ratio_interval
from fitter.tune.plan import Screener, structured_start
from fitter.tune.request import TuneRequest, candidate, combos
from fitter.tune.result import Entry, ParetoDoc, fastest, round_avgs, vram_bytes
from fitter.tune.screen import device_totals
from fitter.units import MIB


def pareto_table(result: ParetoDoc) -> str:
    """The result as `fitter tune` prints it: the baseline, the front with picks, ratios and their 95 % intervals,
    ties, what was dropped, the drift monitor and what each pick gains over llama.cpp's own choice."""
    doc = result.data
    picks_by_trial: dict[int, list[str]] = {}
    for name, n in result.picks.items():
        picks_by_trial.setdefault(n, []).append(name)
    ctx = "ctx" in result.objectives  # the context searched (--min-ctx): a column of its own

    def ctx_cell(e: Entry) -> str:
        return f" {e.n_ctx or '-':>7}" if ctx else ""

    lines = [f"{'trial':>5}  {'pp t/s':>9} {'tg t/s':>8} {'VRAM MiB':>9}" + (f" {'ctx':>7}" if ctx else "")
             + f"  {'pp× [95 % CI]':<20} {'tg× [95 % CI]':<20} picks / flags"]
    base = doc["baseline"]
    bm = base.get("measurement")
    if bm and bm.get("outcome") == "ok":
        vram = vram_bytes(bm) / MIB
        lines.append(f"{'base':>5}  {bm['pp']['avg_ts']:9.1f} {bm['tg']['avg_ts']:8.1f} {vram:9.1f}"
                     f"{ctx_cell(result.baseline)}  {'1':<20} {'1':<20} llama.cpp --fit: "
                     + " ".join(base["flags"] or []))
    elif base.get("flags") or base.get("reason") or bm:
        lines.append(f"{'base':>5}  llama.cpp --fit: {(bm or {}).get('outcome') or base.get('reason')}")
    for e in result.pareto:
        m = e.measurement or {}
        ties = f" (tie: {', '.join('base' if t == base.get('trial') else str(t) for t in e.ties)})" if e.ties else ""
        lines.append(f"{e.trial:>5}  {m['pp']['avg_ts']:9.1f} {m['tg']['avg_ts']:8.1f} "
                     f"{(e.vram_bytes or 0) / MIB:9.1f}{ctx_cell(e)}  {_ratio(e, 'pp'):<20} {_ratio(e, 'tg'):<20} "
                     f"{','.join(picks_by_trial.get(e.trial or -1, [])) or '-'}{ties}: "
                     + ("llama.cpp --fit (the baseline) " if e.phase == "baseline" else "")
                     + " ".join(_short(list(e.flags or []))))
    for d in doc["dropped"]:
        if d["outcome"] == "dominated":
            lines.append(f"{d['trial']:>5}  dropped: {d['reason']}")
        else:
            lines.append(f"{d['trial']:>5}  dropped: its confirm run ended {d['outcome']}: {d['reason']}")
    lines += workload_lines(result)
    if ctx:
        lines += context_lines(result)
    s = doc["study"]
    confirm = doc.get("confirm") or {}
    lines.append(f"\n{s['trials']} trials: {s['launched']} launched, {s['screened_out']} screened out by the "
                 f"estimator, {s['answered_from_storage']} answered from storage"
                 + (f", {s['pooled']} pooled by physics" if s.get("pooled") else "")
                 + f"; {s['model_loads_this_run']} model loads this run; {s['wall_s']:.0f} s"
                 + (f"; confirm: {confirm['rounds']} interleaved rounds × {confirm['repetitions']} repetitions"
                    if confirm else ""))
    lines += verdict_lines(result)
    return "\n".join(lines)


def workload_lines(result: ParetoDoc) -> list[str]:
    """A workload of several depths or streams: what pp and tg stand for, then each config's speeds against depth
    (decode, then prefill) and, with streams, per-stream decode and time to first token."""
    w = result.data.get("workload")
    if not isinstance(w, dict) or (len(w.get("depths") or [0]) == 1 and int(w.get("concurrency") or 1) == 1):
        return []
    depths, streams = list(w["depths"]), int(w.get("concurrency") or 1)
    what = "their tokens over their time at the depths" if len(depths) > 1 else f"at depth {depths[0]}"
    out = ["", f"workload {w.get('source')}: {w.get('description') or ''}".rstrip(": ")
           + f" — pp and tg are {what}" + (f", aggregate over {streams} streams" if streams > 1 else "")]
    rows: list[tuple[str, dict[str, Any]]] = []
    bm = result.baseline.measurement
    if bm and bm.get("outcome") == "ok":
        rows.append(("base", bm))
    rows += [(str(e.trial), e.measurement) for e in result.pareto if e.measurement and e.phase != "baseline"]
    if len(depths) > 1:
        out.append(f"{'trial':>5}  {'test':<5}" + "".join(f"{'d ' + str(d):>11}" for d in depths))
        for label, m in rows:
            at = {int(x["depth"]): x for x in m.get("depths") or [] if isinstance(x, dict)}
            for test in ("tg", "pp"):
                cells = [f"{at[d][test]['avg_ts']:11.1f}" if test in at.get(d, {}) else f"{'-':>11}" for d in depths]
                out.append(f"{label if test == 'tg' else '':>5}  {test:<5}" + "".join(cells))
    if streams > 1:
        out.append(f"{'trial':>5}  {'tg t/s':>9} {'per stream':>10} {'TTFT ms':>9}")
        for label, m in rows:
            tg, one, ttft = (m.get(k) or {} for k in ("tg", "tg_stream", "ttft"))
            out.append(f"{label:>5}  {tg.get('avg_ts', 0):9.1f} {one.get('avg_ts', 0):10.1f} "
                       f"{ttft.get('avg_ms', 0):9.1f}")
    return out


def context_lines(result: ParetoDoc) -> list[str]:
    """With the context searched: the fastest decode of the front at each context, and what each larger one costs
    against the smallest."""
    best: dict[int, Entry] = {}
    for e in result.pareto:
        if e.n_ctx and e.ok and (e.n_ctx not in best or (e.speed("tg") or 0) > (best[e.n_ctx].speed("tg") or 0)):
            best[e.n_ctx] = e
    if not best:
        return []
    out = ["", "context: the front's fastest decode at each context, against the smallest's",
           f"{'ctx':>8}  {'trial':>5} {'tg t/s':>8} {'pp t/s':>9} {'VRAM MiB':>9}  tg× the smallest's [95 % CI]"]
    first = best[min(best)]
    first_rounds = round_avgs(first.measurement).get("tg") or []
    for n, e in sorted(best.items()):
        tg, tg0 = e.speed("tg") or 0.0, first.speed("tg") or 0.0
        rounds = round_avgs(e.measurement).get("tg") or []
        iv = ratio_interval(rounds, first_rounds) if len(rounds) == len(first_rounds) > 1 else None
        ratio = f"{iv[0]:.3f} [{iv[1]:.2f}–{iv[2]:.2f}]" if iv else f"{tg / tg0:.3f} (one round: no interval)"
        trade = "1" if e is first else f"{ratio} for +{n - (first.n_ctx or 0)} cells"
        label = "base" if e.phase == "baseline" else str(e.trial)
        out.append(f"{n:>8}  {label:>5} {tg:8.1f} {e.speed('pp') or 0.0:9.1f} {(e.vram_bytes or 0) / MIB:9.1f}  "
                   f"{trade}")
    return out


def verdict_lines(result: ParetoDoc) -> list[str]:
    """What each pick gains over llama.cpp's own choice, with the interval, or that it is a tie with it; where a tie
    made the pick another config than the fastest estimate, which one and why; and the drift monitor's note."""
    base = result.baseline
    out: list[str] = []
    by_trial = {e.trial: e for e in result.pareto}
    for policy in ("balanced", "max-decode", "max-prefill"):
        e = by_trial.get(result.picks.get(policy, -1))
        if e is None or not base.ok:
            continue
        top = fastest(list(result.pareto), policy)
        if e.phase == "baseline":
            line = f"{policy}: llama.cpp's own choice (the baseline)"
        else:
            gains = f"decode {_gain(e, 'tg')}, prefill {_gain(e, 'pp')} of llama.cpp's own choice"
            if base.trial in e.ties:
                mine, theirs = e.vram_bytes or 0, vram_bytes(base.measurement)
                line = (f"{policy}: trial {e.trial} is a tie with llama.cpp's own choice within noise ({gains})"
                        + (f"; it holds less VRAM ({mine / MIB:.1f} vs {theirs / MIB:.1f} MiB)" if mine < theirs
                           else ": keep llama.cpp's"))
            else:
                line = f"{policy}: trial {e.trial}: {gains}"
        if top is not e and top.phase != "baseline":  # a tie with the baseline is said above
            why = "less VRAM" if (e.vram_bytes or 0) < (top.vram_bytes or 0) else "llama.cpp's defaults"
            line += (f" — within noise of trial {top.trial}, the fastest estimate (decode {_gain(top, 'tg')}, "
                     f"prefill {_gain(top, 'pp')}); the tie went to {why}")
        out.append(line)
    note = (result.data.get("drift") or {}).get("note")
    if note:
        out.append(f"drift: {note}")
    return out


def _ratio(e: Entry, key: str) -> str:
    """A table cell: the ratio over the baseline and its 95 % interval, `1.121 [1.04–1.20]`."""
    x, iv = e.ratios.get(key), e.intervals.get(key)
    if x is None:
        return "-"
    return f"{x:.3f}" + (f" [{iv[0]:.2f}–{iv[1]:.2f}]" if iv else "")


def _gain(e: Entry, key: str) -> str:
    """In a sentence: `1.12× (95 % CI 1.04–1.20)`."""
    x, iv = e.ratios.get(key), e.intervals.get(key)
    if x is None:
        return "-"
    return f"{x:.2f}×" + (f" (95 % CI {iv[0]:.2f}–{iv[1]:.2f})" if iv else " (one round: no interval)")


def _short(flags: list[str]) -> list[str]:
    """The searched part of pinned flags, for the table (the export has them all)."""
    out = []
    for i, f in enumerate(flags):
        if f in SEARCHED and i + 1 < len(flags):
            out += [f, flags[i + 1]]
    return out


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
