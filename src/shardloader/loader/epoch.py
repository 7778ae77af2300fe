"""`EpochIterator`: the rest of one epoch for one rank — submit tasks, take their batches in
order, advance the cursor.

It keeps `depth` batches submitted to the worker pool ahead of the one it waits for, hands
them out in step order, advances the Loader's `Cursor` after each and has it recorded
(`BatchRecorder`). The shard I/O around the workers' start (capacity check, priming, range
sidecars, prefetch) is `EpochPrefetch`'s, called here in the order a cold start needs (see
`shardloader.loader.prefetch_policy`).
"""

from __future__ import annotations

import time
from typing import Any

from shardloader.loader.batches import BatchTask
from shardloader.loader.cursor import Cursor
from shardloader.loader.pinning import pin_batch
from shardloader.loader.plan import StepPlan
from shardloader.loader.pool_keeper import PoolKeeper
from shardloader.loader.prefetch_policy import EpochPrefetch
from shardloader.loader.protocol import LoaderDataset
from shardloader.loader.recording import BatchRecorder
from shardloader.runtime.startup import gc_paused, paused_gc


class EpochIterator:
    """Iterates the rest of the cursor's epoch (`steps` batches in all) for one rank.

    `owner` is the Loader: this iterator keeps it alive, so that its workers are not abandoned
    by its `__del__` mid-epoch and its exit handler still closes them."""

    @gc_paused  # starts the workers: on the path to the first batch (see shardloader.runtime.startup)
    def __init__(self, owner: object, cursor: Cursor, plan: StepPlan, dataset: LoaderDataset,
                 workers: PoolKeeper, *, steps: int, pin_memory: bool, rank: int, stats: Any,
                 telemetry: Any) -> None:
        self.owner = owner
        self.cursor = cursor
        self.plan = plan
        self.workers = workers
        self.pin_memory = pin_memory
        self.delivered = False  # no batch yet: the first __next__ runs under paused_gc
        self.generation = cursor.generation
        self.epoch = cursor.epoch
        self.steps = steps
        first_step = cursor.next_step  # the end: steps
        self.prefetch = EpochPrefetch(dataset, plan, self.epoch, range(first_step, steps),
                                      num_workers=workers.num_workers)
        self.prefetch.before_workers(workers)
        self.pool = workers.get()
        self.prefetch.after_workers_started(workers.depth)
        self.pool.discard_pending()
        self.in_flight: list[BatchTask] = []
        self.to_submit = first_step
        for _ in range(workers.depth):
            self._submit_next()
        self.recorder = BatchRecorder(stats, telemetry, dataset.source, rank=rank, epoch=self.epoch,
                                      steps=steps)
        self.prefetch.start_unless_deferred()
        self.finished = False

    def _submit_next(self) -> None:
        while self.to_submit < self.steps:
            step = self.to_submit
            self.to_submit += 1
            size, padded = self.plan.counts(step)
            if size == 0:  # tail="partial": nothing falls to this rank
                continue
            # With workers, the order is computed in the worker; inline, here (same thread).
            samples = None if self.workers.num_workers > 0 else self.plan.samples(self.epoch, step)
            task = BatchTask(self.workers.new_task_id(), self.epoch, step, samples, padded, size)
            self.pool.submit(task)
            self.in_flight.append(task)
            return

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        if self.delivered:
            return self._next()
        with paused_gc():  # the wait for the first batch (see shardloader.runtime.startup)
            batch = self._next()
        self.delivered = True
        return batch

    def _next(self) -> Any:
        if self.generation != self.cursor.generation:
            raise RuntimeError("this iterator is stale: the loader was re-iterated, reloaded or closed")
        start = time.perf_counter()
        if not self.in_flight:
            self.finish()
            raise StopIteration
        task = self.in_flight.pop(0)
        queue_depth = self.pool.ready()
        try:
            batch, timings = self.pool.get(task.task_id)
        except BaseException:
            self.finish(error=True)
            raise
        self._submit_next()
        if self.prefetch.deferred:
            self.prefetch.start_deferred()
        if self.pin_memory:
            batch = pin_batch(batch)
        fetch_seconds = time.perf_counter() - start
        self.cursor.advance(task.step)
        self.recorder.record(task, timings, fetch_seconds, queue_depth)
        return batch

    def finish(self, error: bool = False, release: bool = True, timeout: float | None = None) -> None:
        """End the epoch's prefetch (within `timeout` seconds when given) and, with `release`,
        its workers (all of them, persistent or not, after an `error`)."""
        if self.finished:
            return
        self.finished = True
        self.prefetch.stop(timeout)
        if release:
            self.workers.release(force=error)

    def __del__(self) -> None:
        try:
            if not self.finished:
                self.prefetch.stop(0.0)  # cancel; never wait in __del__
        except Exception:  # noqa: BLE001
            pass
