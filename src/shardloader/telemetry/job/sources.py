"""A mixture's figures per source in the job's account (issue 38: "per source in the job
account").

A `Mixture`'s batches say what each named source cost them (`Mixture.by_source()`: samples,
read seconds, shard wait seconds, bytes downloaded; `Loader.stats()` has the same as
`source.<name>.<figure>`). The training process's attempt adds them up per rank
(`AttemptRecorder.add_sources`) and writes the running totals as a "sources" event at each
epoch's end, each save and the attempt's end::

    {"event": "sources", "time": ..., "figures": {"web": {"samples": 4096.0, ...}, ...}}

The counters file holds fixed fields only, so these totals are as of a rank's last such event:
a rank killed mid-epoch loses what its sources did since its last save (the steps it lost
too). The account (`sources_total`) adds each rank's last event over every attempt and rank,
so samples read twice after a kill count twice, as the bytes read again do.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

#: The figures kept per source (`shardloader.loader.mixture.SOURCE_FIGURES`).
FIGURES = ("samples", "read_seconds", "shard_wait_seconds", "bytes_downloaded")


def add_figures(totals: dict[str, dict[str, float]], figures: Mapping[str, Mapping[str, float]]) -> None:
    """Add one batch's figures per source to running `totals` (in place)."""
    for name, values in figures.items():
        sums = totals.setdefault(str(name), dict.fromkeys(FIGURES, 0.0))
        for figure in FIGURES:
            sums[figure] += float(values.get(figure, 0.0))


def parse_sources(where: str, raw: Any) -> dict[str, dict[str, float]]:
    """A "sources" event's `figures`, validated: a ValueError names `where` and the field."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: field 'figures': expected an object, got {type(raw).__name__}")
    out: dict[str, dict[str, float]] = {}
    for name, values in raw.items():
        at = f"{where}: field 'figures.{name}'"
        if not isinstance(values, Mapping):
            raise ValueError(f"{at}: expected an object, got {type(values).__name__}")
        out[str(name)] = {}
        for figure in FIGURES:
            value = values.get(figure, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{at}.{figure}: expected a number >= 0, got {value!r}")
            out[str(name)][figure] = float(value)
    return out


def sources_total(per_rank: Iterable[Mapping[str, Mapping[str, float]]]) -> dict[str, dict[str, float]]:
    """The job's figures per source: the sum of every rank's (of every attempt) last totals.
    Empty for a job that read no mixture."""
    totals: dict[str, dict[str, float]] = {}
    for figures in per_rank:
        add_figures(totals, figures)
    return {name: totals[name] for name in sorted(totals)}


def source_lines(sources: Mapping[str, Mapping[str, float]], fmt_bytes: Any) -> list[str]:
    """The report's "sources" rows (none for a job that read no mixture)."""
    if not sources:
        return []
    width = max(len(name) for name in sources)
    lines = [f"sources            {'':<{width}} {'samples':>12} {'shard wait':>11} {'read':>9} {'bytes':>10}"]
    for name, f in sources.items():
        lines.append(f"  {name:<{width + 17}} {int(f['samples']):>12,} {f['shard_wait_seconds']:>10.1f}s "
                     f"{f['read_seconds']:>8.1f}s {fmt_bytes(f['bytes_downloaded']):>10}")
    return lines
