"""What a Loader may call on the dataset it reads from: the one declared seam of `loader/`.

Everything in `shardloader.loader` (the Loader, its epoch iterator, the batch producer in the
workers) reaches what it reads only through these protocols, and a dataset's shard source only
through `shardloader.source.protocol.ShardSource`: no `getattr` probes, no checks of concrete
classes. Members with a body are null defaults, inherited by explicit subclasses.

- `LoaderDataset`: what batches are read from. `shardloader.Dataset` implements all of it as
  is (it sits below `loader/` and cannot name this class); `MapStyleDataset` (any map-style
  dataset) subclasses it and keeps the defaults: no shard source, nothing to wait for, check,
  prime or close.
- `ShardedDataset`: the core of a "native" dataset (`index`, `source`, `len`, `get_many`).
  Another class with only that core is read through `CoreOnly`, the defaults filling the rest.
- `KeyedReads`: a dataset whose reads draw random numbers, and so read each sample under its
  key (a map-style dataset that augments in `__getitem__`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from shardloader.format.index import ShardInfo
from shardloader.source.protocol import ShardSource


@runtime_checkable
class DatasetIndex(Protocol):
    """What a Loader reads of an index: per-shard sample offsets, an identity, the shards."""

    sample_offsets: np.ndarray
    fingerprint: str
    shards: Sequence[ShardInfo]


class NoShardSource(ShardSource):
    """The source of a dataset without shard files (samples come from `dataset[i]`): no shard
    cache, no prefetch, no counters (every member the null default)."""

    root = ""

    def local_path(self, info: ShardInfo) -> str:
        raise TypeError(f"{info.path}: this dataset has no shard files")

    def start_prefetch(self, shard_infos: Iterable[ShardInfo]) -> None:
        """Nothing to prefetch, and no shard cache to load for it: no handle."""
        return None


#: The source of every dataset that has none.
NO_SHARD_SOURCE = NoShardSource()


@runtime_checkable
class ShardedDataset(Protocol):
    """The core a native dataset has: an index, a shard source (or None), its length, and
    `get_many(samples)`: the samples in the order given, each shard's rows read in one call."""

    index: DatasetIndex
    source: ShardSource | None

    def __len__(self) -> int: ...

    def get_many(self, samples: Sequence[int] | np.ndarray) -> list[Any]: ...


@runtime_checkable
class LoaderDataset(ShardedDataset, Protocol):
    """Everything a Loader, its epoch iterator and its batch producer call on a dataset."""

    #: The dataset's shard source, reached only through `ShardSource` (prefetch, priming,
    #: counters; see `shardloader.loader.prefetch_policy`).
    source: ShardSource = NO_SHARD_SOURCE

    def shard_wait_seconds(self) -> float:
        """Seconds this thread has waited for shard files so far (download, verification): the
        storage share of reading time, measured by the reading thread alone."""
        return 0.0

    def check_capacity(self, *, num_workers: int) -> None:
        """Refuse, before anything is read, a configuration the dataset cannot serve (a cache
        too small for reading with `num_workers` per rank). The Loader calls it when iteration
        starts."""
        return None

    def prime(self, samples: Sequence[int] | np.ndarray, *, ahead: bool = False) -> int:
        """Fetch now what reading `samples` will need, so that this process and the workers it
        forks afterwards read them without a request; returns how much was kept. `ahead`: from
        `Loader()`, before the iteration, which primes again (a failed fetch is left to it)."""
        return 0

    def warm_up(self) -> None:
        """Load now, before the Loader forks its workers, what reading loads lazily (the shard
        formats' reader code; where it costs no download, one read), so that every worker
        inherits it instead of loading it itself. Errors are the caller's to ignore."""
        return None

    def close(self) -> None:
        """Drop this process's readers (and their cache pins)."""
        return None

    def check_length(self) -> None:
        """Raise DatasetChangedError when the data's length changed during the iteration (a
        list a map-style dataset appends to): the epoch's order, the fingerprint and every
        saved position depend on it. Called as each iteration starts and after each batch. (A
        map-style dataset may change between epochs: see `shardloader.loader.growth`.)"""
        return None


@runtime_checkable
class ReadsBySource(Protocol):
    """A dataset made of named sources (a `Mixture`): `by_source()` gives this process's
    running figures per source since it started (`samples`, `read_seconds`,
    `shard_wait_seconds`, `bytes_downloaded`), which the producer reports per batch as deltas
    and `Loader.stats()` sums under `source.<name>.<figure>`."""

    def by_source(self) -> dict[str, dict[str, float]]: ...


