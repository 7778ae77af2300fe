"""One pass over an iterable dataset: batches taken from the workers in DataLoader's order,
and the cursor that says where the pass stands (what `state_dict()` saves).

DataLoader's order for an iterable dataset with N workers is a round robin: worker 0's first
batch, worker 1's first, ..., worker 0's second, ...; a worker whose split has ended drops out
at its turn and the others go on. Batch j of worker w is thus delivered in the order of
(j, w) among the batches that exist. `IterablePass` keeps `workers.depth` tasks in flight in
that order (each task names its worker; one known to have ended gets no more) and hands the
answers out in it, as DataLoader does with the same prefetch.

`IterableCursor` is the pass's whole resumable state, per worker as torchdata's
StatefulDataLoader keeps it: how many batches each worker has delivered, its dataset's state
as of the last of them, whether its split has ended, and whose turn is next; and the batches
delivered in earlier epochs, so that the training step (`step`: telemetry's, `loader.step`)
goes on counting across epochs and restarts although an epoch's length is known only at its end.

Each delivered batch is recorded (`loader.recording.BatchRecorder`, as the map-style epoch's):
`fetch_seconds` in `next()`, the worker's `read_seconds` (in the dataset's iterator) and
`transform_seconds` (the collate); the cache fields stay 0, as there is no shard source.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shardloader.loader.batches import BatchTask, BatchTimings
from shardloader.loader.cursor import check_iterator
from shardloader.loader.failures import BatchFailure
from shardloader.loader.iterable_workers import WorkerBatch, start_of
from shardloader.loader.pinning import pin_batch
from shardloader.loader.pool_keeper import PoolKeeper
from shardloader.loader.protocol import NO_SHARD_SOURCE
from shardloader.loader.recording import BatchRecorder
from shardloader.loader.workers.pool import CLOSE_SECONDS

#: How long a pass that failed waits for its workers to stop before terminating them.
ERROR_CLOSE_SECONDS = 0.5


@dataclass
class WorkerPosition:
    """Where one worker's split stands in the current pass."""

    batches: int = 0  # batches delivered from it (a batch whose production raised counts)
    ended: bool = False  # its split has ended (found at its turn)
    state: dict[str, Any] | None = None  # its dataset's state_dict() after its last batch

    def to_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "ended": self.ended, "state": self.state}


@dataclass
class IterableCursor:
    """Where an iterable Loader is: the epoch, each worker's position in it, whose turn is next.
    `restored`, `generation` and `iterations` keep the epoch contract of the map-style cursor
    (`shardloader.loader.cursor`)."""

    workers: int  # max(1, num_workers): with none, the training process is worker 0
    epoch: int = 0
    steps_before: int = 0  # batches delivered before the current epoch (all epochs so far)
    positions: list[WorkerPosition] = field(default_factory=list)
    next_worker: int = 0
    restored: bool = False
    generation: int = 0
    iterations: int = 0

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.positions = [WorkerPosition() for _ in range(self.workers)]
        self.next_worker = 0

    @property
    def delivered(self) -> int:
        """Batches delivered in the current epoch (from all workers)."""
        return sum(p.batches for p in self.positions)

    @property
    def step(self) -> int:
        """Batches delivered since epoch 0 began: the training step."""
        return self.steps_before + self.delivered

    @property
    def epoch_finished(self) -> bool:
        """Every worker's split has ended (seen at their turns) while the epoch is current."""
        return all(p.ended for p in self.positions)

    def invalidate(self) -> None:
        self.generation += 1

    def move_to(self, epoch: int) -> None:
        self.epoch, self.restored = epoch, False
        self.steps_before += self.delivered
        self.reset()
        self.invalidate()

    def restore(self, epoch: int, section: dict[str, Any]) -> None:
        """Continue at a saved state's `iterable` section (validated) with the next pass."""
        self.epoch, self.restored = epoch, True
        self.steps_before = section.get("steps_before", 0)  # a state saved before it was kept
        self.positions = [WorkerPosition(w["batches"], w["ended"], w["state"]) for w in section["workers"]]
        self.next_worker = section["next_worker"]
        self.invalidate()

    def to_dict(self) -> dict[str, Any]:
        return {"next_worker": self.next_worker, "steps_before": self.steps_before,
                "workers": [p.to_dict() for p in self.positions]}

    def start_iteration(self) -> None:
        """A pass begins: where it was restored right after `restore`, else from the start."""
        if not self.restored:
            self.reset()
        self.restored = False

    def following(self, worker: int) -> int:
        """The first worker after `worker`, cyclically, whose split has not ended (`worker`
        itself when it is the only one; any, when none is left)."""
        for offset in range(1, self.workers + 1):
            candidate = (worker + offset) % self.workers
            if not self.positions[candidate].ended:
                return candidate
        return (worker + 1) % self.workers

    def advance(self, worker: int, answer: WorkerBatch | None) -> None:
        """A batch of `worker` was delivered (None: its production raised; consumed anyway)."""
        position = self.positions[worker]
        position.batches += 1
        if answer is not None and answer.state is not None:
            position.state = answer.state
        self.next_worker = self.following(worker)

    def end(self, worker: int) -> None:
        """`worker`'s split has ended (found at its turn)."""
        self.positions[worker].ended = True
        self.next_worker = self.following(worker)

    def finish_epoch(self) -> None:
        self.epoch, self.restored = self.epoch + 1, False
        self.steps_before += self.delivered
        self.reset()


