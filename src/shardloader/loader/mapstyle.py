"""Any map-style dataset (`__len__` + `__getitem__`, e.g. a torch `Dataset`) as a Loader input.

The Loader reads through one declared interface, `shardloader.loader.protocol.LoaderDataset`
(`len()`, `get_many(samples)`, an `index` with `sample_offsets` (per-shard sample counts), a
`fingerprint` and the `shards`, and a shard `source`). `shardloader.Dataset` is that interface.
`MapStyleDataset` gives it to any other map-style dataset (`as_loader_dataset` decides which):

- The dataset is one "shard" of `len(dataset)` samples. The order module then needs nothing
  new: with one partition and a one-shard window (`MAP_STYLE_PARTITIONS`, `MAP_STYLE_WINDOW`,
  the Loader's defaults for such datasets) a shuffled epoch is one keyed permutation of all N
  samples, computable for any position in O(1) (no O(N) array, exact resume in O(1)), and
  independent of num_workers and world size like every shardloader order. Shard windows and
  partitions exist for cache and download locality, which a random-access dataset in memory or
  on a local disk does not need.
- Augmentation inside `__getitem__` is keyed per sample: `read_keyed` runs each
  `dataset[i]` with `random`, `numpy.random` and torch's global generator seeded from the
  sample's key (seed, epoch, i), then restores the process's RNG states (invariant I3). A
  generator object the dataset keeps for itself (`np.random.default_rng()` in `__init__`) is
  not keyed: its draws depend on which worker read what, as they do under DataLoader. Torch's
  generator is seeded per sample (~1 us); `random` and `numpy` only once `dataset[i]` is seen
  drawing from them (`shardloader.order.global_rngs.LazyGlobalRngScope`, as for a transform):
  the sample where it first draws from one is read again, once per generator and process.
  Seeding all three eagerly cost 25-33 us per sample on this project's 2-core machine. A
  dataset that draws no random numbers may still say so (`uses_global_rng = False`) and skip
  even the torch seeding.
- The fingerprint is the class's qualified name, the length, and the dataset's own identity
  when it offers one: a `fingerprint` attribute or method returning a string.
- It has no shard source (`NO_SHARD_SOURCE`): no cache, no prefetch, no counters.

What a user's dataset may declare (`__getitem__`, `uses_global_rng`, `fingerprint`) is read
through small protocols (`_Indexable`, `_DeclaresRngUse`, `_DeclaresFingerprint`).

shardloader's own shards stay the fast path for remote data (the verified node cache, prefetch
along the known order) and for many small samples (rows read from memory-mapped shards a
window at a time); a map-style dataset is read exactly as DataLoader would read it, one
`dataset[i]` per sample in the worker.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from shardloader.errors import DatasetChangedError
from shardloader.loader.failures import SampleFailed
from shardloader.loader.protocol import (
    KeyedReads,
    LoaderDataset,
    Stateful,
    as_native_dataset,
    is_sharded_dataset,
)
from shardloader.order.global_rngs import LazyGlobalRngScope
from shardloader.order.keys import derive_keys

MAP_STYLE_PARTITIONS = 1
MAP_STYLE_WINDOW = 1

# Keys for reading a sample are derived from its augmentation key, so that draws inside
# `dataset[i]` and draws in the Loader's `transform` of the same sample are unrelated streams.
_READ_KEY_BASE = 0x5EAD_0F_DA7A


@runtime_checkable
class _Indexable(Protocol):
    """A map-style dataset: `dataset[i]` (its length is asked for separately)."""

    def __getitem__(self, index: int) -> Any: ...


@runtime_checkable
class _DeclaresRngUse(Protocol):
    """A dataset that says whether `dataset[i]` draws random numbers."""

    uses_global_rng: bool


@runtime_checkable
class _DeclaresFingerprint(Protocol):
    """A dataset with an identity of its own: a string (or int), or a method returning one."""

    fingerprint: Any


def as_loader_dataset(dataset: Any) -> LoaderDataset:
    """What a Loader reads `dataset` through: the dataset itself when it speaks the native
    interface (`shardloader.Dataset`; see `shardloader.loader.protocol`), else a
    `MapStyleDataset`.

    Raises TypeError, saying what to use instead, for anything that is not map-style."""
    if is_sharded_dataset(dataset):
        return as_native_dataset(dataset)
    return MapStyleDataset(dataset)


class _MapStyleIndex:
    """What the Loader reads of an index: per-shard sample counts and a fingerprint."""

    shards: tuple[()] = ()

    def __init__(self, num_samples: int, fingerprint: str) -> None:
        self.num_samples = num_samples
        self.sample_offsets = np.array([0, num_samples], dtype=np.int64)
        self.fingerprint = fingerprint


class MapStyleDataset(LoaderDataset, KeyedReads):
    """Adapter: a map-style dataset read as one shard of `len(dataset)` samples (no shard
    source: samples come from `dataset[i]`)."""

    def __init__(self, dataset: Any) -> None:
        name = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
        if not isinstance(dataset, _Indexable):
            raise TypeError(
                f"Loader needs a map-style dataset (with __len__ and __getitem__, like a torch "
                f"Dataset), an iterable dataset (with __iter__) or a shardloader.Dataset; got "
                f"{name}. For WebDataset tars, read the shards with shardloader.Dataset "
                f"(`shardloader index DIR` once) or write them with `shardloader convert`."
            )
        try:
            length = len(dataset)
        except TypeError as e:
            raise TypeError(
                f"Loader needs a map-style dataset with __len__; {name} has none ({e}). An epoch "
                f"is every index in range(len(dataset)), so the length must be known up front."
            ) from None
        self.dataset = dataset
        self.name = name
        #: The dataset itself when it has a state of its own (state_dict/load_state_dict): the
        #: Loader saves and restores it (see `Loader.state_dict`).
        self.state_holder: Stateful | None = dataset if isinstance(dataset, Stateful) else None
        # The producer reads through `read_keyed` unless the dataset draws no random numbers.
        self.keyed_reads = bool(dataset.uses_global_rng) if isinstance(dataset, _DeclaresRngUse) else True
        self._identity = _identity(dataset)
        self.use_length(int(length))
        #: len(dataset) when the current iteration started: it may not change until its end.
        self.iteration_length = int(length)
        #: The global RNGs this process has seen `dataset[i]` draw from (seeded per sample).
        self._globals_in_use: set[str] = set()

    def __len__(self) -> int:
        return self.index.num_samples

    def use_length(self, length: int) -> None:
        """Read the dataset as `length` samples: the epoch's length, taken when an epoch starts
        (or the saved one, to finish a resumed epoch; see `shardloader.loader.growth`)."""
        self.index = _MapStyleIndex(length, f"{self.name} len={length}{self._identity}")

    def begin_iteration(self) -> int:
        """An iteration starts: its `len(dataset)`, which `check_length` holds it to."""
        self.iteration_length = int(len(self.dataset))
        return self.iteration_length

    def check_length(self) -> None:
        """The dataset still has the length its iteration started with (see LoaderDataset):
        between epochs it may change (the next epoch takes it), not during one."""
        length = len(self.dataset)
        if length != self.iteration_length:
            raise DatasetChangedError(
                f"{self.name}: the dataset's length changed from {self.iteration_length} to "
                f"{length} during an epoch; an epoch's order, cursor and saved states are those "
                f"of the length it started with. Change the dataset between epochs (the next "
                f"epoch takes the new length, as DataLoader's does)"
            )

    def get_many(self, samples: Sequence[int] | np.ndarray) -> list[Any]:
        """`dataset[i]` for each i, in the order given (no RNG keying)."""
        out = []
        for sample in np.asarray(samples, dtype=np.int64).tolist():
            try:
                out.append(self.dataset[sample])
            except Exception as e:  # noqa: BLE001 - the dataset's error, for this sample
                raise SampleFailed(e, sample) from None
        return out

    def read_keyed(self, samples: np.ndarray, keys: Sequence[int], lock: threading.Lock) -> list[Any]:
        """`dataset[i]` for each i, each under global RNGs seeded from a key derived from the
        sample's augmentation key. `lock` serialises threads (the global RNGs are shared)."""
        read_keys = derive_keys(_READ_KEY_BASE, np.asarray(keys, dtype=np.uint64)).tolist()
        out = []
        with lock, LazyGlobalRngScope(self._globals_in_use) as scope:
            for sample, key in zip(np.asarray(samples, dtype=np.int64).tolist(), read_keys):
                out.append(scope.run(key, lambda watching, sample=sample: self._read(sample)))
        return out

    def _read(self, sample: int) -> Any:
        try:
            return self.dataset[sample]
        except Exception as e:  # noqa: BLE001 - the dataset's error, for this sample
            raise SampleFailed(e, sample) from None

    def __repr__(self) -> str:
        return f"MapStyleDataset({self.index.fingerprint})"


def _identity(dataset: Any) -> str:
    """` fingerprint=...` from the dataset's own `fingerprint` attribute or method, or ''."""
    fingerprint = dataset.fingerprint if isinstance(dataset, _DeclaresFingerprint) else None
    if callable(fingerprint):
        fingerprint = fingerprint()
    if fingerprint is None:
        return ""
    if not isinstance(fingerprint, (str, int)):
        raise TypeError(
            f"{type(dataset).__qualname__}.fingerprint must be a string (or int) that changes "
            f"when the data changes; got {type(fingerprint).__name__}"
        )
    return f" fingerprint={fingerprint}"
