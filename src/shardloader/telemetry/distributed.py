"""Loader statistics of all ranks, gathered for rank 0 to log.

In synchronous data-parallel training every step waits for the slowest rank, so besides sums
the combined view keeps the worst rank's stall fraction and fetch quantiles and names it.
Gathering uses `all_gather_object` on a gloo group (created once if the default group is not
gloo, e.g. NCCL), so it never moves Python objects through the accelerator's collectives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardloader.runtime.distenv import process_group_active
from shardloader.telemetry.records import SUMMARY_KEYS

_GLOO_GROUP: Any = None

#: Summed over ranks: the batch count, every metric's total (not a level's mean: a mean of
#: means is no sum) and the rates.
_SUMMED = (
    "batches", *(key for name, key in SUMMARY_KEYS.items() if key != f"{name}_mean"),
    "samples_per_second", "samples_per_second_window",
)
_MAXED = (
    "fetch_seconds_max", "fetch_seconds_p50", "fetch_seconds_p95", "fetch_seconds_p99",
    "stall_fraction", "stall_fraction_window", "wall_seconds",
)


def _gloo_group() -> Any:
    import torch.distributed as dist

    global _GLOO_GROUP
    if dist.get_backend() == "gloo":
        return None  # the default group already is gloo
    if _GLOO_GROUP is None:
        _GLOO_GROUP = dist.new_group(backend="gloo")
    return _GLOO_GROUP


def aggregate_across_ranks(summary: Mapping[str, float], group: Any = None) -> dict[str, Any]:
    """Gather every rank's `StatsAggregator.summary()`; every rank gets the combined result.

    A collective: all ranks of `group` must call it. Without torch.distributed initialised it
    returns the combination of this one summary. Result: {"world_size", "per_rank",
    "combined"} where "combined" is a flat dict of numbers (see `combine_summaries`).
    """
    import torch.distributed as dist

    if not process_group_active():
        return combine_summaries([dict(summary)])
    if group is None:
        group = _gloo_group()
    per_rank: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, dict(summary), group=group)
    return combine_summaries(per_rank)


def combine_summaries(per_rank: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """Pure: combine per-rank summaries (index = rank).

    "combined" holds sums of counts and totals, the maximum over ranks of the quantiles and
    stall fractions (`worst_rank_fetch_seconds_p99`, `worst_rank_stall_fraction`, ...) and of
    the wall time, the mean stall fraction, the slowest rank (highest stall fraction), and the pooled cache hit ratio.
    """
    if not per_rank:
        raise ValueError("combine_summaries needs at least one rank's summary")
    combined: dict[str, float] = {"world_size": len(per_rank)}
    for key in _SUMMED:
        combined[key] = sum(float(s.get(key, 0.0)) for s in per_rank)
    for key in _MAXED:
        name = key if key == "wall_seconds" else f"worst_rank_{key}"
        combined[name] = max(float(s.get(key, 0.0)) for s in per_rank)
    stalls = [float(s.get("stall_fraction", 0.0)) for s in per_rank]
    combined["stall_fraction_mean"] = sum(stalls) / len(stalls)
    combined["slowest_rank"] = max(range(len(stalls)), key=lambda r: (stalls[r], -r))
    lookups = combined["cache_hits"] + combined["cache_misses"]
    if lookups:
        combined["cache_hit_ratio"] = combined["cache_hits"] / lookups
    return {"world_size": len(per_rank), "per_rank": [dict(s) for s in per_rank],
            "combined": combined}
