"""`IterableLoader`: the Loader of an iterable dataset, with DataLoader's semantics and a resume
that never silently restarts the stream.

`Loader(dataset, ...)` makes one when `dataset` is iterable (`iterable_kind`: a torch
`IterableDataset`, a Hugging Face `datasets.IterableDataset`, anything with `__iter__` and no
`__getitem__`). Batches are DataLoader's: each worker process iterates its own copy of the
dataset (which splits itself by `torch.utils.data.get_worker_info()`), batches are made per
worker and taken round robin (`iterable_pass`); with `num_workers=0` the training process
iterates it. The workers are the project's (`workers/pool.py`); what they run is
`iterable_workers.IterableProducer`.

Resume, per worker as torchdata's StatefulDataLoader does it:

- a dataset with `state_dict()`/`load_state_dict()` (a Hugging Face `IterableDataset` has
  them) is resumed exactly: the state saves each worker's dataset state as of the last batch
  delivered from that worker, whose turn is next and which workers' splits have ended; on
  load, each worker's copy is given its state before it iterates. O(1) in the position;
- a dataset without state is resumed by fast-forward: each worker iterates its copy again
  from the start and discards the batches it had delivered (`load_state_dict` warns with the
  count: O(position) reads, exact only if iterating the dataset again yields the same
  samples in the same order);
- a one-shot iterator (a generator: `iter(dataset) is dataset`) cannot be iterated again, so
  `state_dict()` raises StateError mid-epoch rather than save a state that would restart it.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

from torch.utils.data import default_convert

from shardloader.errors import StateError
from shardloader.loader.collate import collate
from shardloader.loader.compat import (
    check_dataloader_arguments,
    check_seed,
    check_worker_arguments,
    check_worker_init,
    resolve_context,
    resolve_seed,
    warn_worker_count,
)
from shardloader.loader.iterable_kind import register_iterable_loader
from shardloader.loader.iterable_pass import IterableCursor, IterablePass
from shardloader.loader.iterable_workers import IterableProducer, StatefulDataset
from shardloader.loader.loader import _LIVE_LOADERS, Loader
from shardloader.loader.mapstyle import _identity
from shardloader.loader.pinning import pins
from shardloader.loader.pool_keeper import PoolKeeper
from shardloader.loader.recording import make_stats
from shardloader.loader.state import (
    fingerprint_differences,
    make_state,
    validate_iterable,
    validate_state,
)
from shardloader.loader.workers.lifetime import CLOSE_SECONDS
from shardloader.runtime.distenv import end_with_launcher, rank_and_world
from shardloader.runtime.startup import gc_paused

#: The fingerprint's `order` for an iterable dataset: DataLoader's round robin over workers.
ITERABLE_ORDER = "iterable-round-robin-1"


@runtime_checkable
class _HasSetEpoch(Protocol):
    """A dataset that reshuffles per epoch (a Hugging Face `IterableDataset`)."""

    def set_epoch(self, epoch: int) -> None: ...


class IterableLoader(Loader):
    """A `Loader` of an iterable dataset (see the module doc); made by `Loader(dataset, ...)`.

    Takes the Loader's arguments. DataLoader's for an iterable dataset apply: `batch_size`
    (batches made per worker; `None`: unbatched samples, `collate_fn` applied to each),
    `drop_last` (per worker), `collate_fn`, `worker_init_fn` (once per worker process, before
    it iterates), `timeout`, `pin_memory`, `persistent_workers`, `prefetch_factor`,
    `multiprocessing_context`. Refused, as DataLoader refuses them, with its message:
    `shuffle=True`, `sampler=`, `batch_sampler=`; refused because they are the map-style
    order's: `transform=`, `tail=` other than DataLoader's, `partitions=`, `window=`, and
    `worker_type="thread"` with workers (threads cannot have one dataset copy each).
    `telemetry=` and `stats()` as the Loader's: a record per batch (see `iterable_pass`).

    `len(loader)` is DataLoader's: from `len(dataset)` (TypeError without one). Each
    `iter()` is a new pass, every worker iterating from its start, except the first after
    `load_state_dict()`; the epoch advances when a pass ends. `set_epoch(e)` also calls the
    dataset's own `set_epoch(e)` when it has one (a Hugging Face `IterableDataset` reshuffles
    by it, and its saved state holds its epoch). Batches have no sample indices:
    `last_indices` is None, and the map-style order's methods raise TypeError.
    """

    @gc_paused  # no full collection on the path to the first batch (see shardloader.runtime.startup)
    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        *,
        shuffle: bool | None = False,
        seed: int | None = None,
        num_workers: int = 0,
        transform: Any = None,
        collate_fn: Callable[[Any], Any] | None = None,
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
        if batch_size is None and drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually "
                             "exclusive with drop_last")
        check_iterable_arguments(shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
                                 transform=transform, transform_version=transform_version,
                                 tail=tail, drop_last=drop_last, partitions=partitions,
                                 window=window, worker_type=worker_type,
                                 num_workers=num_workers)
        check_dataloader_arguments(batch_size=batch_size, in_order=in_order,
                                   pin_memory_device=pin_memory_device)  # batch_size=None: unbatched
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
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self.tail = "drop" if drop_last else "partial"
        self.rank, self.world_size = rank_and_world(rank, world_size)
        end_with_launcher()  # a rank orphaned by a killed torchrun agent stops (with its workers)
        self.global_batch_size = batch_size  # the dataset splits itself across ranks, if at all
        self.seed = check_seed(resolve_seed(seed, generator))
        self.shuffle = False
        self.num_workers = num_workers
        self.worker_type = worker_type
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers
        self.pin_memory = pin_memory
        self.transform = self.transform_version = None
        self.telemetry = telemetry
        self._stats = make_stats()
        # DataLoader's defaults: default_collate batched, default_convert unbatched.
        self.collate_fn = collate_fn if collate_fn is not None else (
            default_convert if batch_size is None else collate)
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = context
        self.generator = generator  # its initial_seed() is the seed when seed= is not given
        self.timeout = 0 if timeout is None else timeout
        self.sampler = self.batch_sampler = None  # the dataset's iteration is the order
        self._name = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
        self._stateful = isinstance(dataset, StatefulDataset)
        self._one_shot = isinstance(dataset, Iterator)  # iter(dataset) is dataset
        producer = IterableProducer(dataset, seed=self.seed, batch_size=batch_size,
                                    drop_last=self.drop_last, collate_fn=self.collate_fn,
                                    worker_init_fn=worker_init_fn)
        self._workers = PoolKeeper(producer, num_workers=num_workers, worker_type=worker_type,
                                   context=start_method, timeout=timeout or None,  # 0: none
                                   prefetch_factor=prefetch_factor or 2, persistent=persistent_workers,
                                   worker_dataset=dataset)
        self._cursor = IterableCursor(max(1, num_workers))
        self._active: weakref.ref[IterablePass] | None = None
        self._initialized = True  # from here on, READ_ONLY_ATTRIBUTES are
        _LIVE_LOADERS.add(self)

    # -- sizes --------------------------------------------------------------------------------
    def __len__(self) -> int:
        """DataLoader's: `len(dataset)` batched by `batch_size` (TypeError when the dataset has
        no length). A dataset that splits itself across workers may yield other counts."""
        length = len(self.dataset)
        if self.batch_size is None:
            return length
        return length // self.batch_size if self.drop_last else -(-length // self.batch_size)

    def _map_style_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"a Loader of an iterable dataset ({self._name}) has no sample order of "
                        f"its own: the dataset's iteration is the order (and an epoch's length "
                        f"is known only at its end)")

    num_samples = samples_per_epoch = property(_map_style_only)  # type: ignore[assignment]

    @property
    def step(self) -> int:
        """Batches delivered since epoch 0 began (the training step, restored by a resume)."""
        return self._cursor.step

    tail_report = epoch_order = step_samples = _map_style_only  # type: ignore[assignment]

    @property
    def last_indices(self) -> None:
        """None: the batches of an iterable dataset have no sample indices."""
        return None

    # -- epochs and state ---------------------------------------------------------------------
    def set_epoch(self, epoch: int, *, force: bool = False) -> None:
        """Make `epoch` the one to iterate (the map-style contract: a no-op for the cursor's
        epoch; StateError for an earlier one, or a later one on a loader just restored, unless
        `force`), and call the dataset's own `set_epoch(epoch)` when it has one."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        cursor = self._cursor
        if epoch != cursor.epoch and not force:
            where = (f"epoch {cursor.epoch} after {cursor.delivered} batches"
                     + (", restored from a saved state" if cursor.restored else ""))
            if epoch < cursor.epoch or cursor.restored:
                raise StateError(
                    f"set_epoch({epoch}) would {'replay' if epoch < cursor.epoch else 'skip'} data: "
                    f"this loader is at {where}. Start the epoch loop at the loader's epoch: `for "
                    f"epoch in range(loader.epoch, epochs): loader.set_epoch(epoch)`; to move on "
                    f"purpose, call set_epoch({epoch}, force=True)")
        if isinstance(self.dataset, _HasSetEpoch):
            self.dataset.set_epoch(epoch)
        if epoch != cursor.epoch:
            cursor.move_to(epoch)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "index": f"iterable {self._name}{_identity(self.dataset)}",
            "seed": self.seed,  # the workers' get_worker_info().seed, and their global RNGs'
            "shuffle": False, "partitions": None, "window": None,
            "order": ITERABLE_ORDER,
            "global_batch_size": self.batch_size,
            "tail": self.tail,
            "transform_version": None,
        }

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the batches delivered in it, and per worker its position and its
        dataset's state (see `shardloader.loader.state`). Raises StateError mid-epoch for a
        one-shot iterator without state (nothing could bring it back there)."""
        cursor = self._cursor
        if self._one_shot and not self._stateful and cursor.delivered:
            raise StateError(
                f"{self._name} cannot be resumed mid-epoch: it has no state_dict()/"
                f"load_state_dict(), and it is a one-shot iterator (iter(dataset) is dataset, "
                f"a generator say), so iterating it again cannot replay the {cursor.delivered} "
                f"batches delivered to fast-forward past them. Give it state_dict()/"
                f"load_state_dict() (StatefulDataLoader's convention), make it iterable again "
                f"from its start (a torch IterableDataset whose __iter__ is a generator "
                f"function), or save at an epoch's end")
        state = make_state(cursor.epoch, cursor.delivered, self.fingerprint())
        state["iterable"] = {"num_workers": self.num_workers, **cursor.to_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Resume at `state`. Raises StateError when it is not this loader's (the dataset's
        class and fingerprint, batch size, drop_last, seed, num_workers), unless `strict=False`
        (then it warns); warns with the cost when the dataset resumes by fast-forward."""
        state = validate_state(state)
        section = validate_iterable(state, self.num_workers)
        differences = fingerprint_differences(state["fingerprint"], self.fingerprint())
        if differences:
            message = "loader state does not match this loader: " + "; ".join(differences)
            if strict:
                raise StateError(message + " (pass strict=False to resume anyway)")
            warnings.warn(message, stacklevel=2)
        saved_states = any(w["state"] is not None for w in section["workers"])
        if saved_states and not self._stateful:
            raise StateError(f"loader state holds dataset states, and {self._name} has no "
                             f"load_state_dict() to take them")
        skipped = [0 if w["ended"] or w["state"] is not None else w["batches"] for w in section["workers"]]
        if sum(skipped):
            per_worker = ", ".join(f"worker {i}: {n}" for i, n in enumerate(skipped))
            warnings.warn(
                f"{self._name} resumes by fast-forward: it has no state_dict()/load_state_dict(), "
                f"so the next pass iterates it again from its start and reads and discards the "
                f"{sum(skipped)} batches delivered before ({per_worker}): O(position) reads, exact "
                f"only if iterating it again yields the same samples in the same order. Give it "
                f"state_dict()/load_state_dict() to resume in O(1)", UserWarning, stacklevel=2)
        self._cursor.restore(state["epoch"], section)

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        """A new pass (or the restored one), started at its first `next()`. Without persistent
        workers, the last pass's workers go first: each pass iterates fresh copies of the
        dataset, as DataLoader's does."""
        self._finish_active()
        if not self.persistent_workers:
            self._workers.release(force=True)
        self._cursor.invalidate()
        self._cursor.iterations += 1
        try:
            length: int | None = len(self)
        except TypeError:
            length = None
        iterator = IterablePass(self, self._cursor, self._workers, pin_memory=pins(self.pin_memory),
                                length=length, rank=self.rank, stats=self._stats,
                                telemetry=self.telemetry)
        self._active = weakref.ref(iterator)  # type: ignore[assignment]
        return iterator

    def stats(self) -> dict[str, Any]:
        """Telemetry summary of the batches delivered so far (see shardloader.telemetry)."""
        return self._stats.summary() if self._stats is not None else {}

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Stop the workers within about `timeout` seconds; idempotent. The position is kept."""
        self._cursor.invalidate()
        self._cursor.iterations += 1
        deadline = time.monotonic() + timeout
        self._finish_active(timeout=timeout)
        self._workers.release(force=True, timeout=max(0.0, deadline - time.monotonic()))


def check_iterable_arguments(*, shuffle: Any, sampler: Any, batch_sampler: Any, transform: Any,
                             transform_version: Any, tail: Any, drop_last: bool, partitions: Any,
                             window: Any, worker_type: str, num_workers: int) -> None:
    """Refuse, with DataLoader's messages where DataLoader refuses them, the arguments an
    iterable dataset's Loader does not take."""
    for name, value in (("shuffle", shuffle), ("sampler", sampler), ("batch_sampler", batch_sampler)):
        if value is not None and not (name == "shuffle" and value is False):
            raise ValueError(f"DataLoader with IterableDataset: expected unspecified {name} option, "
                             f"but got {name}={value}")
    if transform is not None or transform_version is not None:
        raise ValueError("transform= is not supported for an iterable dataset: its samples have no "
                         "index to key augmentation by. Apply it in the dataset's __iter__ (or in "
                         "collate_fn)")
    if tail is not None and tail != ("drop" if drop_last else "partial"):
        raise ValueError(f"tail={tail!r} is not supported for an iterable dataset: its batches are "
                         f"made per worker, as DataLoader's; use drop_last=")
    if partitions is not None or window is not None:
        raise ValueError("partitions= and window= shape the Loader's own shuffle; an iterable "
                         "dataset's iteration is its order")
    if worker_type == "thread" and num_workers > 0:
        raise ValueError("worker_type='thread' cannot read an iterable dataset: each worker "
                         "iterates its own copy of it, which threads cannot have; use "
                         "worker_type='process'")


register_iterable_loader(IterableLoader)
