"""`fitter bench`: one measurement as CONTRACTS.md shapes it, every logged buffer beside fitter's estimate.

The measurement comes from fitter's worker (llama-cpp-python) or the user's own llama-server; the estimate is
the pure estimator's for the same flags and devices. Peak device memory is the device's own count (the emulated
GPU's cap counter), never the estimate.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fitter.measure.types import Measurement
from fitter.memory.plan.estimator import MemoryPlan
from fitter.memory.plan.projected import projected_on
from fitter.units import MIB

NOISY = 0.10  # stddev / avg above which a speed is flagged noisy


def _device_of(buft: str, device_names: set[str]) -> str:
    return buft if buft in device_names else "CPU"


def bench_json(
    m: Measurement, backend: str, plan: MemoryPlan | None, emulated: bool, peak_vram: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    out = m.to_json()
    out["backend"] = backend
    out["emulated"] = emulated
    for test in ("pp", "tg"):
        if test in out:
            s = out[test]
            s["noisy"] = bool(s["avg_ts"] and s["stddev_ts"] / s["avg_ts"] > NOISY)
    names = {d.name for d in plan.devices} if plan is not None else set()
    # the estimate's buffers, matched in order within each (buffer type, kind), each with where its number comes
    # from: fitter's rules, llama.cpp's own projection (the kinds fitter has no rules for), or fitter's guess of them
    estimated: dict[tuple[str, str], list[tuple[int, str]]] = defaultdict(list)
    if plan is not None:
        guessed = projected_on(plan.model, plan.devices)
        for eb in plan.buffers:
            origin = ("fitter" if eb.kind not in guessed.get(eb.device, ()) else
                      "projection" if eb.kind in plan.projected else "guess")
            estimated[(eb.buft, eb.kind)].append((eb.bytes, origin))
    taken: dict[tuple[str, str], int] = defaultdict(int)
    buffers = []
    devices: dict[str, dict[str, int]] = {}
    for lb in m.buffers:
        key = (lb.buft, lb.kind)
        i = taken[key]
        taken[key] += 1
        match: tuple[int | None, str | None] = estimated[key][i] if i < len(estimated[key]) else (None, None)
        est, source = match
        logged = round(lb.mib * MIB)
        buffers.append({"buft": lb.buft, "kind": lb.kind, "bytes": logged, "estimated_bytes": est,
                        "estimated_from": source})
        dev = devices.setdefault(_device_of(lb.buft, names), {"model": 0, "kv": 0, "compute": 0, "output": 0})
        dev[lb.kind] += logged
    out["buffers"] = buffers
    totals = plan.totals() if plan is not None else {}
    out["devices"] = {
        name: {**d, "total": sum(d.values()), "estimated_total": totals[name].total if name in totals else None}
        for name, d in devices.items()
    }
    out["peak_vram"] = peak_vram
    for name, peak in peak_vram.items():  # what NVML saw beyond llama.cpp's buffers (fitter.memory.backends.overhead)
        if peak.get("source") == "nvml" and name in out["devices"]:
            out["devices"][name]["overhead"] = max(0, int(peak["bytes"]) - int(out["devices"][name]["total"]))
    return out


_MARKS = {"projection": "projected", "guess": "guessed"}  # beside an estimate not from fitter's own rules


def bench_table(result: dict[str, Any]) -> str:
    lines = []
    if result["emulated"] and result.get("emulated_gpu") == "vulkan":
        lines.append("device: emulated Vulkan GPU (llama.cpp's Vulkan backend on Mesa's lavapipe, capped): its speed "
                     "is a software driver's, below the CPU backend's")
    elif result["emulated"]:
        shape = ", CUDA-shaped" if result.get("emulated_gpu") == "cuda" else ""
        lines.append(f"device: emulated GPU (a capped llama.cpp RPC device on 127.0.0.1{shape}): its speed is CPU "
                     "speed")
    lines.append(f"backend {result['backend']}  outcome {result['outcome']}"
                 + (f": {result['reason']}" if result["reason"] else ""))
    w = result.get("workload") or {}
    depths = ",".join(map(str, w.get("depths") or []))
    streams = int(w.get("concurrency") or 1)
    for key, label in (("pp", "prefill"), ("tg", "decode"), ("tg_stream", "/stream")):
        if key in result:
            s = result[key]
            where = (f"over depths {depths}" if "," in depths else f"at depth {s['depth']}") + (
                f", {streams} streams{' aggregate' if key != 'tg_stream' else ''}" if streams > 1 else "")
            if key == "tg" and (prompts := w.get("prompts")):
                where = f"after each of {prompts['count']} prompts of {prompts['file']}"
            lines.append(f"{label:<8} {s['avg_ts']:10.2f} ± {s['stddev_ts']:.2f} t/s  ({s['n']} tokens {where}, "
                         f"{len(s['samples_ts'])} runs{', NOISY' if s.get('noisy') else ''})")
    if "ttft" in result:
        lines.append(f"{'TTFT':<8} {result['ttft']['avg_ms']:10.2f} ± {result['ttft']['stddev_ms']:.2f} ms  (first "
                     f"token of {streams} prompts sent at once)")
    if "draft" in result:
        d = result["draft"]
        lines.append(f"{'draft':<8} {d['accepted']} of {d['drafted']} drafted tokens accepted"
                     + (f" ({d['acceptance']:.1%})" if d["acceptance"] is not None else ""))
    if "," in depths:
        for d in result.get("depths") or []:
            cells = "   ".join(f"{k} {d[k]['avg_ts']:.2f} t/s" for k in ("pp", "tg", "tg_stream") if k in d)
            lines.append(f"  depth {d['depth']:>6}: {cells}")
    lines += ["", f"{'buffer':<28}{'kind':<9}{'MiB':>10}{'estimate':>10}"]
    sources = set()
    for b in result["buffers"]:
        est = f"{b['estimated_bytes'] / MIB:10.2f}" if b["estimated_bytes"] is not None else f"{'-':>10}"
        source = b.get("estimated_from")
        mark = f"  {_MARKS[source]}" if source in _MARKS else ""
        sources.add(source)
        lines.append(f"{b['buft']:<28}{b['kind']:<9}{b['bytes'] / MIB:10.2f}{est}{mark}".rstrip())
    if "projection" in sources:
        lines.append(f"{_MARKS['projection']}: llama.cpp's own projection ({result['projection']['source']}), its "
                     "floored MiB rounded up: fitter has no rules for it")
    if "guess" in sources:
        lines.append(f"{_MARKS['guess']}: fitter's guess (the warning above says what it guessed)")
    for name, peak in result["peak_vram"].items():
        lines.append(f"peak on {name}: {peak['bytes'] / MIB:.2f} MiB ({peak['source']})")
    if result.get("peak_rss"):
        lines.append(f"peak RSS {result['peak_rss'] / MIB:.1f} MiB")
    return "\n".join(lines)
