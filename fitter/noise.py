"""Noise between runs: confidence intervals of speed ratios from interleaved confirm rounds, and ties.

On a shared or throttled machine the spread between runs of one config is far larger than the spread inside a run
(the demo model six times: decode 260-408 t/s, each run's own stddev 2-15 %), so the repetitions of one run say
little about whether two configs differ. The confirm runs are interleaved rounds (every candidate once per round,
a fresh order each round, fitter.tune.confirm), so a round is a block: slow drift moves every config of a round
alike, and the ratio of two configs *within* a round cancels it.

The interval of a ratio a/b is Student's t over the rounds' paired log ratios, ln(a_k / b_k): the point is the
geometric mean of the per-round ratios, exp(mean), and the 95 % interval exp(mean ± t(0.975, R−1)·sd/√R). Why
not a bootstrap over rounds: with 3-5 rounds a bootstrap has 10-126 distinct resamples and its percentile interval
is too narrow (it undercovers at small R); the t interval is the standard one for a paired mean and is honest
(wide) at R = 3. One round gives no interval: nothing can be said about noise, so nothing is called a tie.

One hiccup (a run at a third of its config's speed while the rest of its round ran normally, seen on the emulated
GPU) would otherwise widen a pair's interval until the config ties with everything. So a paired log ratio beyond
3 scaled MADs of the rounds' median (Hampel's identifier, 3 × 1.4826 × MAD; three rounds or more, MAD > 0) is
clipped to that bound before the interval: a winsorised t interval. Rounds within the bound are left as they are.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

SPEEDS = ("tg", "pp")
LEVEL = 0.95
# Student's t, two-sided 95 % (the 0.975 quantile), by degrees of freedom 1-30; beyond, the normal's 1.96 is within
# 2 % of t. A table, not scipy: fitter needs these 30 numbers, not a 40 MB dependency.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (df ≥ 1)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def ratio_interval(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float] | None:
    """(point, low, high) of the ratio a/b from per-round values paired by round; None with fewer than two rounds
    or a non-positive value (a failed or empty measurement has no ratio)."""
    if len(a) != len(b):
        raise ValueError(f"paired rounds differ in number: {len(a)} and {len(b)}")
    if len(a) < 2 or any(x <= 0 for x in (*a, *b)):
        return None
    logs = hampel_clipped([math.log(x / y) for x, y in zip(a, b, strict=True)])
    mean = statistics.fmean(logs)
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def hampel_clipped(values: Sequence[float], k: float = 3.0) -> list[float]:
    """`values` with any beyond k scaled MADs of their median clipped to that bound (1.4826 × MAD estimates the
    standard deviation of normal data); unchanged below three values or when the MAD is 0."""
    if len(values) < 3:
        return list(values)
    med = statistics.median(values)
    mad = statistics.median(abs(x - med) for x in values)
    if mad <= 0:
        return list(values)
    bound = k * 1.4826 * mad
    return [min(max(x, med - bound), med + bound) for x in values]


def tied(a: Mapping[str, Sequence[float]], b: Mapping[str, Sequence[float]], speeds: Sequence[str] = SPEEDS) -> bool:
    """Two configs cannot be told apart: for every speed in `speeds` both were measured in the same rounds and the
    interval of their ratio contains 1. Without an interval (one round) nothing is a tie."""
    for key in speeds:
        if key not in a or key not in b:
            continue
        iv = ratio_interval(a[key], b[key])
        if iv is None or not iv[1] <= 1.0 <= iv[2]:
            return False
    return any(key in a and key in b for key in speeds)


def better_beyond_noise(a: Sequence[float], b: Sequence[float]) -> bool:
    """a is faster than b beyond noise: the whole interval of a/b lies above 1."""
    iv = ratio_interval(a, b)
    return iv is not None and iv[1] > 1.0


def relative_spread(values: Sequence[float]) -> float:
    """(max − min) / mean of a few measurements of one config: how far it moved (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    mean = statistics.fmean(values)
    return (max(values) - min(values)) / mean if mean > 0 else 0.0


def between_run_sd(values: Sequence[float]) -> float:
    """The standard deviation of one config's per-round averages: its noise between runs (0 for one round)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0
