"""`Loader`: a drop-in replacement for torch.utils.data.DataLoader that resumes exactly.

Batches are a pure function of (dataset, seed, epoch, settings): the order comes from
`shardloader.order`, each sample's augmentation runs under its own key, and workers return
batches in order. The loader's state is a cursor (epoch, global positions consumed) plus a
fingerprint, so `load_state_dict` costs O(1) and continues with exactly the batches an
uninterrupted run would have produced, under any `num_workers` and any world size with the
same global batch size (invariants I1–I5).

The epoch contract (invariant I10) is in `Loader`'s docstring; the lifecycle (context manager,
bounded `close()`, interpreter exit) too.
"""

from __future__ import annotations

import atexit
import multiprocessing.util  # noqa: F401 - registers its exit handler before ours (see below)
import numbers
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from shardloader.distenv import rank_and_world
from shardloader.errors import StateError
from shardloader.loader.batches import BatchProducer, BatchTask, BatchTimings, Transform, pin
from shardloader.loader.compat import check_dataloader_arguments, check_worker_init, resolve_tail
from shardloader.loader.mapstyle import (
    MAP_STYLE_PARTITIONS,
    MAP_STYLE_WINDOW,
    MapStyleDataset,
    as_loader_dataset,
)
from shardloader.loader.plan import StepPlan
from shardloader.loader.state import fingerprint_differences, make_state, validate_state
from shardloader.loader.workers import CLOSE_SECONDS, end_pools_at_exit, make_pool
from shardloader.order.partition import (
    check_world,
    dropped_samples,
    epoch_length,
    padded_samples,
    steps_per_epoch,
)
from shardloader.order.shuffle import (
    DEFAULT_PARTITIONS,
    DEFAULT_WINDOW,
    EpochOrder,
    ShuffleSettings,
)
from shardloader.source import LocalSource
from shardloader.startup import gc_paused, paused_gc
from shardloader.transforms.base import transform_version as describe_transform