class IterablePass:
    """Iterates one pass of an iterable dataset for an `IterableLoader` (`owner`, kept alive
    while the pass runs). Nothing starts when it is made: its first `next()` starts the
    workers, as the map-style `EpochIterator` does."""

    def __init__(self, owner: object, cursor: IterableCursor, workers: PoolKeeper, *,
                 pin_memory: bool, length: int | None, rank: int, stats: Any, telemetry: Any) -> None:
        self.owner = owner
        self.rank, self.stats, self.telemetry = rank, stats, telemetry
        self.cursor = cursor
        self.workers = workers
        self.pin_memory = pin_memory
        self.length = length
        self.generation = cursor.generation
        self.iteration = cursor.iterations
        self.started = self.ended = self.finished = False
        self.broken: str | None = None

    def __iter__(self) -> IterablePass:
        return self

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("this iterable dataset has no __len__, so its loader has no length")
        return self.length

    def _start(self) -> None:
        self.started = True
        self.cursor.start_iteration()
        self.pool = self.workers.get()
        self.pool.discard_pending()
        self.in_flight: deque[tuple[BatchTask, int]] = deque()
        self.recorder = BatchRecorder(self.stats, self.telemetry, NO_SHARD_SOURCE, rank=self.rank,
                                      epoch=self.cursor.epoch)
        self.turn = self.cursor.next_worker  # the worker the next submission goes to
        self.begun: set[int] = set()  # workers sent this pass's start
        self.submitted = 0
        for _ in range(self.workers.depth):
            self._submit_next()

    def _submit_next(self) -> None:
        positions = self.cursor.positions
        for offset in range(len(positions)):
            worker = (self.turn + offset) % len(positions)
            if not positions[worker].ended:
                break
        else:
            return  # every split has ended
        self.turn = (worker + 1) % len(positions)
        start = None
        if worker not in self.begun:
            self.begun.add(worker)
            start = start_of(positions[worker].batches, positions[worker].state)
        task = BatchTask(self.workers.new_task_id(), self.cursor.epoch, self.submitted, None, start=start)
        self.submitted += 1
        self.pool.submit(task, worker)
        self.in_flight.append((task, worker))

    def __next__(self) -> Any:
        check_iterator(self, "pass")
        start = time.perf_counter()
        try:
            if not self.started:
                self._start()
            answer, timings, queue_depth = self._fetch()
        except StopIteration:
            self.finish()
            self.ended = True
            self.cursor.finish_epoch()
            raise
        except BaseException as e:
            self.broken = f"{type(e).__name__}: {e}"
            self.finish(error=True)
            raise
        if isinstance(answer, BatchFailure):  # the dataset's error: this batch is consumed
            raise answer.error
        batch = pin_batch(answer.batch) if self.pin_memory else answer.batch
        self.recorder.record(timings, step=self.cursor.step, samples=answer.samples, padded=0,
                             fetch_seconds=time.perf_counter() - start, queue_depth=queue_depth)
        return batch

    def _fetch(self) -> tuple[Any, BatchTimings, int]:
        """The next worker answer in DataLoader's order (or the failure in its place), its
        worker's timings, and how many answers were ready when it was asked for; StopIteration
        when every worker's split has ended."""
        while self.in_flight:
            task, worker = self.in_flight.popleft()
            queue_depth = self.pool.ready()
            answer, timings = self.pool.get(task.task_id)
            if self.cursor.positions[worker].ended:
                continue  # sent before its worker was found ended: DataLoader skips it too
            if isinstance(answer, BatchFailure):
                self.cursor.advance(worker, None)
                self._submit_next()
                return answer, timings, queue_depth
            if answer.ended:
                self.cursor.end(worker)
                self._submit_next()
                continue
            self.cursor.advance(worker, answer)
            self._submit_next()
            return answer, timings, queue_depth
        raise StopIteration

    def finish(self, error: bool = False, release: bool = True, timeout: float | None = None) -> None:
        """End the pass: its workers are released (closed unless persistent; all of them
        after an `error`)."""
        if self.finished:
            return
        self.finished = True
        if self.started and release:
            self.workers.release(force=error, timeout=ERROR_CLOSE_SECONDS if error else CLOSE_SECONDS)
