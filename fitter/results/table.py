"""The one Pareto table: a result's front as rows (`Front`: the baseline, then each configuration with its picks,
speeds, VRAM, ratios over the baseline with their 95 % intervals, ties and flags), printed by `fitter tune` and
`fitter report` alike and written to report's pareto.csv; and the sections `fitter tune` prints after it (the
workload's depths and streams, the context's trade, the verdicts)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fitter.flags.vocabulary import SEARCHED, SEARCHED_SWITCHES
from fitter.noise import ratio_interval
from fitter.results.pareto import Entry, ParetoDoc, fastest
from fitter.results.quality_record import QUALITY, kv_note, kv_of_flags
from fitter.units import MIB

BASE = "base"  # the baseline's row label (llama.cpp's own --fit choice)
PARETO_COLUMNS = ("trial", "phase", "picks", "pp_ts", "tg_ts", "vram_mib", "pp_ratio", "tg_ratio", "pp_ci_low",
                  "pp_ci_high", "tg_ci_low", "tg_ci_high", "ties", "flags", "kv", "kld", "kld_ci_low", "kld_ci_high")


@dataclass(frozen=True)
class FrontRow:
    """One row of the table: the baseline (trial "base") or a configuration of the front."""

    trial: int | str
    phase: str | None
    picks: tuple[str, ...]
    pp_ts: float | None
    tg_ts: float | None
    vram_mib: float | None  # as measured (the CSV rounds it to 0.01)
    n_ctx: int | None
    ratios: dict[str, float | None]
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    ties: tuple[int, ...] = ()
    flags: tuple[str, ...] = ()
    quality: dict[str, Any] | None = None  # its KV class's measured quality (fitter.results.quality_record)

    def record(self) -> dict[str, Any]:
        """The row as pareto.csv and `fitter report --json` write it (PARETO_COLUMNS)."""
        iv, q = self.intervals, self.quality
        return {"trial": self.trial, "phase": self.phase, "picks": ",".join(self.picks), "pp_ts": self.pp_ts,
                "tg_ts": self.tg_ts, "vram_mib": round(self.vram_mib, 2) if self.vram_mib is not None else None,
                "pp_ratio": self.ratios.get("pp"),
                "tg_ratio": self.ratios.get("tg"), "pp_ci_low": iv["pp"][0] if "pp" in iv else None,
                "pp_ci_high": iv["pp"][1] if "pp" in iv else None, "tg_ci_low": iv["tg"][0] if "tg" in iv else None,
                "tg_ci_high": iv["tg"][1] if "tg" in iv else None, "ties": " ".join(map(str, self.ties)),
                "flags": " ".join(self.flags), "kv": kv_of_flags(self.flags) if self.flags else None,
                "kld": q["kld"] if q else None, "kld_ci_low": q["kld_interval"][0] if q else None,
                "kld_ci_high": q["kld_interval"][1] if q else None}


@dataclass(frozen=True)
class Front:
    """The Pareto front with the baseline as rows; `source` says where it came from."""

    rows: list[FrontRow]  # the baseline first (trial "base") when it ran, then the front by trial number
    source: str  # "pareto.json" (confirm runs) | "study" (single trial measurements of a running study)
    dropped: list[dict[str, Any]] = field(default_factory=list)
    baseline_trial: int | None = None  # the baseline's trial number (a tie with it reads "base")
    baseline_note: str | None = None  # why the baseline has no row: its outcome or the reason it did not run

    @property
    def records(self) -> list[dict[str, Any]]:
        return [r.record() for r in self.rows]


def front_of(doc: ParetoDoc) -> Front:
    """A result's front: its confirm runs."""
    return front_of_entries(doc.baseline, doc.pareto, doc.picks, "pareto.json", doc.dropped)


def front_of_entries(baseline: Entry | None, entries: Sequence[Entry], picks: dict[str, int], source: str,
                     dropped: Sequence[dict[str, Any]] = ()) -> Front:
    """The rows of `entries` (their ratios as the entries hold them) after the baseline's, when it was measured."""
    by_trial: dict[int, list[str]] = {}
    for name, n in picks.items():
        by_trial.setdefault(n, []).append(name)
    rows, note = [], None
    m = baseline.measurement if baseline is not None else None
    if baseline is not None and m is not None and m.ok and m.speed("tg") is not None:
        rows.append(FrontRow(BASE, "baseline", (), m.speed("pp"), m.speed("tg"), _mib(m.vram_bytes), baseline.n_ctx,
                             {"pp": 1.0, "tg": 1.0}, flags=tuple(baseline.flags or ()), quality=baseline.quality))
    elif baseline is not None and (baseline.flags or baseline.data.get("reason") or (m is not None and m.data)):
        note = str((m.outcome if m is not None else None) or baseline.data.get("reason"))
    for e in entries:
        rows.append(FrontRow(e.trial if e.trial is not None else "?", e.phase, tuple(by_trial.get(e.trial or -1, [])),
                             e.speed("pp"), e.speed("tg"), _mib(e.vram_bytes), e.n_ctx, dict(e.ratios),
                             dict(e.intervals), e.ties, tuple(e.flags or ()), e.quality))
    return Front(rows, source, list(dropped), baseline.trial if baseline is not None else None, note)


