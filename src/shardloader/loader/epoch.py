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
from collections.abc import Callable
from typing import Any

from shardloader.loader.batches import BatchTask
from shardloader.loader.cursor import Cursor, check_iterator
from shardloader.loader.failures import BatchFailure
from shardloader.loader.pinning import PinningThread, pin_batch
from shardloader.loader.plan import StepPlan
from shardloader.loader.pool_keeper import PoolKeeper
from shardloader.loader.prefetch_policy import EpochPrefetch
from shardloader.loader.protocol import LoaderDataset
from shardloader.loader.recording import BatchRecorder
from shardloader.loader.workers.pool import CLOSE_SECONDS
from shardloader.runtime.startup import gc_paused, paused_gc
from shardloader.telemetry.job.recorder import AttemptRecorder, current_attempt

#: How long an iteration that failed waits for its workers to stop before terminating them.
ERROR_CLOSE_SECONDS = 0.5


class EpochIterator:
    """Iterates one epoch of the cursor (`steps` global steps, `length` batches) for one rank.

    Nothing starts when it is made: its first `next()` begins the iteration (the cursor's
    epoch from its start, or from the restored position) and starts workers and prefetch. An
    iterator made and dropped unused (`iter(loader)` to check that it is iterable, as some
    trainers do) thus moves nothing, and does not use up a restored position; one made before
    `set_epoch` or `load_state_dict` (Lightning makes its iterator first) starts where they
    put the cursor.

    `owner` is the Loader: this iterator keeps it alive, so that its workers are not abandoned
    by its `__del__` mid-epoch and its exit handler still closes them."""

    def __init__(self, owner: object, cursor: Cursor, plan: StepPlan, dataset: LoaderDataset,
                 workers: PoolKeeper, *, steps: int, length: Callable[[], int], pin_memory: bool, rank: int,
                 stats: Any, telemetry: Any,
                 follow_length: Callable[[bool], tuple[StepPlan, int, Callable[[], int]]] | None = None) -> None:
        self.owner = owner
        #: Asked as the iteration starts (from its epoch's start or not): the plan, steps and
        #: length for the dataset's length then (`shardloader.loader.growth`).
        self.follow_length = follow_length
        self.cursor = cursor
        self.plan = plan
        self.dataset = dataset
        self.workers = workers
        self.pin_memory = pin_memory
        self.rank = rank
        self.stats = stats
        self.telemetry = telemetry
        self.generation = cursor.generation
        self.iteration = cursor.iterations
        self.steps = steps  # global steps: the last may have no batch for this rank
        self.length = length  # this rank's batches: len(loader) (TypeError for an unsized sampler)
        self.started = False  # the first __next__ starts the iteration (under paused_gc)
        self.ended = False  # StopIteration was raised: the cursor moved to the next epoch
        self.finished = False  # prefetch stopped (and workers released, unless persistent)
        self.prefetch: EpochPrefetch | None = None  # made by _start
        self.broken: str | None = None  # why the iteration cannot go on (a worker died, ...)
        self.pinning: PinningThread | None = None  # pins batches ahead (pin_memory with workers)
        self.recorder: BatchRecorder | None = None  # made by _start

    @gc_paused  # starts the workers: on the path to the first batch (see shardloader.runtime.startup)
    def _start(self) -> None:
        self.started = True
        self.cursor.start_iteration()
        if self.follow_length is not None:  # an epoch from its start takes len(dataset) now
            self.plan, self.steps, self.length = self.follow_length(self.cursor.position == 0)
        self.dataset.check_length()
        self.epoch = self.cursor.epoch
        first_step = self.cursor.next_step  # the end: steps
        self.plan.begin(self.epoch, first_step)  # a user's sampler: its iter(), at first_step
        workers = self.workers
        self.prefetch = EpochPrefetch(self.dataset, self.plan, self.epoch, range(first_step, self.steps),
                                      num_workers=workers.num_workers)
        self.prefetch.before_workers(workers)
        if workers.forks and workers.would_inherit() and self.plan.looks_ahead:
            self.plan.order(self.epoch)  # built once, here: forked workers share it (see plan.py)
        self.pool = workers.get()
        self.prefetch.after_workers_started(workers.depth)
        self.pool.discard_pending()
        self.in_flight: list[BatchTask] = []
        self.to_submit = first_step
        for _ in range(workers.depth):
            self._submit_next()
        self.recorder = BatchRecorder(self.stats, self.telemetry, self.dataset.source, rank=self.rank,
                                      epoch=self.epoch)
        self.prefetch.start_unless_deferred()
        attempt = current_attempt()
        if attempt is not None and attempt.claims(self.owner):  # the node cache's high water so far
            attempt.add(cache_peak=self.dataset.source.node_counters().get("high_water", 0))
        if self.pin_memory and workers.num_workers > 0:
            self.pinning = PinningThread(self._fetch, depth=workers.depth,
                                         skip=lambda batch: isinstance(batch, BatchFailure))

    def _submit_next(self) -> None:
        while self.to_submit < self.steps:
            step = self.to_submit
            self.to_submit += 1
            # With workers, the order is computed in the worker; inline, here (same thread).
            drawn = self.plan.draw(self.epoch, step, inline=self.workers.num_workers == 0)
            if drawn is None:  # a user's sampler ran out: the epoch ends here
                self.to_submit = self.steps
                return
            samples, padded, size = drawn
            if size == 0:  # tail="partial": nothing falls to this rank
                continue
            task = BatchTask(self.workers.new_task_id(), self.epoch, step, samples, padded, size)
            self.pool.submit(task)
            self.in_flight.append(task)
            return

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        """Batches of the whole epoch, len(loader) (DataLoader's iterators have a length too)."""
        return self.length()

    def __next__(self) -> Any:
        attempt = current_attempt()
        if attempt is None or self.ended or not attempt.claims(self.owner):
            return self._next_or_start()
        return self._next_for_job(attempt)

    def _next_for_job(self, attempt: AttemptRecorder) -> Any:
        """`next()`, told to the job's attempt: how long it took and how far it moved the
        cursor (linear positions: epoch * positions per epoch + position)."""
        cursor = self.cursor
        previous = cursor.last_batch  # advance() makes a new tuple: `is` tells if it moved
        enter = time.perf_counter()
        try:
            batch = self._next_or_start()
        except StopIteration:
            attempt.add(cache_peak=self.dataset.source.node_counters().get("high_water", 0))
            linear = cursor.epoch * cursor.length
            late = self.recorder.take_job_amounts() if self.recorder is not None else None
            attempt.on_next(enter, time.perf_counter(), linear, linear, epoch=cursor.epoch - 1,
                            per_epoch=cursor.length, global_batch=cursor.global_batch_size,
                            ended_epoch=True, **(late or {}))
            raise
        except BaseException:  # a failing sample's batch is consumed too (the cursor moved)
            self._tell_attempt(attempt, enter, moved=cursor.last_batch is not previous, amounts=None)
            raise
        self._tell_attempt(attempt, enter, moved=True, amounts=self.recorder.take_job_amounts())
        sources = self.recorder.take_job_sources()
        if sources:  # a Mixture's batch: what each source cost, for the job's account
            attempt.add_sources(sources)
        return batch

    def _tell_attempt(self, attempt: AttemptRecorder, enter: float, *, moved: bool,
                      amounts: dict[str, float] | None) -> None:
        leave = time.perf_counter()
        cursor = self.cursor
        length, batch_positions = cursor.length, cursor.global_batch_size
        after = cursor.epoch * length + cursor.position
        before = after
        if moved and cursor.last_batch is not None:
            before = cursor.last_batch[0] * length + cursor.last_batch[1] * batch_positions
        attempt.on_next(enter, leave, before, after, epoch=cursor.epoch, per_epoch=length,
                        global_batch=batch_positions, **(amounts or {}))

    def _next_or_start(self) -> Any:
        check_iterator(self, "epoch")
        if self.started:
            return self._next()
        with paused_gc():  # the wait for the first batch (see shardloader.runtime.startup)
            try:
                self._start()
            except BaseException as e:
                self.broken = f"{type(e).__name__}: {e}"
                self.finish(error=True)
                raise
            return self._next()

    def _next(self) -> Any:
        start = time.perf_counter()
        try:
            if self.pinning is not None:
                task, batch, timings, queue_depth = self.pinning.get()
            else:
                task, batch, timings, queue_depth = self._fetch()
                if self.pin_memory and not isinstance(batch, BatchFailure):
                    batch = pin_batch(batch)  # made in this thread anyway (no workers)
        except StopIteration:
            self.finish()
            self.ended = True
            self.cursor.finish_epoch()
            raise
        except BaseException as e:
            self.broken = f"{type(e).__name__}: {e}"
            self.finish(error=True)
            raise
        if isinstance(batch, BatchFailure):  # the dataset's error: this batch is consumed
            self.cursor.advance(task.step)
            raise batch.error
        self.dataset.check_length()
        fetch_seconds = time.perf_counter() - start
        self.cursor.advance(task.step)
        if timings.dataset_state is not None:  # the dataset's state as this batch left it
            self.cursor.dataset_state = timings.dataset_state
        self.recorder.record(timings, step=self.epoch * self.steps + task.step + 1, samples=task.size,
                             padded=task.padded, fetch_seconds=fetch_seconds, queue_depth=queue_depth)
        return batch

    def _fetch(self) -> tuple[BatchTask, Any, Any, int]:
        """The next batch from the pool, in step order (StopIteration after the last), and the
        next task submitted in its place. Runs on the pinning thread when there is one."""
        if not self.in_flight:
            raise StopIteration
        task = self.in_flight.pop(0)
        queue_depth = self.pool.ready()
        batch, timings = self.pool.get(task.task_id)
        self._submit_next()
        assert self.prefetch is not None
        if self.prefetch.deferred:
            self.prefetch.start_deferred()
        return task, batch, timings, queue_depth

    def finish(self, error: bool = False, release: bool = True, timeout: float | None = None) -> None:
        """End the epoch's prefetch (within `timeout` seconds when given) and, with `release`,
        its workers (all of them, persistent or not, after an `error`)."""
        if self.finished:
            return
        self.finished = True
        if not self.started:
            return
        if self.pinning is not None:
            self.pinning.request_stop()
        if self.prefetch is not None:
            self.prefetch.stop(timeout)
        if release:
            # After an error (a timeout, a dead worker) the workers left are not waited for
            # long: the error reaches the caller within about ERROR_CLOSE_SECONDS of its cause.
            self.workers.release(force=error, timeout=ERROR_CLOSE_SECONDS if error else CLOSE_SECONDS)
        if self.pinning is not None:  # its fetch ends with its batch, or with the pool
            self.pinning.join(CLOSE_SECONDS if timeout is None else timeout)

    def __del__(self) -> None:
        try:
            if self.prefetch is not None and not self.finished:
                self.prefetch.stop(0.0)  # cancel; never wait in __del__
        except Exception:  # noqa: BLE001
            pass
