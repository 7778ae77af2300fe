"""`IterableProducer`: what a worker does with an iterable dataset — iterate its own copy and
cut it into batches, one batch per task, as DataLoader's workers do.

It runs in the project's worker processes (`shardloader.loader.workers.pool`: they die with
the training process, batches travel through shared-memory slots, a failure comes back with
its cause on the first line) and, with `num_workers=0`, in the training process
(`InlinePool`). It speaks the pools' producer interface (`__call__(task)`, `warm_up`, and the
attributes a worker sets: `worker_id`, `seed`, `allocate`...), like `BatchProducer`.

One pass of the dataset in one worker:

- the worker's first task of the pass carries `task.start` (see `start_of`): `{}` to iterate
  from the beginning; `{"state": s}` to call `dataset.load_state_dict(s)` first (exact
  resume: the dataset's own state as of the last batch delivered from this worker); or
  `{"skip": k}` to iterate from the beginning and throw away the first k batches (resume by
  fast-forward, for a dataset without state). Then `iter(dataset)` makes the pass's iterator;
- each task takes the next `batch_size` samples (one sample with `batch_size=None`) and
  collates them, as DataLoader's `_IterableDatasetFetcher`: a short last batch, or none with
  `drop_last`; after the iterator ends every task answers `ended`;
- each answer is a `WorkerBatch`: the batch, the dataset's `state_dict()` right after it (for
  a dataset that has one), and whether the worker's split has ended; with `BatchTimings` whose
  `read_seconds` is the time spent in the dataset's iterator (its own reading and decoding)
  and `transform_seconds` the collate's.

`worker_init_fn(worker_id)` runs once in each worker process, before its first pass begins, as
DataLoader runs it (a dataset that splits its range there, as torch's documentation shows, is
split before `iter()`).
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

from shardloader.loader.batches import BatchTask, BatchTimings


@runtime_checkable
class StatefulDataset(Protocol):
    """A dataset with state of its own (torchdata's StatefulDataLoader convention; a Hugging
    Face `datasets.IterableDataset` has it): `load_state_dict` before `iter()` continues the
    stream where `state_dict()` was taken."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class WorkerBatch(NamedTuple):
    """A worker's answer to one task. `state`: the dataset's `state_dict()` after this batch
    (None for a dataset without state); `ended`: the worker's split has no batch left (then
    `batch` is None); `samples`: how many the batch holds (its telemetry record's)."""

    batch: Any
    state: dict[str, Any] | None
    ended: bool
    samples: int = 0


class IterableProducer:
    """Batches of one worker's copy of an iterable dataset (see the module doc). Picklable: it
    travels into worker processes (under "spawn" and "forkserver")."""

    #: Set by a worker process (the pools' producer interface). Cache counters: an iterable
    #: dataset has no shard source to count.
    report_cache_counters = False
    worker_id: int | None = None
    allocate: Any = None
    allocate_many: Any = None

    def __init__(self, dataset: Any, *, seed: int, batch_size: int | None, drop_last: bool,
                 collate_fn: Callable[[Any], Any],
                 worker_init_fn: Callable[[int], Any] | None = None) -> None:
        self.dataset = dataset
        self.seed = int(seed)  # a worker's get_worker_info().seed is made from it
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.worker_init_fn = worker_init_fn
        self.stateful = isinstance(dataset, StatefulDataset)
        self._iterator: Iterator[Any] | None = None  # this pass's; None once it has ended
        self._last_short = False  # the last batch was short: the iterator has ended

    def warm_up(self) -> None:
        """Nothing to load ahead: the dataset's own `__iter__` does its reading."""

    def __call__(self, task: BatchTask) -> tuple[WorkerBatch, BatchTimings]:
        timings = BatchTimings()
        if self.worker_id is not None and self.worker_init_fn is not None:
            worker_id, self.worker_id = self.worker_id, None  # once per process
            self.worker_init_fn(worker_id)
        if task.start is not None:
            self._begin(task.start)
        t0 = time.perf_counter()
        samples = self._take()
        t1 = time.perf_counter()
        timings.figures["read_seconds"] = t1 - t0
        if samples is None:
            return WorkerBatch(None, self._state(), True), timings
        batch = self.collate_fn(samples[0] if self.batch_size is None else samples)
        timings.figures["transform_seconds"] = time.perf_counter() - t1
        return WorkerBatch(batch, self._state(), False, len(samples)), timings

    def _begin(self, start: dict[str, Any]) -> None:
        """A new pass: restore the dataset's state or fast-forward, as `start` says."""
        self._iterator, self._last_short = None, False
        if "state" in start:
            self.dataset.load_state_dict(copy.deepcopy(start["state"]))
        self._iterator = iter(self.dataset)
        for _ in range(start.get("skip", 0)):
            if self._take() is None:
                break

    def _take(self) -> list[Any] | None:
        """The next batch's samples (one sample unbatched), or None when the split has ended
        (DataLoader's fetcher: nothing left, or a short batch under `drop_last`)."""
        if self._iterator is None or self._last_short:
            self._iterator = None
            return None
        wanted = 1 if self.batch_size is None else self.batch_size
        samples = list(itertools.islice(self._iterator, wanted))
        if not samples or (self.drop_last and len(samples) < wanted):
            self._iterator = None
            return None
        self._last_short = len(samples) < wanted
        return samples

    def _state(self) -> dict[str, Any] | None:
        """The dataset's state now (a copy: the dataset may change its own dict in place)."""
        return copy.deepcopy(self.dataset.state_dict()) if self.stateful else None


def start_of(batches: int, state: dict[str, Any] | None) -> dict[str, Any]:
    """A worker's `task.start` for a pass in which it has delivered `batches` batches already,
    the dataset's state after the last of them being `state` (None: no state)."""
    if state is not None:
        return {"state": state}
    return {"skip": batches} if batches else {}