class Loader:
    """Batches of `dataset` for this rank, in a deterministic, resumable order.

    `dataset` is a `shardloader.Dataset` or any map-style dataset (`__len__` + `__getitem__`,
    e.g. a torch `Dataset`; see `shardloader.loader.mapstyle`). Arguments and defaults are
    DataLoader's (`batch_size=1`, `shuffle=False`, `drop_last=False`, `persistent_workers=False`,
    `prefetch_factor=2`); DataLoader arguments that would break exact resume (`sampler`,
    `batch_sampler`, `generator`) are refused with what to use instead.

    `batch_size` is per rank; the global batch size is `batch_size * world_size` and is part
    of the fingerprint. `tail` chooses what happens to the last incomplete global batch:
    "partial" (a short last batch: the default in one process, as DataLoader), "drop"
    (`drop_last=True`) or "pad" (fill from the epoch's start: the default under world_size > 1,
    so that every DDP rank takes the same number of steps; see `tail_report()`).
    `partitions` and `window` are the shuffle settings (see `shardloader.order.shuffle`): each
    rank keeps about ceil(partitions / world_size) * window shards resident; a map-style
    dataset defaults to one partition and one window (a full shuffle of all samples).
    `worker_type` is "process" (default) or "thread". `worker_init_fn(worker_id)` runs once
    in each worker process before its first batch. The transform is part of the fingerprint
    (its description, see `shardloader.transforms.transform_version`) unless
    `transform_version` overrides it.

    Epochs — one contract for fresh and resumed runs (invariant I10)::

        loader.load_state_dict(state)              # or Checkpointer.load(..., loader=loader)
        for epoch in range(loader.epoch, epochs):  # loader.epoch: the epoch to run next
            loader.set_epoch(epoch)
            for batch in loader:
                ...

    - Iterating yields the rest of the current epoch. `loader.epoch` is the epoch the next
      batch comes from: 0 for a new loader, `e` while epoch e has batches left, `e + 1` once
      epoch e has been consumed to its end (also right after loading a state saved there).
    - `set_epoch(e)` where e is the cursor's epoch keeps the position (a no-op); so the loop
      above continues a state saved mid-epoch e with `range(e, ...)`. For a state saved at
      the end of epoch e, `set_epoch(e)` keeps the loader there and that epoch's iteration
      yields nothing; `set_epoch(e + 1)` then starts epoch e + 1. Starting the loop at e or
      at e + 1 gives the same batches as the uninterrupted run.
    - `set_epoch` to a later epoch starts it at its first batch (a fresh run may break out of
      an epoch early and move on, as with DataLoader). A loader just restored from a state is
      the exception: until its first `iter()`, only `loader.epoch` (and the saved epoch) are
      accepted; anything else would silently skip data and raises StateError.
    - `set_epoch` to an earlier epoch would replay data: StateError, saying which loop to
      write. `set_epoch(e, force=True)` moves anyway (a deliberate replay or skip).
    - Without `set_epoch`, iterating again after an epoch's end starts the next epoch.

    Lifecycle: `with Loader(...) as loader:` closes it on exit; `close()` is idempotent and
    bounded (about `CLOSE_SECONDS`: workers that do not stop are terminated, then killed), and
    the loader can be iterated again afterwards (workers restart). Loaders still open at
    interpreter exit are closed by an exit handler that runs before multiprocessing's own, so a
    script that breaks out of its loop and never calls `close()` still exits within seconds;
    `__del__` never waits. Worker processes die with the training process, by any signal.
    """

    @gc_paused  # no full collection on the path to the first batch (see shardloader.startup)
    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        *,
        shuffle: bool | None = False,
        seed: int = 0,
        num_workers: int = 0,
        transform: Transform | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        tail: str | None = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        partitions: int | None = None,
        window: int | None = None,
        worker_type: str = "process",
        transform_version: str | None = None,
        telemetry: Any = None,
        multiprocessing_context: str | None = None,
        timeout: float | None = None,
        worker_init_fn: Callable[[int], Any] | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        generator: Any = None,
        pin_memory_device: str = "",
        in_order: bool = True,
    ) -> None:
        check_dataloader_arguments(batch_size=batch_size, sampler=sampler, batch_sampler=batch_sampler,
                                   generator=generator, in_order=in_order,
                                   pin_memory_device=pin_memory_device)
        assert batch_size is not None
        prefetch_factor = 2 if prefetch_factor is None else prefetch_factor
        if prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be >= 1, got {prefetch_factor}")
        check_worker_init(worker_init_fn, num_workers, worker_type)
        self.dataset = dataset
        self._data = as_loader_dataset(dataset)  # what batches are read from
        map_style = isinstance(self._data, MapStyleDataset)
        self.batch_size = batch_size
        self.rank, self.world_size = rank_and_world(rank, world_size)
        self.global_batch_size = batch_size * self.world_size
        check_world(self.global_batch_size, self.world_size, self.rank)
        self.seed = int(seed)
        if partitions is None:
            partitions = MAP_STYLE_PARTITIONS if map_style else DEFAULT_PARTITIONS
        if window is None:
            window = MAP_STYLE_WINDOW if map_style else DEFAULT_WINDOW
        self.settings = ShuffleSettings(shuffle=bool(shuffle), partitions=partitions, window=window)
        self.tail = resolve_tail(tail, drop_last, self.world_size)
        self.num_workers = num_workers
        self.worker_type = worker_type
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers
        self.pin_memory = pin_memory
        self.transform = transform
        self.transform_version = (transform_version if transform_version is not None
                                  else None if transform is None else describe_transform(transform))
        self.telemetry = telemetry
        self._plan = StepPlan(np.diff(self._data.index.sample_offsets), self.seed, self.settings, self.rank,
                              self.world_size, self.global_batch_size, self.tail)
        self._producer = BatchProducer(self._data, seed=self.seed, transform=transform, collate_fn=collate_fn,
                                       worker_init_fn=worker_init_fn)
        self._producer.plan = self._plan
        self._mp_context = multiprocessing_context
        self._timeout = timeout or None  # DataLoader's timeout=0 means none
        self._last_batch: tuple[int, int] | None = None  # (epoch, step) of the last batch delivered
        self._pool: Any = None
        self._epoch = 0
        self._position = 0  # global positions consumed in the current epoch
        self._restored = False  # loaded from a state and not iterated since (see set_epoch)
        self._hold = False  # set_epoch(e) at the end of epoch e: the next iter() yields nothing
        self._next_task_id = 0
        self._generation = 0
        self._active: weakref.ref[_EpochIterator] | None = None
        self._stats = _make_stats()
        _LIVE_LOADERS.add(self)

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return len(self._data)

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return steps_per_epoch(self.num_samples, self.global_batch_size, self.tail)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from: the cursor's epoch, or the one after it when
        the cursor is at that epoch's end. `range(loader.epoch, E)` is the resume loop."""
        return self._epoch + 1 if self._epoch_finished() else self._epoch

    def _epoch_length(self) -> int:
        return epoch_length(self.num_samples, self.global_batch_size, self.tail)

    def _epoch_finished(self) -> bool:
        return self._position >= self._epoch_length()

    @property
    def step(self) -> int:
        """Batches delivered since epoch 0 began (the training step, restored by a resume)."""
        return self._epoch * len(self) + -(-self._position // self.global_batch_size)

    def tail_report(self) -> dict[str, int]:
        """How many samples each epoch pads or drops to give every rank equal batches."""
        n, g = self.num_samples, self.global_batch_size
        return {"padded": padded_samples(n, g, self.tail), "dropped": dropped_samples(n, g, self.tail)}

    # -- order --------------------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> EpochOrder:
        return self._plan.order(epoch)

    def step_samples(self, epoch: int, step: int, rank: int | None = None) -> np.ndarray:
        """Global sample indices of `rank`'s batch at `step` of `epoch` (no data is read)."""
        return self._plan.samples(epoch, step, rank)

    @property
    def last_indices(self) -> np.ndarray | None:
        """Global sample indices (int64, in batch order) of the batch this loader delivered
        last, whatever the batch's shape (dict, list, custom collate); None before the first.
        Dict batches from a shardloader.Dataset also carry them as `batch["__index__"]`."""
        if self._last_batch is None:
            return None
        return self._plan.samples(*self._last_batch)

    # -- epochs and state ---------------------------------------------------------------------
    def set_epoch(self, epoch: int, *, force: bool = False) -> None:
        """Make `epoch` the one to iterate (see the class docstring for the contract).

        A no-op (position kept) when `epoch` is the cursor's epoch. Raises StateError when the
        move would replay data (an earlier epoch) or, on a loader just restored from a state,
        skip data; `force=True` moves to the start of `epoch` regardless."""
        if not isinstance(epoch, numbers.Integral) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        epoch = int(epoch)
        if epoch == self._epoch:
            self._hold = self._epoch_finished()  # this epoch is over: iterating it yields nothing
            return
        if not force:
            self._check_move(epoch)
        self._epoch, self._position = int(epoch), 0
        self._restored = self._hold = False
        self._generation += 1

    def _check_move(self, epoch: int) -> None:
        where = (f"epoch {self._epoch} at position {self._position} of {self._epoch_length()}"
                 + (", restored from a saved state" if self._restored else ""))
        loop = (f"start the epoch loop at the loader's epoch: `for epoch in range(loader.epoch, "
                f"epochs): loader.set_epoch(epoch)` (loader.epoch is {self.epoch}, the epoch to "
                f"run next)")
        if epoch < self._epoch:
            raise StateError(
                f"set_epoch({epoch}) would move this loader back from {where} and replay data; "
                f"{loop}. To replay on purpose, call set_epoch({epoch}, force=True)."
            )
        if self._restored and epoch != self.epoch:
            skipped = (f"the rest of epoch {self._epoch}" if not self._epoch_finished()
                       else f"epochs {self.epoch}..{epoch - 1}")
            raise StateError(
                f"set_epoch({epoch}) would skip {skipped}: this loader is at {where}; {loop}. "
                f"To skip on purpose, call set_epoch({epoch}, force=True)."
            )

    def fingerprint(self) -> dict[str, Any]:
        return {
            "index": self._data.index.fingerprint,
            "seed": self.seed,
            **self.settings.to_dict(),
            "global_batch_size": self.global_batch_size,
            "tail": self.tail,
            "transform_version": self.transform_version,
        }

    def state_dict(self) -> dict[str, Any]:
        """The cursor: epoch and global positions consumed by batches the caller received."""
        return make_state(self._epoch, self._position, self.fingerprint())

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Resume at `state`'s cursor. Raises StateError when the fingerprint differs, unless
        `strict=False` (then it warns and resumes at the saved position anyway)."""
        state = validate_state(state)
        differences = fingerprint_differences(state["fingerprint"], self.fingerprint())
        if differences:
            message = "loader state does not match this loader: " + "; ".join(differences)
            if strict:
                raise StateError(message + " (pass strict=False to resume anyway)")
            warnings.warn(message, stacklevel=2)
        length = epoch_length(self.num_samples, self.global_batch_size, self.tail)
        position = state["position"]
        if position > length or position % self.global_batch_size and position != length:
            raise StateError(
                f"loader state position {position} is not a step boundary of an epoch of "
                f"{length} positions with global batch size {self.global_batch_size}"
            )
        self._epoch, self._position = state["epoch"], position
        self._restored, self._hold = True, False
        self._generation += 1

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        self._generation += 1
        self._restored = False
        self._finish_active()
        if self._epoch_finished():
            if self._hold:  # set_epoch(e) at the end of epoch e: nothing of it is left
                self._hold = False
                return iter(())
            self._epoch, self._position = self._epoch + 1, 0
        self._hold = False
        iterator = _EpochIterator(self, self._generation)
        self._active = weakref.ref(iterator)
        return iterator

    def _finish_active(self, timeout: float = CLOSE_SECONDS) -> None:
        """Stop the prefetch of the iterator handed out last, if it did not finish."""
        iterator = self._active() if self._active is not None else None
        self._active = None
        if iterator is not None:
            iterator._finish(release=False, timeout=timeout)

    def _get_pool(self) -> Any:
        if self._pool is None:
            self._pool = make_pool(self._producer, self.num_workers, self.worker_type,
                                   context=self._mp_context, timeout=self._timeout,
                                   prefetch_factor=self.prefetch_factor)
        return self._pool

    def _release_pool(self, force: bool = False, timeout: float = CLOSE_SECONDS) -> None:
        if self._pool is not None and (force or not self.persistent_workers):
            pool, self._pool = self._pool, None
            pool.close(timeout)

    def _new_task_id(self) -> int:
        self._next_task_id += 1
        return self._next_task_id

    def stats(self) -> dict[str, Any]:
        """Telemetry summary of the batches delivered so far (see shardloader.telemetry)."""
        summary = self._stats.summary() if self._stats is not None else {}
        summary.update({f"{k}_per_epoch": v for k, v in self.tail_report().items()})
        return summary

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Stop the workers and the prefetch, within about `timeout` seconds; idempotent.

        The loader can be iterated again afterwards (workers restart); its position is kept."""
        self._generation += 1
        deadline = time.monotonic() + timeout
        self._finish_active(timeout=timeout)
        self._release_pool(force=True, timeout=max(0.0, deadline - time.monotonic()))
        close = getattr(self._data, "close", None)
        if close is not None:
            close()  # drops this process's readers and their cache pins

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Never wait here: __del__ may run at interpreter exit or inside a garbage collection
        # on any thread. Workers are killed; pipes close with their objects.
        try:
            pool, self._pool = self._pool, None
            if pool is not None:
                abandon = getattr(pool, "abandon", None)
                if abandon is not None:
                    abandon()
                else:
                    pool.close(0.0)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


#: How long iter() waits for the first batch's bytes before it starts the workers anyway.
_PRIME_SECONDS = 30.0

#: Loaders not yet garbage-collected; closed at interpreter exit (weak: never kept alive).
_LIVE_LOADERS: weakref.WeakSet[Loader] = weakref.WeakSet()


def _close_live_loaders() -> None:
    """atexit: close every live loader, bounded, before multiprocessing's exit handler runs.

    atexit runs handlers last-registered first, and `multiprocessing.util` (imported above)
    registered its handler before this one; that handler joins non-daemon children and, at
    shutdown, a half-closed queue can wait forever on a feeder thread that cannot start.
    Then the pools' threads are waited for, bounded (`end_pools_at_exit` says why)."""
    for loader in list(_LIVE_LOADERS):
        try:
            loader.close(timeout=CLOSE_SECONDS)
        except Exception:  # noqa: BLE001 - exit must go on; a failing close loses nothing here
            pass
    end_pools_at_exit()


atexit.register(_close_live_loaders)


#: telemetry.records.BatchRecord, imported on the first batch recorded. Not a `from ... import`
#: inside `_record`: with the caches cold from the training step, that statement alone cost
#: ~15 us per next() (39 -> 54 us for the record, measured).
_BatchRecord: Any = None


def _make_stats() -> Any:
    try:
        from shardloader.telemetry import StatsAggregator
    except ImportError:
        return None
    return StatsAggregator()


class _EpochIterator:
    """Iterates the rest of one epoch for one rank; updates the loader's cursor per batch."""

    @gc_paused  # starts the workers: on the path to the first batch (see shardloader.startup)
    def __init__(self, loader: Loader, generation: int) -> None:
        self.loader = loader
        self.delivered = False  # no batch yet: the first __next__ runs under paused_gc
        self.generation = generation
        self.epoch = loader._epoch
        self.steps = len(loader)
        self.next_step = -(-loader._position // loader.global_batch_size)  # the end: steps
        self.length = epoch_length(loader.num_samples, loader.global_batch_size, loader.tail)
        check = getattr(loader._data, "check_capacity", None)
        if check is not None:  # a cache too small for this configuration fails here, not mid-epoch
            check(num_workers=loader.num_workers)
        source = getattr(loader._data, "source", None)
        expect = getattr(source, "expect_prefetch", None)
        if expect is not None:  # before the workers start: the setting travels with the dataset
            expect()
        # A source that reads the first batches' rows by byte range starts whole-shard prefetch
        # once the first batch is out, so that its downloads do not compete with those reads
        # (bandwidth, connections, CPU) for the batch a cold start waits for. Before the fork,
        # the first batch's bytes are fetched here (the workers inherit them; the fetching
        # thread has ended, the S3 client's own threads are idle and never used by a child);
        # after it, the next shards' range sidecars, for the workers.
        defer = getattr(source, "defers_prefetch", None)
        self._defer_prefetch = bool(defer(loader._data.index)) if defer is not None else False
        if self._defer_prefetch:
            self._prime_first_batch()
        self.pool = loader._get_pool()
        warm = getattr(source, "warm_ranges", None)
        if self._defer_prefetch and warm is not None:
            warm(self._first_shards(max(1, loader.num_workers) * loader.prefetch_factor))
        self.pool.discard_pending()
        self.in_flight: list[BatchTask] = []
        self.to_submit = self.next_step
        depth = max(1, loader.num_workers) * loader.prefetch_factor
        for _ in range(depth):
            self._submit_next()
        counters = getattr(loader._data.source, "counters", None)
        self._counters_at_start = counters() if counters is not None else {}
        # A local source counts nothing (its counters are zeros): no delta to take per batch.
        self._counts_locally = counters is not None and not isinstance(loader._data.source, LocalSource)
        self.prefetch_handle = None if self._defer_prefetch else self._start_prefetch()
        self.finished = False

    def _prime_first_batch(self) -> None:
        """Cold start from remote shards: fetch the bytes the first batch reads by range now,
        before the workers fork, so that its worker inherits them and needs no request, and the
        other workers' requests for the next batches do not compete with the first's (measured
        with 2 workers on loopback S3: see docs/cache.md). The imports the workers would inherit
        are done meanwhile. Bounded: a fetch still running after `_PRIME_SECONDS` is left to
        finish in the background (its worker then fetches the rows itself)."""
        loader = self.loader
        prime = getattr(loader._data, "prime", None)
        if prime is None or self.next_step >= self.steps:
            return
        forks = loader.num_workers > 0 and loader.worker_type == "process"
        if loader._pool is not None or (forks and (loader._mp_context or "fork") != "fork"):
            return  # workers already running (persistent), or started fresh: they would not inherit
        samples = loader.step_samples(self.epoch, self.next_step)
        thread = threading.Thread(target=prime, args=(samples,), name="shardloader-prime", daemon=True)
        thread.start()
        if forks:
            loader._producer.warm_up()
        thread.join(_PRIME_SECONDS)
        if thread.is_alive():
            warnings.warn(f"fetching the first batch's bytes took over {_PRIME_SECONDS:g} s; starting "
                          "the workers anyway (they fetch what they need themselves)", stacklevel=4)

    def _submit_next(self) -> None:
        loader = self.loader
        while self.to_submit < self.steps:
            step = self.to_submit
            self.to_submit += 1
            size, padded = loader._plan.counts(step)
            if size == 0:  # tail="partial": nothing falls to this rank
                continue
            # With workers, the order is computed in the worker; inline, here (same thread).
            samples = None if loader.num_workers > 0 else loader.step_samples(self.epoch, step)
            task = BatchTask(loader._new_task_id(), self.epoch, step, samples, padded, size)
            self.pool.submit(task)
            self.in_flight.append(task)
            return

    def _start_prefetch(self) -> Any:
        start = getattr(self.loader._data.source, "start_prefetch", None)
        if start is None:
            return None
        return start(self._shards_ahead())

    def _first_shards(self, steps: int) -> list[Any]:
        """The shards the next `steps` batches read (pure order arithmetic, no I/O)."""
        plan, order = self.loader._plan, self.loader._plan.order(self.epoch)
        shards: dict[int, None] = {}
        for step in range(self.next_step, min(self.steps, self.next_step + steps)):
            shards.update(dict.fromkeys(order.shards_of(plan.samples(self.epoch, step)).tolist()))
        return [self.loader._data.index.shards[shard] for shard in shards]

    def _shards_ahead(self) -> Iterator[Any]:
        """Shards this rank will read, in order of need, from the current step on."""
        loader = self.loader
        plan = loader._plan
        recent: dict[int, None] = {}
        for step in range(self.next_step, self.steps):
            shards = plan.order(self.epoch).shards_of(plan.samples(self.epoch, step))
            _, first = np.unique(shards, return_index=True)
            for shard in shards[np.sort(first)].tolist():
                if shard not in recent:
                    yield loader._data.index.shards[shard]
                recent.pop(shard, None)
                recent[shard] = None  # most recent last
                if len(recent) > 256:
                    recent.pop(next(iter(recent)))

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        if self.delivered:
            return self._next()
        with paused_gc():  # the wait for the first batch (see shardloader.startup)
            batch = self._next()
        self.delivered = True
        return batch

    def _next(self) -> Any:
        loader = self.loader
        if self.generation != loader._generation:
            raise RuntimeError("this iterator is stale: the loader was re-iterated, reloaded or closed")
        start = time.perf_counter()
        if not self.in_flight:
            self._finish()
            raise StopIteration
        task = self.in_flight.pop(0)
        queue_depth = self.pool.ready()
        try:
            batch, timings = self.pool.get(task.task_id)
        except BaseException:
            self._finish(error=True)
            raise
        self._submit_next()
        if self._defer_prefetch:
            self._defer_prefetch = False
            self.prefetch_handle = self._start_prefetch()
        if loader.pin_memory:
            batch = pin(batch)
        fetch_seconds = time.perf_counter() - start
        loader._position = min((task.step + 1) * loader.global_batch_size, self.length)
        loader._last_batch = (self.epoch, task.step)
        self._record(task, timings, fetch_seconds, queue_depth, batch)
        return batch

    def _record(self, task: BatchTask, timings: BatchTimings, fetch_seconds: float,
                queue_depth: int, batch: Any) -> None:
        loader = self.loader
        if loader._stats is None and loader.telemetry is None:
            return
        hits, misses, downloaded = timings.cache_hits, timings.cache_misses, timings.bytes_downloaded
        if self._counts_locally:
            local = self._local_counter_delta()
            hits += int(local.get("cache_hits", 0))
            misses += int(local.get("cache_misses", 0))
            downloaded += int(local.get("bytes_downloaded", 0))
        step, delivered = self.epoch * self.steps + task.step + 1, time.time()
        if loader.telemetry is None:  # the summary alone: no record to build
            loader._stats.add_batch(
                step, task.size, task.padded, fetch_seconds, delivered, timings.read_seconds,
                timings.transform_seconds, timings.download_wait_seconds, queue_depth, hits,
                misses, downloaded)
            return
        global _BatchRecord
        if _BatchRecord is None:
            from shardloader.telemetry.records import BatchRecord as _BatchRecord
        record = _BatchRecord(
            step=step, epoch=self.epoch, rank=loader.rank,
            samples=task.size, fetch_seconds=fetch_seconds, time=delivered,
            read_seconds=timings.read_seconds, transform_seconds=timings.transform_seconds,
            download_wait_seconds=timings.download_wait_seconds, queue_depth=queue_depth,
            cache_hits=hits, cache_misses=misses, bytes_downloaded=downloaded, padded=task.padded,
        )
        if loader._stats is not None:
            loader._stats.on_batch(record)
        if loader.telemetry is not None:
            loader.telemetry.on_batch(record)

    def _local_counter_delta(self) -> dict[str, float]:
        """Cache counters of this (the training) process since the last delivered batch: the
        prefetcher's downloads, and with num_workers=0 or thread workers the reads too. Worker
        processes report their own counters with each batch."""
        counters = getattr(self.loader._data.source, "counters", None)
        if counters is None:
            return {}
        now = counters()
        before, self._counters_seen = getattr(self, "_counters_seen", None), now
        if before is None:
            before = self._counters_at_start
        return {k: now.get(k, 0) - before.get(k, 0) for k in ("cache_hits", "cache_misses", "bytes_downloaded")}

    def _finish(self, error: bool = False, release: bool = True, timeout: float | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        if self.prefetch_handle is not None:
            if timeout is None:
                self.prefetch_handle.stop()  # the epoch's end: downloads are done or useless
            else:
                self.prefetch_handle.stop(timeout)
        if not release:
            return
        if error:
            self.loader._release_pool(force=True)
        else:
            self.loader._release_pool()

    def __del__(self) -> None:
        try:
            if not self.finished and self.prefetch_handle is not None:
                self.prefetch_handle.stop(0.0)  # cancel; never wait in __del__
        except Exception:  # noqa: BLE001
            pass
