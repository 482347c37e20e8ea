"""A trial's value of each objective the study optimizes (fitter.search.request OBJECTIVES), from its measurement."""

from __future__ import annotations

from typing import Any

from fitter.results.quality_record import QUALITY, quality_value
from fitter.units import MIB


def objective_value(measurement: dict[str, Any], objective: str, vram: int, n_ctx: int = 0,
                    quality: dict[str, Any] | None = None) -> float:
    """A trial's value of one objective: t/s measured, VRAM in MiB measured, the context its cache holds, or its KV
    class's measured KL divergence."""
    if objective == QUALITY:
        if quality is None:
            raise ValueError("the quality objective needs the trial's measured quality")
        return quality_value(quality)
    if objective == "vram":
        return round(vram / MIB, 3)
    if objective == "ctx":
        return float(n_ctx)
    if objective == "ttft":
        return float(measurement["ttft"]["avg_ms"])
    if objective == "tg-stream":
        return float(measurement["tg_stream"]["avg_ts"])
    return float(measurement[objective]["avg_ts"])
