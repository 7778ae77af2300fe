"""Where the time went: the pure analysis of a run's batch records, with its recommendations.

`analyse(records)` is a pure function from batch records to a report dict: wall time, time
waiting for data, fetch_seconds quantiles, the slowest batches, the dominant cause and
concrete recommendations. `shardloader.telemetry.render` formats the report and plots the
records; `shardloader.telemetry.history` reads records back from JSONL files and MLflow runs.

How the cause is decided. The first `warmup_steps` batches (worker start-up, first download)
are reported but left out of the diagnosis. If, after them, the loop waited less than
`none_threshold` of wall time, the cause is "none". Otherwise every batch the loop waited for
(fetch_seconds > `stall_seconds`) lends its waiting time to the worker-side costs of that
batch in proportion: shard wait and row reads to "storage", decode + augment to "decode".
The larger share is the dominant cause. If no worker timings were recorded, it is "unknown".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from shardloader.telemetry.records import (
    LOGGABLE_FIELDS,
    BatchRecord,
    TelemetryInputError,
)

CAUSES = ("storage", "decode", "none", "unknown")
_WORKER_FIELDS = ("read_seconds", "transform_seconds", "shard_wait_seconds")


def analyse(
    records: Sequence[BatchRecord],
    *,
    fields: Collection[str] | None = None,
    extra: Mapping[str, Sequence[tuple[int, float]]] | None = None,
    warmup_steps: int = 1,
    top_k: int = 5,
    none_threshold: float = 0.05,
    stall_seconds: float = 0.001,
) -> dict[str, Any]:
    """The report of `records` (any order; analysed in delivery-time order).

    `fields` names the record fields that were really recorded (None: all); a field that was
    not (e.g. not logged to MLflow) is reported as unknown rather than as zero. `extra` holds
    other per-step series, such as gpu_idle_seconds: {name: [(step, value), ...]}.
    """
    if not records:
        raise TelemetryInputError("no batch records to analyse")
    known = set(LOGGABLE_FIELDS if fields is None else fields)
    if "fetch_seconds" not in known:
        raise TelemetryInputError("the records lack fetch_seconds; nothing to analyse")
    ordered = sorted(records, key=lambda r: r.time)  # stable: ties keep the given order
    n = len(ordered)
    fetch = np.array([r.fetch_seconds for r in ordered], dtype=np.float64)
    times = np.array([r.time for r in ordered], dtype=np.float64)
    steps = [r.step for r in ordered]
    sampled_every = _sampling_interval(steps)
    # When only every k-th step was logged, each record stands for the steps up to the next
    # one: scale sums by steps covered / records (1 for complete histories).
    scale = _steps_covered(steps) / n

    wall = max(float(times[-1] - (times[0] - fetch[0])), 0.0)
    wait = min(float(fetch.sum()) * scale, wall) if wall > 0 else float(fetch.sum())
    warm = min(max(warmup_steps, 0), n - 1)
    steady = ordered[warm:]
    steady_fetch = fetch[warm:]
    steady_wall = max(float(times[-1] - (times[warm] - fetch[warm])), 0.0)
    steady_wait = float(steady_fetch.sum()) * _steps_covered(steps[warm:]) / len(steady)
    steady_fraction = min(steady_wait / steady_wall, 1.0) if steady_wall > 0 else 0.0
    samples = round(sum(r.samples for r in ordered) * scale)

    report: dict[str, Any] = {
        "steps": n,
        "first_step": steps[0],
        "last_step": steps[-1],
        "sampled_every": sampled_every,
        "epochs": sorted({r.epoch for r in ordered}) if "epoch" in known else None,
        "ranks": sorted({r.rank for r in ordered}),
        "wall_seconds": wall,
        "data_wait_seconds": wait,
        "data_wait_fraction": min(wait / wall, 1.0) if wall > 0 else 0.0,
        "warmup_steps": warm,
        "steady_data_wait_seconds": steady_wait,
        "steady_data_wait_fraction": steady_fraction,
        "samples": samples if "samples" in known else None,
        "samples_per_second": samples / wall if wall > 0 and "samples" in known else None,
        "fetch_seconds": {
            "mean": float(fetch.mean()),
            "p50": float(np.percentile(fetch, 50)),
            "p95": float(np.percentile(fetch, 95)),
            "p99": float(np.percentile(fetch, 99)),
            "max": float(fetch.max()),
            "max_step": steps[int(fetch.argmax())],
        },
        "slowest": _slowest(ordered, fetch, top_k, known),
        "worker_seconds_per_batch": {
            name: (float(np.mean([getattr(r, name) for r in steady])) if name in known else None)
            for name in _WORKER_FIELDS
        },
        "step_seconds": _step_seconds(steady, sampled_every),
        "cache": _cache(ordered, known),
        "extra": {
            name: _series_summary(values) for name, values in (extra or {}).items() if values
        },
    }
    attribution = _attribute(steady, steady_fetch, known, stall_seconds)
    report["attributed_data_wait_seconds"] = attribution
    report["cause"] = _cause(steady_fraction, attribution, none_threshold, known)
    report["recommendations"] = _recommend(report)
    return report


def _sampling_interval(steps: Sequence[int]) -> int:
    """1 for every step; k when only every k-th step was logged (median positive gap)."""
    gaps = [b - a for a, b in pairwise(steps) if b > a]
    if not gaps:
        return 1
    return max(1, int(statistics.median(gaps)))


def _steps_covered(steps: Sequence[int]) -> int:
    """Training steps spanned by logged `steps` (a repeat or a step back after resume: 1)."""
    return 1 + sum(b - a if b > a else 1 for a, b in pairwise(steps))


def _slowest(ordered: Sequence[BatchRecord], fetch: np.ndarray, top_k: int,
             known: Collection[str]) -> list[dict[str, Any]]:
    order = sorted(range(len(ordered)), key=lambda i: (-fetch[i], i))[:top_k]
    out = []
    for i in order:
        r = ordered[i]
        row: dict[str, Any] = {"step": r.step, "epoch": r.epoch, "fetch_seconds": r.fetch_seconds}
        for name in (*_WORKER_FIELDS, "queue_depth"):
            row[name] = getattr(r, name) if name in known else None
        out.append(row)
    return out


def _step_seconds(steady: Sequence[BatchRecord], sampled_every: int) -> float | None:
    """Median time the loop spent outside next(loader) per step (its compute), if measurable."""
    if sampled_every != 1 or len(steady) < 2:
        return None
    gaps = [
        (b.time - a.time) - b.fetch_seconds
        for a, b in pairwise(steady)
        if b.step == a.step + 1
    ]
    if not gaps:
        return None
    return max(float(statistics.median(gaps)), 0.0)


def _cache(ordered: Sequence[BatchRecord], known: Collection[str]) -> dict[str, Any] | None:
    if not {"cache_hits", "cache_misses"} <= set(known):
        return None
    hits = sum(r.cache_hits for r in ordered)
    misses = sum(r.cache_misses for r in ordered)
    out: dict[str, Any] = {
        "hits": hits,
        "misses": misses,
        "hit_ratio": hits / (hits + misses) if hits + misses else None,
        "bytes_downloaded": (
            sum(r.bytes_downloaded for r in ordered) if "bytes_downloaded" in known else None
        ),
    }
    if "epoch" in known:
        first_epoch = min(r.epoch for r in ordered)
        later = [r for r in ordered if r.epoch > first_epoch]
        if later:
            later_hits = sum(r.cache_hits for r in later)
            later_total = later_hits + sum(r.cache_misses for r in later)
            out["later_epochs_hit_ratio"] = later_hits / later_total if later_total else None
    return out


def _series_summary(values: Sequence[tuple[int, float]]) -> dict[str, float]:
    array = np.array([v for _, v in values], dtype=np.float64)
    return {"count": int(array.size), "total": float(array.sum()), "mean": float(array.mean()),
            "p95": float(np.percentile(array, 95)), "max": float(array.max())}


def _attribute(steady: Sequence[BatchRecord], steady_fetch: np.ndarray, known: Collection[str],
               stall_seconds: float) -> dict[str, float]:
    """Split the steady-state waiting time between storage and decode (see module doc)."""
    storage_known = bool({"shard_wait_seconds", "read_seconds"} & set(known))
    decode_known = "transform_seconds" in known
    storage = decode = unexplained = 0.0
    for record, waited in zip(steady, steady_fetch, strict=True):
        if waited <= stall_seconds:
            continue
        s = (record.shard_wait_seconds + record.read_seconds) if storage_known else 0.0
        d = record.transform_seconds if decode_known else 0.0
        if s + d <= 0:
            unexplained += waited
            continue
        storage += waited * s / (s + d)
        decode += waited * d / (s + d)
    return {"storage": storage, "decode": decode, "unexplained": unexplained}


def _cause(steady_fraction: float, attribution: Mapping[str, float], none_threshold: float,
           known: Collection[str]) -> str:
    if steady_fraction < none_threshold:
        return "none"
    if not set(_WORKER_FIELDS) & set(known):
        return "unknown"
    if attribution["storage"] == attribution["decode"] == 0.0:
        return "unknown"
    return "storage" if attribution["storage"] >= attribution["decode"] else "decode"


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1000:.1f} ms"


def _recommend(report: Mapping[str, Any]) -> list[str]:
    cause = report["cause"]
    fraction = report["steady_data_wait_fraction"]
    per_batch = report["worker_seconds_per_batch"]
    step = report["step_seconds"]
    cache = report["cache"] or {}
    out: list[str] = []
    if cause == "none":
        out.append(
            f"The input pipeline keeps up: after warm-up the loop waited {fraction:.1%} of wall "
            "time for data. No change needed."
        )
        return out
    if cause == "unknown":
        out.append(
            f"The loop waited {fraction:.1%} of wall time for data, but no worker timings were "
            "recorded; log read/transform/shard_wait seconds to find the cause."
        )
        return out
    if cause == "storage":
        download = per_batch.get("shard_wait_seconds") or 0.0
        read = per_batch.get("read_seconds") or 0.0
        if download >= read:
            out.append(
                f"Storage is the bottleneck: workers waited {_ms(download)} per batch for shards "
                f"to arrive in the cache (the loop waited {fraction:.1%} of wall time). Enlarge "
                "the prefetch window so downloads start further ahead of use."
            )
            ratio = cache.get("later_epochs_hit_ratio")
            if ratio is not None and ratio < 0.9:
                out.append(
                    f"Later epochs still hit the cache only {ratio:.0%} of the time: the working "
                    "set does not fit. A bigger cache (cache_limit at least the dataset size) "
                    "makes every epoch after the first read locally."
                )
            elif ratio is None:
                out.append(
                    "If the dataset fits on local disk, a cache at least as large as the dataset "
                    "makes every epoch after the first read locally."
                )
            else:
                out.append(
                    f"Later epochs hit the cache {ratio:.0%} of the time: the waiting is the "
                    "first pass over the data."
                )
            out.append(
                "If the window is already large, the storage's bandwidth is the limit: more "
                "parallel downloads (prefetch concurrency) or storage closer to the compute."
            )
        else:
            out.append(
                f"Reading rows from local shards is slow ({_ms(read)} per batch; the loop waited "
                f"{fraction:.1%} of wall time): put the cache on local NVMe, or raise "
                "num_workers so reads overlap."
            )
        return out
    # decode
    worker = sum(v for v in per_batch.values() if v is not None)
    decode = per_batch.get("transform_seconds") or 0.0
    if step is not None and step > 1e-4:
        needed = math.ceil(worker / step) + 1
        out.append(
            f"Decode/augment is the bottleneck: {_ms(decode)} of worker time per batch while "
            f"the training step takes {_ms(step)} (the loop waited {fraction:.1%} of wall time). "
            f"Raise num_workers to at least {needed} (each worker makes one batch at a time), "
            "CPU cores permitting."
        )
    else:
        out.append(
            f"Decode/augment is the bottleneck: {_ms(decode)} of worker time per batch and the "
            f"loop consumes batches as fast as they come (the loop waited {fraction:.1%} of "
            "wall time). Raise num_workers as far as CPU cores allow."
        )
    out.append(
        "Or make the transform cheaper: decode at reduced size (JPEG draft mode), crop "
        "before resizing, move augmentations to the GPU."
    )
    return out