@runtime_checkable
class KeyedReads(Protocol):
    """A dataset whose reads draw random numbers (`keyed_reads`): the producer then reads with
    `read_keyed`, each sample under global RNGs seeded from its key (invariant I3); `lock`
    serialises threads, as the global RNGs are shared."""

    keyed_reads: bool

    def read_keyed(self, samples: np.ndarray, keys: Sequence[int], lock: threading.Lock) -> list[Any]: ...


class CoreOnly(LoaderDataset):
    """A native dataset that has only the `ShardedDataset` core, read with the null defaults of
    `LoaderDataset` for the rest (a source of None: `NO_SHARD_SOURCE`)."""

    def __init__(self, dataset: ShardedDataset) -> None:
        self.dataset = dataset
        self.index = dataset.index
        self.source = NO_SHARD_SOURCE if dataset.source is None else dataset.source

    def __len__(self) -> int:
        return len(self.dataset)

    def get_many(self, samples: Sequence[int] | np.ndarray) -> list[Any]:
        return self.dataset.get_many(samples)

    def __repr__(self) -> str:
        return f"CoreOnly({self.dataset!r})"


def is_sharded_dataset(dataset: Any) -> bool:
    """Whether `dataset` speaks the Loader's native interface (`ShardedDataset`, with an index
    that is a `DatasetIndex`): shardloader.Dataset and alikes."""
    return isinstance(dataset, ShardedDataset) and isinstance(dataset.index, DatasetIndex)


def as_native_dataset(dataset: ShardedDataset) -> LoaderDataset:
    """`dataset` itself when it is a whole `LoaderDataset`, else its core with the defaults."""
    return dataset if isinstance(dataset, LoaderDataset) else CoreOnly(dataset)


# -- orders a Loader may be given (issue 38: `sampler=`, `batch_sampler=`, a dataset's own) --

@runtime_checkable
class PureSampler(Protocol):
    """A sampler whose every epoch is a pure function of (seed, epoch): exact O(1) resume,
    computed in the workers like the Loader's own order (so it must pickle).

    `len()` is the positions per epoch (the same every epoch); `samples_at(seed, epoch,
    positions)` the int64 global sample indices at those positions (0 <= position < len);
    `fingerprint` its identity, part of the Loader state's fingerprint. Optional members the
    Loader calls when present: `order_state(epoch, position) -> dict` (saved in the Loader's
    state under "sampler") and `load_order_state(state, epoch, position)` (called by
    `Loader.load_state_dict()` with that entry, before the resume). See docs/samplers.md."""

    fingerprint: str

    def __len__(self) -> int: ...

    def samples_at(self, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray: ...


@runtime_checkable
class PureBatchSampler(Protocol):
    """A batch sampler whose every epoch is a pure function of (seed, epoch): `len()` batches
    per epoch, `batches_at(seed, epoch, steps)` the int64 global sample indices of the batches
    at those steps (each a global batch: rank r of W reads its items r, r + W, ...), and a
    `fingerprint`. The optional `order_state`/`load_order_state` hooks are PureSampler's, with
    the step in place of the position."""

    fingerprint: str

    def __len__(self) -> int: ...

    def batches_at(self, seed: int, epoch: int, steps: np.ndarray) -> list[np.ndarray]: ...


@runtime_checkable
class KeepsOrderState(Protocol):
    """A pure sampler whose order depends on its history (a mixture whose weights changed at a
    resume): its state goes into the Loader's state under "sampler"."""

    def order_state(self, epoch: int, position: int) -> dict[str, Any]: ...

    def load_order_state(self, state: dict[str, Any], epoch: int, position: int) -> None: ...


@runtime_checkable
class OrdersItself(Protocol):
    """A dataset that carries its own order: with `sampler=None` the Loader reads the sampler
    `epoch_sampler(shuffle)` gives (`Loader(shardloader.Mixture(...))` gets the mixture's
    interleave so)."""

    def epoch_sampler(self, shuffle: bool) -> PureSampler: ...


@runtime_checkable
class Stateful(Protocol):
    """StatefulDataLoader's convention for a sampler or dataset with a state: `state_dict()`
    a small dict, `load_state_dict(state)` restores it (a sampler's next `iter()` then continues
    from where the state was taken)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class HoldsState(Protocol):
    """An adapter (a map-style dataset's `MapStyleDataset`) that says which object holds the
    user's dataset state: `state_holder`, a `Stateful` or None."""

    state_holder: Stateful | None


def stateful_part(dataset: Any) -> Stateful | None:
    """What holds a Loader dataset's own state (StatefulDataLoader's convention: a dataset with
    `state_dict`/`load_state_dict`), or None: the user's map-style dataset behind an adapter,
    or a native dataset that has them."""
    if isinstance(dataset, HoldsState):
        return dataset.state_holder
    return dataset if isinstance(dataset, Stateful) else None
