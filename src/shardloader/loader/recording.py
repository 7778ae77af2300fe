"""Per-batch telemetry of one epoch: a `BatchRecord` for each delivered batch, with its cache
counters, to the Loader's summary (`StatsAggregator`) and its telemetry sink.

A batch's figures are one dict of every `BatchRecord` field: what the worker measured
(`BatchTimings.figures`, copied by name) and what is measured here, in the training process
(its step, `fetch_seconds`, `queue_depth`, ...). Without a sink the summary takes that dict
(`StatsAggregator.add_values`); with one, it becomes the record. Both see every field, so a
new worker figure needs no line here, and one measured here is one entry of that dict.

A batch's cache counters are the worker's (it reports what its reads cost with the batch) plus,
when the source counts anything, what this (the training) process counted since the batch
before: the prefetcher's downloads, and with num_workers=0 or thread workers the reads too.
Both deltas are `shardloader.source.protocol.counter_delta`.

The job's account (`take_job_amounts`, asked by the epoch iterator of the attempt's loader only)
takes the worker's share with each batch and this process's share from a baseline of its own,
kept per source for the process's life (`_JOB_SEEN`), not per epoch: what the training process
reads before an epoch's first batch is recorded (priming the first batch, range sidecars, the
prefetch's first downloads), between epochs, or after an epoch's last batch (taken at its end)
is counted once, with the next report, never lost between two baselines.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any

from shardloader.loader.batches import BatchTimings
from shardloader.source.protocol import (
    BATCH_COUNTERS,
    ShardSource,
    counter_delta,
    job_counter_delta,
)
from shardloader.telemetry.records import BatchRecord

#: source -> (pid, its counters when this process last reported them to the job's account).
_JOB_SEEN: weakref.WeakKeyDictionary[Any, tuple[int, dict[str, float]]] = weakref.WeakKeyDictionary()


def make_stats() -> Any:
    """A `StatsAggregator` for `Loader.stats()`, or None when telemetry is not installed."""
    try:
        from shardloader.telemetry import StatsAggregator
    except ImportError:
        return None
    return StatsAggregator()


class BatchRecorder:
    """Records the batches of one epoch (or an iterable dataset's pass) of one rank."""

    def __init__(self, stats: Any, telemetry: Any, source: ShardSource, *, rank: int,
                 epoch: int) -> None:
        self.stats = stats
        self.telemetry = telemetry
        self.source = source
        self.rank = rank
        self.epoch = epoch
        # A source that counts nothing (a local one: zeros) gives no delta to take per batch.
        self._counts_locally = source.counts_reads
        self._counters_seen = source.counters() if self._counts_locally else {}
        self._job_seen = dict(self._counters_seen)  # only for a source no weak reference can hold
        #: (bytes_downloaded, JOB_COUNTERS) the last batch's worker counted, for the job's account.
        self._worker_job: tuple[float, dict[str, float]] = (0, {})
        #: A Mixture's figures per source for the last batch, for the job's account.
        self._job_sources: dict[str, dict[str, float]] | None = None

    def record(self, timings: BatchTimings, *, step: int, samples: int, padded: int,
               fetch_seconds: float, queue_depth: int) -> None:
        """Record a batch delivered now after `fetch_seconds` in `next()`: training step `step`
        (counted from 1), `samples` of them padding `padded`, measured by its worker as
        `timings`."""
        stats, telemetry = self.stats, self.telemetry
        self._worker_job = (timings.figures.get("bytes_downloaded", 0), timings.extra)
        self._job_sources = timings.by_source or None
        if stats is None and telemetry is None:
            return
        if timings.by_source and stats is not None:  # a Mixture's batch: what each source cost
            stats.add_by_source(timings.by_source)
        values = {
            **timings.figures,
            "step": step, "epoch": self.epoch,
            "rank": self.rank, "samples": samples, "padded": padded,
            "fetch_seconds": fetch_seconds, "time": time.time(), "queue_depth": queue_depth,
        }
        if self._counts_locally:  # this process's reads and downloads since the last batch
            for name, gained in zip(BATCH_COUNTERS, self._local_counter_delta(), strict=True):
                values[name] += gained
        if telemetry is None:  # the summary alone: no record to build
            stats.add_values(values)
            return
        record = BatchRecord(**values)
        if stats is not None:
            stats.on_batch(record)
        telemetry.on_batch(record)

    def take_job_sources(self) -> dict[str, dict[str, float]] | None:
        """A Mixture's figures per source for the batch recorded last (None: none, or taken)."""
        sources, self._job_sources = self._job_sources, None
        return sources

    def _local_counter_delta(self) -> tuple[int, int, int]:
        """This process's cache counters gained since the last delivered batch (since the
        epoch's start for the first)."""
        now = self.source.counters()
        before, self._counters_seen = self._counters_seen, now
        return counter_delta(before, now)

    def take_job_amounts(self) -> dict[str, float] | None:
        """The byte and request counters for the job's account since the last call: what the
        worker of the batch just recorded counted reading it, and what this process counted
        since it last reported (the prefetch's downloads, priming, range sidecars; the reads
        too without workers). Called for the loader whose batches the attempt counts only, after
        each batch and at the epoch's end (what landed after the last batch): taking them moves
        this process's baseline. None: nothing moved."""
        downloaded, job = self._worker_job
        self._worker_job = (0, {})
        if self._counts_locally:
            local = self._job_delta(self.source.counters())
            if local:
                downloaded += local.pop("bytes_downloaded", 0)
                job = {**job}
                for name, amount in local.items():
                    job[name] = job.get(name, 0) + amount
        if not downloaded and not job:
            return None
        return _job_amounts(downloaded, job)

    def _job_delta(self, now: dict[str, float]) -> dict[str, float]:
        """The counters this process gained since it last reported them to the job (since the
        source's first counters in this process for the first report): `bytes_downloaded` and
        the `JOB_COUNTERS`, those that moved."""
        pid = os.getpid()
        try:
            seen = _JOB_SEEN.get(self.source)
            _JOB_SEEN[self.source] = (pid, now)
        except TypeError:  # a source no weak reference can hold: from this epoch's start, then
            seen, self._job_seen = (pid, self._job_seen), now
        before = seen[1] if seen is not None and seen[0] == pid else {}
        moved = job_counter_delta(before, now)
        downloaded = now.get("bytes_downloaded", 0) - before.get("bytes_downloaded", 0)
        if downloaded:
            moved["bytes_downloaded"] = downloaded
        return moved


def _job_amounts(downloaded: int, job: dict[str, float]) -> dict[str, float]:
    """A batch's byte and request counters, named as the job's counters
    (`shardloader.telemetry.job.counters`)."""
    return {
        "bytes_remote": downloaded + job.get("range_bytes", 0),
        "bytes_from_cache": job.get("bytes_from_cache", 0),
        "downloads": job.get("downloads", 0),
        "range_requests": job.get("range_requests", 0),
        "redownloads": job.get("redownloads", 0),
        "bytes_redownloaded": job.get("bytes_redownloaded", 0),
    }