def front_lines(front: Front, ctx: bool = False, quality: bool = False) -> list[str]:
    """The table: a header, the baseline's row (all its flags: llama.cpp's fit chose them), each configuration's
    (its searched flags), what the confirm runs dropped. `ctx`: the context searched, a column of its own; `quality`:
    measured, the KV class's mean KL divergence from f16 (fitter.results.quality_record) is one too."""
    lines = [f"{'trial':>5}  {'pp t/s':>9} {'tg t/s':>8} {'VRAM MiB':>9}" + (f" {'ctx':>7}" if ctx else "")
             + (f" {'KLD':>9}" if quality else "")
             + f"  {'pp× [95 % CI]':<20} {'tg× [95 % CI]':<20} picks / flags"]
    if front.baseline_note is not None:
        lines.append(f"{BASE:>5}  llama.cpp --fit: {front.baseline_note}")
    for r in front.rows:
        ctx_cell = (f" {r.n_ctx or '-':>7}" if ctx else "") + (f" {_kld(r):>9}" if quality else "")
        if r.trial == BASE:  # the ratios' unit
            lines.append(f"{BASE:>5}  {_num(r.pp_ts, 9)} {_num(r.tg_ts, 8)} {_num(r.vram_mib, 9)}{ctx_cell}  "
                         f"{'1':<20} {'1':<20} llama.cpp --fit: " + " ".join(r.flags))
            continue
        cells = (f"{r.trial!s:>5}  {_num(r.pp_ts, 9)} {_num(r.tg_ts, 8)} {_num(r.vram_mib, 9)}{ctx_cell}  "
                 f"{_ratio(r, 'pp'):<20} {_ratio(r, 'tg'):<20} ")
        ties = (f" (tie: {', '.join(BASE if t == front.baseline_trial else str(t) for t in r.ties)})"
                if r.ties else "")
        lines.append(cells + f"{','.join(r.picks) or '-'}{ties}: "
                     + ("llama.cpp --fit (the baseline) " if r.phase == "baseline" else "")
                     + " ".join(searched_part(list(r.flags))))
    for d in front.dropped:
        if d.get("outcome") == "dominated":
            lines.append(f"{d.get('trial')!s:>5}  dropped: {d.get('reason')}")
        else:
            lines.append(f"{d.get('trial')!s:>5}  dropped: its confirm run ended {d.get('outcome')}: "
                         f"{d.get('reason')}")
    return lines


def pareto_table(result: ParetoDoc) -> str:
    """The result as `fitter tune` prints it: the table, the workload's and the context's sections, the study's
    counts, and what each pick gains over llama.cpp's own choice (with the drift monitor's note)."""
    doc = result.data
    ctx = "ctx" in result.objectives  # the context searched (--min-ctx): a column of its own
    lines = front_lines(front_of(result), ctx, QUALITY in result.objectives)
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


def searched_part(flags: list[str]) -> list[str]:
    """The searched part of pinned flags, for the table (the export has them all: context, slots and --rpc are the
    same in every trial)."""
    out = []
    for i, f in enumerate(flags):
        if f in SEARCHED and i + 1 < len(flags):
            out += [f, flags[i + 1]]
        elif f in SEARCHED_SWITCHES:
            out.append(f)
    return out


def _num(x: float | None, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.1f}"


def _mib(b: int | None) -> float | None:
    return b / MIB if b is not None else None


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
    bm = result.baseline.measurement.data if result.baseline.measurement is not None else None
    if bm and bm.get("outcome") == "ok":
        rows.append(("base", bm))
    rows += [(str(e.trial), e.measurement.data) for e in result.pareto if e.measurement and e.phase != "baseline"]
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
    first_rounds = first.rounds.get("tg") or []
    for n, e in sorted(best.items()):
        tg, tg0 = e.speed("tg") or 0.0, first.speed("tg") or 0.0
        rounds = e.rounds.get("tg") or []
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
                mine, theirs = e.vram_bytes or 0, base.measurement.vram_bytes if base.measurement else 0
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
    out += kv_lines(result)
    note = (result.data.get("drift") or {}).get("note")
    if note:
        out.append(f"drift: {note}")
    return out


def kv_lines(result: ParetoDoc) -> list[str]:
    """What each pick's KV cache types cost in quality (measured with --objectives ...,quality, else said not to be)
    and save in memory; nothing for picks with llama.cpp's default f16 cache."""
    by_trial = {e.trial: e for e in result.pareto}
    names: dict[int, list[str]] = {}
    for policy, trial in result.picks.items():
        names.setdefault(trial, []).append(policy)
    out = []
    for trial, policies in names.items():
        e = by_trial.get(trial)
        if e is None or not e.flags:
            continue
        note = kv_note(kv_of_flags(e.flags), e.quality, e.kv_bytes)
        if note is not None:
            out.append(f"{', '.join(policies)} (trial {trial}): {note}")
    return out


def _kld(r: FrontRow) -> str:
    return f"{max(float(r.quality['kld']), 0.0):.4g}" if r.quality else "-"  # llama.cpp's -0.000000 reads 0


def _ratio(r: FrontRow, key: str) -> str:
    """A table cell: the ratio over the baseline and its 95 % interval, `1.121 [1.04–1.20]`."""
    x, iv = r.ratios.get(key), r.intervals.get(key)
    if x is None:
        return "-"
    return f"{x:.3f}" + (f" [{iv[0]:.2f}–{iv[1]:.2f}]" if iv else "")


def _gain(e: Entry, key: str) -> str:
    """In a sentence: `1.12× (95 % CI 1.04–1.20)`."""
    x, iv = e.ratios.get(key), e.intervals.get(key)
    if x is None:
        return "-"
    return f"{x:.2f}×" + (f" (95 % CI {iv[0]:.2f}–{iv[1]:.2f})" if iv else " (one round: no interval)")
