"""TuneOptions for tests, from flat keywords: each goes to the group that has it (fitter.tune.options)."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from fitter.tune.options import MeasureOptions, SearchOptions, StorageOptions, TuneOptions

_GROUPS = {"search": SearchOptions, "measure": MeasureOptions, "storage": StorageOptions}


def tune_options(**kw: Any) -> TuneOptions:
    """`tune_options(model=…, spec=…, base=…, trials=4, backend="sim", results=…)`."""
    return with_options(TuneOptions(kw.pop("model"), kw.pop("spec"), kw.pop("base")), **kw)


def with_options(o: TuneOptions, **kw: Any) -> TuneOptions:
    """`o` with flat keywords changed in their groups (an unknown one is a TypeError, as dataclasses.replace's)."""
    top = {f.name for f in fields(TuneOptions)}
    changes: dict[str, Any] = {k: v for k, v in kw.items() if k in top}
    for group, cls in _GROUPS.items():
        mine = {k: v for k, v in kw.items() if k in {f.name for f in fields(cls)}}
        if mine:
            changes[group] = replace(getattr(o, group), **mine)
    unknown = set(kw) - set(changes) - {k for cls in _GROUPS.values() for k in (f.name for f in fields(cls))}
    if unknown:
        raise TypeError(f"no such tune option: {', '.join(sorted(unknown))}")
    return replace(o, **changes)
