"""`Loader`: a drop-in replacement for torch.utils.data.DataLoader that resumes exactly.

Batches are a pure function of (dataset, seed, epoch, settings): the order comes from
`shardloader.order`, each sample's augmentation runs under its own key, and workers return
batches in order. The loader's state is a cursor (epoch, global positions consumed) plus a
fingerprint, so `load_state_dict` costs O(1) and continues with exactly the batches an
uninterrupted run would have produced, under any `num_workers` and any world size with the
same global batch size (invariants I1–I5).

The epoch contract (invariant I10) is in `Loader`'s docstring; the lifecycle (context manager,
bounded `close()`, interpreter exit) too. The parts: the cursor (`cursor.py`), the epoch
iterator (`epoch.py`) with its shard I/O (`prefetch_policy.py`) and per-batch telemetry
(`recording.py`), the workers (`pool_keeper.py`, `workers/`), batch production
(`batches.py`), the order (`plan.py`), and what a dataset must offer (`protocol.py`).
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing.util  # noqa: F401 - registers its exit handler before ours (see below)
import numbers
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import numpy as np
from torch.utils.data import default_convert

from shardloader.errors import StateError
from shardloader.loader.batches import BatchProducer, Transform
from shardloader.loader.collate import Unbatched, collate
from shardloader.loader.compat import (
    check_dataloader_arguments,
    check_seed,
    check_worker_arguments,
    check_worker_init,
    resolve_context,
    resolve_seed,
    resolve_tail,
    warn_if_no_batches,
    warn_worker_count,
)
from shardloader.loader.cursor import check_move, check_position
from shardloader.loader.dataset_state import restore_dataset_state, saved_dataset_state
from shardloader.loader.epoch import EpochIterator
from shardloader.loader.growth import follow_length, resume_length, saved_length
from shardloader.loader.iterable_kind import loader_class
from shardloader.loader.mapstyle import (
    MAP_STYLE_PARTITIONS,
    MAP_STYLE_WINDOW,
    MapStyleDataset,
    as_loader_dataset,
)
from shardloader.loader.pinning import pins
from shardloader.loader.plan import StepPlan
from shardloader.loader.pool_keeper import PoolKeeper
from shardloader.loader.prefetch_policy import warm_first_batch
from shardloader.loader.recording import make_stats
from shardloader.loader.sampling import (
    check_distributed,
    check_sampler_arguments,
    choose_order,
    load_order_state,
    make_cursor,
    make_plan,
    order_fingerprint,
    order_views,
    saved_order_state,
)
from shardloader.loader.state import fingerprint_differences, make_state, validate_state
from shardloader.loader.workers.lifetime import CLOSE_SECONDS, end_pools_at_exit
from shardloader.order.partition import check_world
from shardloader.order.shuffle import DEFAULT_PARTITIONS, DEFAULT_WINDOW, ShuffleSettings
from shardloader.runtime.distenv import end_with_launcher, process_group_active, rank_and_world
from shardloader.runtime.startup import gc_paused
from shardloader.telemetry.job.recorder import current_attempt
from shardloader.transforms.base import transform_version as describe_transform

#: What a batch is, for type hints: `Loader[dict[str, torch.Tensor]]`.
T_co = TypeVar("T_co", covariant=True)

#: Attributes fixed at construction: assigning one raises ValueError (DataLoader refuses the
#: first six the same way). The Loader's order, fingerprint and workers are made from them,
#: so a new value would be ignored or would silently change what a saved state means.
READ_ONLY_ATTRIBUTES = frozenset({
    "batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers",
    "shuffle", "seed", "num_workers", "transform", "collate_fn", "pin_memory", "tail",
    "prefetch_factor", "rank", "world_size", "global_batch_size", "settings", "worker_type",
    "transform_version", "timeout", "multiprocessing_context", "generator",
})


class Loader(Generic[T_co]):
    """Batches of `dataset` for this rank, in a deterministic, resumable order.

    `dataset` is a `shardloader.Dataset` or any map-style dataset (`__len__` + `__getitem__`,
    e.g. a torch `Dataset`; see `shardloader.loader.mapstyle`); an iterable dataset (`__iter__`,
    no `__getitem__`) makes an `IterableLoader` (`loader.iterable`): DataLoader's semantics,
    resumed through the dataset's `state_dict()`, else by fast-forward. Arguments, defaults and
    refusals are DataLoader's (`batch_size=1`, `shuffle=False`, `drop_last=False`,
    `persistent_workers=False`, `prefetch_factor=None`: 2 with workers). `sampler=`,
    `batch_sampler=`, `batch_size=None` and `generator=` (its initial_seed() is the seed when
    `seed=` is not given) are DataLoader's too, each resumed exactly where it can be
    (docs/samplers.md; `shardloader.loader.sampling`). The attributes DataLoader has are there
    to read (without a sampler, `sampler` and `batch_sampler` describe the Loader's own order and
    forward `set_epoch`); those the order and state are made from are read-only, as DataLoader's.

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

    Epochs — one contract for fresh and resumed runs (invariant I10), DataLoader's for a fresh
    one::

        loader.load_state_dict(state)              # or Checkpointer.load(..., loader=loader)
        for epoch in range(loader.epoch, epochs):  # loader.epoch: the cursor's epoch
            loader.set_epoch(epoch)
            for batch in loader:
                ...
            ...                                    # epoch-end work: validate, step, save

    - Each `iter()` starts the cursor's epoch from its beginning, as DataLoader's does, except
      the first one after `load_state_dict()`, which continues at the saved position. A peek
      (`next(iter(loader))`) or a `break` therefore costs the next loop nothing, and `len()`
      is always what a full pass yields. An iterator starts at its first `next()`: one made
      and dropped unused moves nothing.
    - The epoch advances when an iteration over it ends (StopIteration), not when its last
      batch is handed out: `loader.epoch` is e while epoch e's loop runs, and e + 1 once it
      has ended. A state saved on epoch e's last batch is epoch e at its end; after loading
      it, epoch e's loop yields nothing and the epoch-end work runs, as in the uninterrupted
      run. From there `set_epoch(e + 1)` skips nothing and is allowed too, so resuming with
      `range(e, E)` or `range(e + 1, E)` gives the same batches.
    - `set_epoch(e)` for the cursor's epoch keeps the position (a no-op). To a later epoch it
      starts that epoch (a fresh run may break out of an epoch and move on). A loader just
      restored from a state accepts only its own epoch (and the next, from an epoch's end)
      until its first iteration: anything else would silently skip data and raises
      StateError. To an earlier epoch it would replay data: StateError, saying which loop to
      write. `set_epoch(e, force=True)` moves anyway (a deliberate replay or skip).
    - Without `set_epoch`, a loop that ran to its end moves on to the next epoch; one left by
      `break` is started again from its beginning by the next `iter()`.
    - A sample whose reading or transform raises fails its batch only: `next()` raises the
      dataset's own exception (from a worker: rebuilt with the worker's traceback and the
      sample in its message, as DataLoader does), that batch counts as consumed, and the
      next `next()` gives the next batch. A worker that dies ends the iteration (WorkerError).

    Lifecycle: `with Loader(...) as loader:` closes it on exit; `close()` is idempotent and
    bounded (about `CLOSE_SECONDS`: workers that do not stop are terminated, then killed), and
    the loader can be iterated again afterwards (workers restart). Loaders still open at
    interpreter exit are closed by an exit handler that runs before multiprocessing's own, so a
    script that breaks out of its loop and never calls `close()` still exits within seconds;
    `__del__` never waits. Worker processes die with the training process, by any signal.
    """

    def __new__(cls, dataset: Any = None, *args: Any, **kwargs: Any) -> Loader:
        """`Loader(iterable_dataset)` is an `IterableLoader` (see `iterable_kind`, `iterable`)."""
        return super().__new__(loader_class(cls, dataset) if cls is Loader else cls)

    @gc_paused  # no full collection on the path to the first batch (see shardloader.runtime.startup)
    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        *,
        shuffle: bool | None = False,
        seed: int | None = None,
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
        check_dataloader_arguments(batch_size=batch_size, in_order=in_order,
                                   pin_memory_device=pin_memory_device)
        check_sampler_arguments(batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                                batch_sampler=batch_sampler, drop_last=drop_last)
        prefetch_factor = check_worker_arguments(num_workers=num_workers, timeout=timeout,
                                                 prefetch_factor=prefetch_factor,
                                                 persistent_workers=persistent_workers,
                                                 worker_type=worker_type)
        context, start_method = resolve_context(multiprocessing_context, num_workers=num_workers,
                                                worker_type=worker_type)
        check_worker_init(worker_init_fn, num_workers, worker_type)
        warn_worker_count(num_workers, worker_type)
        if pin_memory and not pins(True):
            warnings.warn("pin_memory=True, but no accelerator is available here: batches are not "
                          "pinned (pinned memory only speeds up copies to a device)", UserWarning,
                          stacklevel=3)  # the caller of Loader(...), past the gc_paused wrapper
        self.dataset = dataset
        self._data = as_loader_dataset(dataset)  # what batches are read from
        map_style = isinstance(self._data, MapStyleDataset)
        kind, given = self._order = choose_order(dataset, shuffle=bool(shuffle), sampler=sampler,
                                                 batch_sampler=batch_sampler)
        self.batch_size = None if batch_sampler is not None else batch_size  # DataLoader's
        per_rank = batch_size or 1  # batch_size=None: one sample per step; a batch sampler's own
        self.rank, self.world_size = rank_and_world(rank, world_size)
        end_with_launcher()  # a rank orphaned by a killed torchrun agent stops (with its workers)
        self._world_from_group = rank is None or world_size is None  # checked again at iter()
        if kind.startswith("drawn"):
            check_distributed(given, self.rank, self.world_size)
        self.global_batch_size = per_rank * self.world_size
        check_world(self.global_batch_size, self.world_size, self.rank)
        self.seed = check_seed(resolve_seed(seed, generator))
        if partitions is None:
            partitions = MAP_STYLE_PARTITIONS if map_style else DEFAULT_PARTITIONS
        if window is None:
            window = MAP_STYLE_WINDOW if map_style else DEFAULT_WINDOW
        self.settings = ShuffleSettings(shuffle=bool(shuffle), partitions=partitions, window=window)
        self.shuffle = self.settings.shuffle
        self.tail = resolve_tail(tail, drop_last, self.world_size if kind in ("own", "pure") else 1)
        self.drop_last = self.tail == "drop"
        self.num_workers = num_workers
        self.worker_type = worker_type
        self.prefetch_factor = prefetch_factor  # DataLoader's: None without workers
        self.persistent_workers = persistent_workers
        self.pin_memory = pin_memory
        self.transform = transform
        self.collate_fn = collate_fn if collate_fn is not None else (
            collate if batch_size is not None else default_convert)  # DataLoader's, unbatched
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = context  # a context object, as DataLoader keeps it
        self.generator = generator  # its initial_seed() is the seed when seed= is not given
        self.timeout = 0 if timeout is None else timeout
        self.transform_version = (transform_version if transform_version is not None
                                  else None if transform is None else describe_transform(transform))
        self.telemetry = telemetry
        self._plan = make_plan(kind, given, data=self._data, seed=self.seed, settings=self.settings,
                               rank=self.rank, world_size=self.world_size, tail=self.tail,
                               global_batch_size=self.global_batch_size, batch_size=per_rank,
                               drop_last=self.drop_last)
        if kind in ("own", "pure"):
            warn_if_no_batches(self._plan.length, self.global_batch_size, self.tail)
        producer = BatchProducer(self._data, seed=self.seed, transform=transform,
                                 collate_fn=collate_fn if batch_size is not None else Unbatched(self.collate_fn),
                                 worker_init_fn=worker_init_fn)
        producer.plan = self._plan if isinstance(self._plan, StepPlan) else None  # others: in the task
        self._workers = PoolKeeper(producer, num_workers=num_workers, worker_type=worker_type,
                                   context=start_method, timeout=timeout or None,  # 0: none
                                   prefetch_factor=prefetch_factor or 2, persistent=persistent_workers,
                                   worker_dataset=dataset)
        self._cursor = make_cursor(kind, self._plan, self.global_batch_size, self.tail)
        self._active: weakref.ref[EpochIterator] | None = None
        self._stats = make_stats()
        self.sampler, self.batch_sampler = order_views(kind, given, self, batch_size, self.drop_last)
        self._initialized = True  # from here on, READ_ONLY_ATTRIBUTES are
        _LIVE_LOADERS.add(self)
        warm_first_batch(self._data, self._plan, self._cursor, self._workers)  # cold start

    def __setattr__(self, name: str, value: Any) -> None:
        initialized = self.__dict__.get("_initialized", False)
        if name == "worker_init_fn" and initialized:  # as DataLoader: honoured by workers started later
            check_worker_init(value, self.num_workers, self.worker_type)
            self._workers.producer.worker_init_fn = value
        if name in READ_ONLY_ATTRIBUTES and initialized:
            raise ValueError(
                f"{name} attribute should not be set after Loader is initialized: the order, the "
                f"state's fingerprint and the workers are made from it. Make a new Loader instead "
                f"(a state_dict() of this one loads into it if the fingerprint still matches)"
            )
        super().__setattr__(name, value)

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return len(self._data)

    def __len__(self) -> int:
        """Batches per epoch for this rank: what every full pass yields (with tail="partial"
        under world_size > 1, a rank that gets nothing of the last global batch has one less).
        A sampler without len(): TypeError, as DataLoader's."""
        return self._plan.rank_batches()

    @property
    def samples_per_epoch(self) -> int:
        """Samples this rank's batches hold per epoch (padding included)."""
        if self._order[0] not in ("own", "pure"):
            raise TypeError("samples_per_epoch counts the Loader's or a PureSampler's order; a "
                            "batch_sampler= or a sampler drawn as it goes says it itself")
        return sum(self._plan.counts(step)[0] for step in range(self._plan.global_steps))

    @property
    def epoch(self) -> int:
        """The cursor's epoch: the one being iterated, or the next once an iteration over an
        epoch has ended. `range(loader.epoch, E)` is the resume loop."""
        return self._cursor.epoch

    @property
    def step(self) -> int:
        """Batches delivered since epoch 0 began (the training step, restored by a resume);
        after epoch 0, len()'s TypeError for a sampler without len() (epochs of unknown size)."""
        if self._cursor.epoch:
            self._plan.rank_batches()
        return self._cursor.epoch * self._plan.global_steps + self._cursor.next_step

    def tail_report(self) -> dict[str, int]:
        """How many samples each epoch pads or drops to give every rank equal batches."""
        return self._plan.tail_report()

    # -- order --------------------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> Any:
        return self._plan.order(epoch)

    def step_samples(self, epoch: int, step: int, rank: int | None = None) -> np.ndarray:
        """Global sample indices of `rank`'s batch at `step` of `epoch` (no data is read)."""
        return self._plan.samples(epoch, step, rank)

    @property
    def last_indices(self) -> np.ndarray | None:
        """Global sample indices (int64, in batch order) of the batch this loader delivered
        last, whatever the batch's shape (dict, list, custom collate); None before the first.
        Dict batches from a shardloader.Dataset also carry them as `batch["__index__"]`."""
        if self._cursor.last_batch is None:
            return None
        return self._plan.samples(*self._cursor.last_batch)

    # -- epochs and state ---------------------------------------------------------------------
    def set_epoch(self, epoch: int, *, force: bool = False) -> None:
        """Make `epoch` the one to iterate (see the class docstring for the contract).

        A no-op (position kept) when `epoch` is the cursor's epoch. Raises StateError when the
        move would replay data (an earlier epoch) or, on a loader just restored from a state,
        skip data; `force=True` moves to the start of `epoch` regardless."""
        if not isinstance(epoch, numbers.Integral) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        epoch = int(epoch)
        if epoch == self._cursor.epoch:
            return
        if not force:
            check_move(self._cursor, epoch)
        self._cursor.move_to(epoch)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "index": self._data.index.fingerprint,
            "seed": self.seed,
            **self.settings.to_dict(),
            "global_batch_size": self.global_batch_size,
            "tail": self.tail,
            "transform_version": self.transform_version,
            "sampler": order_fingerprint(*self._order),
            **({"global_batch_size": None} if self._order[0].endswith("batches") else {}),
        }

    def state_dict(self) -> dict[str, Any]:
        """The cursor: epoch and global positions consumed by batches the caller received (a
        batch sampler's: batches), and the sampler's and the dataset's own states if any."""
        cursor = self._cursor
        return make_state(cursor.epoch, cursor.position, self.fingerprint(),
                          sampler=saved_order_state(*self._order, self._plan, cursor),
                          dataset=saved_dataset_state(self._data, cursor), length=saved_length(self._data))

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Resume at `state`'s cursor. Raises StateError when the fingerprint differs, unless
        `strict=False` (then it warns and resumes at the saved position anyway)."""
        state = validate_state(state)
        resume_length(self, state)  # a map-style dataset: the saved epoch's length (growth.py)
        differences = fingerprint_differences(state["fingerprint"], self.fingerprint())
        if differences:
            message = "loader state does not match this loader: " + "; ".join(differences)
            if strict:
                raise StateError(message + " (pass strict=False to resume anyway)")
            warnings.warn(message, stacklevel=2)
        length, position = self._cursor.length, state["position"]
        check_position(self._cursor, position)
        self._cursor.restore(state["epoch"], position)
        load_order_state(*self._order, self._plan, state.get("sampler"), state["epoch"], position,
                         self._cursor.next_step)
        restore_dataset_state(self._data, self._cursor, self._workers, state.get("dataset"))
        warm_first_batch(self._data, self._plan, self._cursor, self._workers)  # its first batch's
        attempt = current_attempt()
        if attempt is not None:  # where this attempt's training resumes, for the job's account
            attempt.note_cursor(self, state["epoch"] * length + position)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[T_co]:
        """The cursor's epoch from its beginning (or from a restored position); it starts at
        its first `next()`. Iterators handed out before become stale."""
        self._check_world()
        self._finish_active()
        self._cursor.invalidate()
        self._cursor.iterations += 1
        iterator = EpochIterator(self, self._cursor, self._plan, self._data, self._workers,
                                 steps=self._plan.global_steps, length=self._plan.rank_batches, rank=self.rank,
                                 pin_memory=pins(self.pin_memory),
                                 stats=self._stats, telemetry=self.telemetry,
                                 follow_length=functools.partial(follow_length, self))
        self._active = weakref.ref(iterator)
        return iterator

    def _check_world(self) -> None:
        """Refuse to iterate a Loader made for one process while a process group of several
        is active: it was made before `init_process_group` (Lightning's DDP starts the group
        inside `fit()`), and every rank would read every sample."""
        if not self._world_from_group or not process_group_active():
            return
        rank, world = rank_and_world()
        if (rank, world) != (self.rank, self.world_size):
            raise RuntimeError(
                f"this Loader was made for rank {self.rank} of {self.world_size}, but torch.distributed "
                f"now runs rank {rank} of {world}: it was made before the process group started, so "
                f"every rank would read the same samples. Make it after init_process_group (in "
                f"Lightning: in train_dataloader()), or pass rank= and world_size= (in Lightning: "
                f"trainer.global_rank, trainer.world_size)"
            )

    def _finish_active(self, timeout: float = CLOSE_SECONDS) -> None:
        """Stop the prefetch of the iterator handed out last, if it did not finish."""
        iterator = self._active() if self._active is not None else None
        self._active = None
        if iterator is not None:
            iterator.finish(release=False, timeout=timeout)

    @property
    def _pool(self) -> Any:
        """The running worker pool, or None."""
        return self._workers.pool

    def stats(self) -> dict[str, Any]:
        """Telemetry summary of the batches delivered so far (see shardloader.telemetry)."""
        summary = self._stats.summary() if self._stats is not None else {}
        summary.update({f"{k}_per_epoch": v for k, v in self.tail_report().items()})
        return summary

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Stop the workers and the prefetch, within about `timeout` seconds; idempotent.

        The loader can be iterated again afterwards (workers restart); its position is kept."""
        self._cursor.invalidate()
        self._cursor.iterations += 1
        deadline = time.monotonic() + timeout
        self._finish_active(timeout=timeout)
        self._workers.release(force=True, timeout=max(0.0, deadline - time.monotonic()))
        self._data.close()  # drops this process's readers and their cache pins

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Never wait here: __del__ may run at interpreter exit or inside a garbage collection
        # on any thread. Workers are killed; pipes close with their objects.
        try:
            self._workers.abandon()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


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
