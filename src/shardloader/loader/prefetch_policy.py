"""When an epoch fetches shard bytes, around the start of its workers: the one place that says
when remote prefetch starts.

`EpochIterator` calls these steps in this order, which a cold start from remote shards needs:

1. `EpochPrefetch(...)`: the dataset's capacity check (a cache too small for this
   configuration fails here, not mid-epoch); `source.expect_prefetch()`, before the workers
   start, so the setting travels with the dataset; and `source.defers_prefetch(index)`.
2. `before_workers`: when prefetch is deferred, the first batch's bytes are fetched before the
   workers fork (`prime_first_batch`).
3. `after_workers_started`: when deferred, the next shards' range sidecars are fetched in the
   background, for the workers.
4. `start_unless_deferred`, once the first batches are submitted: otherwise whole-shard
   prefetch starts here, in the order this rank needs the shards.
5. `start_deferred`: a deferred prefetch starts once the first batch is out.

A source that reads the first batches' rows by byte range defers whole-shard prefetch that way,
so that its downloads do not compete with those reads (bandwidth, connections, CPU) for the
batch a cold start waits for. Before the fork, the first batch's bytes are fetched here (the
workers inherit them; the fetching thread has ended, the S3 client's own threads are idle and
never used by a child); after it, the next shards' range sidecars, for the workers. Which
sources defer: `RemoteSource.defers_prefetch`; a local one never does, and its prefetch is a
no-op.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from shardloader.loader.cursor import Cursor
from shardloader.loader.plan import StepPlan, first_shards, shards_ahead
from shardloader.loader.pool_keeper import PoolKeeper
from shardloader.loader.protocol import LoaderDataset

log = logging.getLogger(__name__)

#: How long iter() waits for the first batch's bytes before it starts the workers (or, without
#: workers, reads the first batch) anyway.
_PRIME_SECONDS = 30.0


class EpochPrefetch:
    """The shard I/O of one epoch of one rank: the `steps` (of `epoch`) it has left to read."""

    def __init__(self, dataset: LoaderDataset, plan: StepPlan, epoch: int, steps: range, *,
                 num_workers: int) -> None:
        self.dataset = dataset
        self.plan = plan
        self.epoch = epoch
        self.steps = steps
        self.handle: Any = None  # the running prefetch (with `stop()`), or None
        dataset.check_capacity(num_workers=num_workers)
        dataset.source.expect_prefetch()
        self.deferred = dataset.source.defers_prefetch(dataset.index)

    def before_workers(self, workers: PoolKeeper) -> None:
        if self.deferred:
            self._prime_first_batch(workers)

    def _prime_first_batch(self, workers: PoolKeeper) -> None:
        """Cold start from remote shards: fetch the bytes the first batch reads by range now,
        before the workers fork, so that its worker inherits them and needs no request, and the
        other workers' requests for the next batches do not compete with the first's (measured
        with 2 workers on loopback S3: see docs/cache.md). The producer's imports (OpenCV, the
        crop decoder's check) are done meanwhile, whatever the workers: forked ones inherit
        them, and inline or thread workers would otherwise pay for them after the wait, in
        their first batch (~20 ms of a cold first batch, `benchmarks/coldstart.py`). Bounded: a
        fetch still running after `_PRIME_SECONDS` is left to finish in the background (its
        worker then fetches the rows itself)."""
        if not self.steps or not self.plan.looks_ahead:
            return
        if not workers.would_inherit():
            return  # workers already running (persistent), or started fresh: they would not inherit
        samples = self.plan.samples(self.epoch, self.steps[0])
        thread = threading.Thread(target=self.dataset.prime, args=(samples,), name="shardloader-prime",
                                  daemon=True)
        thread.start()
        workers.producer.warm_up()
        thread.join(_PRIME_SECONDS)
        if thread.is_alive():
            then = ("starting the workers anyway (they fetch what they need themselves)" if workers.num_workers
                    else "reading the first batch anyway (this process fetches what it still needs itself)")
            warnings.warn(f"fetching the first batch's bytes took over {_PRIME_SECONDS:g} s; {then}",
                          stacklevel=5)

    def after_workers_started(self, depth: int) -> None:
        """`depth`: how many batches are about to be submitted."""
        if self.deferred:
            self.dataset.source.warm_ranges(first_shards(self.plan, self.epoch, self.steps[:depth],
                                                         self.dataset.index.shards))

    def start_unless_deferred(self) -> None:
        if not self.deferred:
            self.handle = self._start()

    def start_deferred(self) -> None:
        """The first batch is out: start the prefetch that waited for it."""
        self.deferred = False
        self.handle = self._start()

    def _start(self) -> Any:
        return self.dataset.source.start_prefetch(
            shards_ahead(self.plan, self.epoch, self.steps, self.dataset.index.shards))

    def stop(self, timeout: float | None = None) -> None:
        """End the prefetch: at the epoch's end (downloads are done or useless), or within
        `timeout` seconds when the epoch is abandoned or the loader closes."""
        if self.handle is None:
            return
        if timeout is None:
            self.handle.stop()
        else:
            self.handle.stop(timeout)


def warm_first_batch(dataset: LoaderDataset, plan: StepPlan, cursor: Cursor, workers: PoolKeeper) -> None:
    """Start fetching, in the background, what the next iteration's first batch reads by range,
    so that a cold start's requests overlap what the script does before it iterates (building
    its model, its optimizer, loading a checkpoint: seconds in most jobs). The Loader calls it
    when it is made and when a state is loaded.

    Where workers started then would share this process's memory (`PoolKeeper.would_inherit`:
    forked, or none), the whole first batch is primed (`dataset.prime`: its range sidecars and
    its rows' spans, kept in this process): the pool waits for it before it forks
    (`PoolKeeper.inherit`), and the priming at `iter()` finds the spans kept instead of fetching
    them again. With a 1 s pause between `Loader()` and `iter()`, the cold first batch from S3
    then took 0.26-0.28 s from `iter()` instead of 0.56 s (`benchmarks/coldstart.py
    --user-seconds 1`, 2 workers, loopback moto): the producer's imports, the fork and one
    worker's task. Otherwise (spawned workers fetch for themselves) only the range sidecars are
    fetched, onto the node (`ShardSource.warm_ranges(first_batch=True)`).

    What is fetched and where is worked out in the thread (an epoch's order over 10^6 shards
    takes ~0.5 s to build), and not at all once the cursor has moved elsewhere (a state loaded
    meanwhile asks for its own first batch). A state loaded after the priming started leaves
    that batch's spans unused: one batch of range reads, within each shard's range budget."""
    if not dataset.source.reads_by_range:
        return
    where = cursor.next_start
    if where[1] >= plan.global_steps:  # restored at an epoch's end: no first batch to fetch
        return

    def still_first() -> bool:
        return cursor.next_start == where

    if workers.would_inherit() and plan.looks_ahead:
        def prime() -> None:
            if not still_first():
                return
            try:
                dataset.prime(plan.samples(*where), ahead=True)
            except Exception:  # noqa: BLE001 - an optimisation: iter() primes the batch again
                log.warning("fetching the first batch ahead failed", exc_info=True)

        thread = threading.Thread(target=prime, name="shardloader-prime-ahead", daemon=True)
        thread.start()
        workers.inherit(thread)
        return

    def shards() -> Iterator[Any]:
        if still_first():
            yield from first_shards(plan, where[0], range(where[1], where[1] + 1), dataset.index.shards)

    dataset.source.warm_ranges(shards(), first_batch=True)
