"""Per-batch telemetry of one epoch: a `BatchRecord` for each delivered batch, with its cache
counters, to the Loader's summary (`StatsAggregator`) and its telemetry sink.

A batch's cache counters are the worker's (it reports what its reads cost with the batch) plus,
when the source counts anything, what this (the training) process counted since the batch
before: the prefetcher's downloads, and with num_workers=0 or thread workers the reads too.
Both deltas are `shardloader.source.protocol.counter_delta`.
"""

from __future__ import annotations

import time
from typing import Any

from shardloader.loader.batches import BatchTask, BatchTimings
from shardloader.source.protocol import ShardSource, counter_delta

#: telemetry.records.BatchRecord, imported on the first batch recorded. Not a `from ... import`
#: inside `record`: with the caches cold from the training step, that statement alone cost
#: ~15 us per next() (39 -> 54 us for the record, measured).
_BatchRecord: Any = None


def make_stats() -> Any:
    """A `StatsAggregator` for `Loader.stats()`, or None when telemetry is not installed."""
    try:
        from shardloader.telemetry import StatsAggregator
    except ImportError:
        return None
    return StatsAggregator()


class BatchRecorder:
    """Records the batches of one epoch of one rank (`steps` batches per epoch)."""

    def __init__(self, stats: Any, telemetry: Any, source: ShardSource, *, rank: int, epoch: int,
                 steps: int) -> None:
        self.stats = stats
        self.telemetry = telemetry
        self.source = source
        self.rank = rank
        self.epoch = epoch
        self.steps = steps
        # A source that counts nothing (a local one: zeros) gives no delta to take per batch.
        self._counts_locally = source.counts_reads
        self._counters_seen = source.counters() if self._counts_locally else {}

    def record(self, task: BatchTask, timings: BatchTimings, fetch_seconds: float, queue_depth: int) -> None:
        """Record the batch of `task`, delivered now after `fetch_seconds` in `next()`."""
        stats, telemetry = self.stats, self.telemetry
        if stats is None and telemetry is None:
            return
        hits, misses, downloaded = timings.cache_hits, timings.cache_misses, timings.bytes_downloaded
        if self._counts_locally:
            local_hits, local_misses, local_downloaded = self._local_counter_delta()
            hits += local_hits
            misses += local_misses
            downloaded += local_downloaded
        step, delivered = self.epoch * self.steps + task.step + 1, time.time()
        if telemetry is None:  # the summary alone: no record to build
            stats.add_batch(
                step, task.size, task.padded, fetch_seconds, delivered, timings.read_seconds,
                timings.transform_seconds, timings.download_wait_seconds, queue_depth, hits,
                misses, downloaded)
            return
        global _BatchRecord
        if _BatchRecord is None:
            from shardloader.telemetry.records import BatchRecord as _BatchRecord
        record = _BatchRecord(
            step=step, epoch=self.epoch, rank=self.rank,
            samples=task.size, fetch_seconds=fetch_seconds, time=delivered,
            read_seconds=timings.read_seconds, transform_seconds=timings.transform_seconds,
            download_wait_seconds=timings.download_wait_seconds, queue_depth=queue_depth,
            cache_hits=hits, cache_misses=misses, bytes_downloaded=downloaded, padded=task.padded,
        )
        if stats is not None:
            stats.on_batch(record)
        telemetry.on_batch(record)

    def _local_counter_delta(self) -> tuple[int, int, int]:
        """This process's cache counters gained since the last delivered batch (since the
        epoch's start for the first)."""
        now = self.source.counters()
        before, self._counters_seen = self._counters_seen, now
        return counter_delta(before, now)
