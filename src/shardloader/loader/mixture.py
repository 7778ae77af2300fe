"""`Mixture`: several datasets read as one, each drawn by its weight, exactly resumable.

    mix = shardloader.Mixture({"web": (web, 0.7), "curated": (curated, 0.3)}, epoch="curated")
    loader = shardloader.Loader(mix, batch_size=64, shuffle=True, num_workers=8)

A source is a `shardloader.Dataset` or any map-style dataset (`__len__` + `__getitem__`),
local or remote, given by name as a dataset, a `(dataset, weight)` pair, or a `MixtureSource` (with a
`transform` that makes its samples agree with the others': rename or drop fields). The Mixture
is two things:

- **A map-style dataset over the concatenation of its sources**: global index = the source's
  offset + its local index, in the order the sources are given. `get_many` reads each source's
  samples of a batch in one `get_many` call (a shardloader.Dataset reads each shard's rows at
  once), applies the source's transform, and sets a dict sample's `__index__` to its global
  index. A map-style source that augments in `__getitem__` is read under per-sample keys as
  the Loader reads any map-style dataset (`shardloader.loader.mapstyle`).
- **Its own order** (`epoch_sampler(shuffle)`, the `OrdersItself` protocol): a
  `shardloader.order.mixture.MixtureOrder`, the interleave by weights and the per-source passes,
  a pure function of (seed, epoch, position) that the Loader computes in its workers. Its
  fingerprint is the sources' identities and lengths, not the weights: a resume with new weights
  (or an added source) continues each source's pass (see docs/mixtures.md).

The epoch (`epoch=`): None (the default) is as many positions as the sources hold together;
an int is that many positions; a source's name is one pass of that source (its every sample
once, the others drawn by their weights meanwhile).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardloader.loader.failures import SampleFailed
from shardloader.loader.mapstyle import as_loader_dataset
from shardloader.loader.protocol import KeyedReads, LoaderDataset, ReadsBySource
from shardloader.order.mixture import MixtureOrder, pass_length
from shardloader.source.protocol import SOURCE_COUNTERS, ShardSource

#: What `Mixture.by_source()` counts per source.
SOURCE_FIGURES = ("samples", "read_seconds", "shard_wait_seconds", "bytes_downloaded")


@dataclass(frozen=True)
class MixtureSource:
    """One source of a `Mixture`: a dataset, its weight (relative: the weights need not sum
    to 1; 0 stops drawing from it), a transform applied to each of its samples before the
    Loader's own (deterministic: make fields agree; random augmentation belongs in the Loader's
    `transform=`, keyed per sample), and its name (the key in the Mixture's dict)."""

    dataset: Any
    weight: float = 1.0
    transform: Callable[[Any], Any] | None = None
    name: str | None = None


def as_sources(sources: Mapping[str, Any] | Sequence[MixtureSource]) -> list[MixtureSource]:
    """The `Mixture(...)` argument as named `MixtureSource`s, in order."""
    if isinstance(sources, Mapping):
        out = []
        for name, spec in sources.items():
            if isinstance(spec, MixtureSource):
                if spec.name not in (None, name):
                    raise ValueError(f"Mixture source {name!r}: its MixtureSource is named {spec.name!r}")
                out.append(MixtureSource(spec.dataset, spec.weight, spec.transform, str(name)))
            elif isinstance(spec, tuple):
                if not 2 <= len(spec) <= 3:
                    raise ValueError(f"Mixture source {name!r}: give (dataset, weight) or "
                                     f"(dataset, weight, transform), not {len(spec)} items")
                out.append(MixtureSource(spec[0], spec[1], spec[2] if len(spec) == 3 else None, str(name)))
            else:
                out.append(MixtureSource(spec, 1.0, None, str(name)))
    else:
        if not all(isinstance(s, MixtureSource) for s in sources):
            raise TypeError("Mixture: give a dict {name: dataset | (dataset, weight) | MixtureSource} "
                            "or a list of MixtureSource(dataset, weight=..., name=...)")
        out = [s if s.name is not None else MixtureSource(s.dataset, s.weight, s.transform, f"source{i}")
               for i, s in enumerate(sources)]
    if not out:
        raise ValueError("Mixture: needs at least one source")
    for s in out:
        if isinstance(s.weight, bool) or not isinstance(s.weight, (int, float)) or not s.weight >= 0:
            raise ValueError(f"Mixture source {s.name!r}: weight must be a number >= 0, got {s.weight!r}")
    if not any(s.weight > 0 for s in out):
        raise ValueError("Mixture: at least one source needs a positive weight")
    return out


class _MixtureIndex:
    """What the Loader reads of an index: one piece of `len(mixture)` samples (the order is
    the mixture's own), and the sources' identities and lengths as the fingerprint."""

    shards: tuple[()] = ()

    def __init__(self, num_samples: int, fingerprint: str) -> None:
        self.num_samples = num_samples
        self.sample_offsets = np.array([0, num_samples], dtype=np.int64)
        self.fingerprint = fingerprint


class CombinedShardSource(ShardSource):
    """The sources' shard sources seen as one for the Loader's counters (summed: bytes,
    hits, misses of every source). Each source reads, caches and fetches through its own;
    whole-shard prefetch along the mixture's order is not started (the null default)."""

    root = ""

    def __init__(self, sources: list[ShardSource]) -> None:
        self.sources = sources
        self.counts_reads = any(s.counts_reads for s in sources)  # type: ignore[misc]

    def local_path(self, info: Any) -> str:
        raise TypeError(f"{info.path}: a Mixture's shards are read through its sources")

    def counters(self) -> dict[str, float]:
        total = dict.fromkeys(SOURCE_COUNTERS, 0)
        for source in self.sources:
            for name, value in source.counters().items():
                total[name] = total.get(name, 0) + value
        return total

    def node_counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for source in self.sources:
            for name, value in source.node_counters().items():
                total[name] = total.get(name, 0) + value
        return total


class Mixture(LoaderDataset, KeyedReads, ReadsBySource):
    """Named sources drawn by weight: a map-style dataset over their concatenation that
    carries its own order (see the module docstring)."""

    def __init__(self, sources: Mapping[str, Any] | Sequence[MixtureSource], *, epoch: int | str | None = None) -> None:
        spec = as_sources(sources)
        self.names = [s.name for s in spec]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"Mixture: source names must be distinct; got {self.names}")
        self.weights = {s.name: float(s.weight) for s in spec}
        self.transforms = [s.transform for s in spec]
        self.datasets = [s.dataset for s in spec]
        self.readers: list[LoaderDataset] = []
        for s in spec:
            try:
                reader = as_loader_dataset(s.dataset)
            except TypeError as e:
                raise TypeError(f"Mixture source {s.name!r}: {e}") from None
            if len(reader) == 0:
                raise ValueError(f"Mixture source {s.name!r}: the dataset is empty")
            self.readers.append(reader)
        self.sizes = [len(r) for r in self.readers]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        identity = "; ".join(f"{n}: {r.index.fingerprint} ({len(r)} samples)"
                             for n, r in zip(self.names, self.readers, strict=True))
        self.index = _MixtureIndex(int(self.offsets[-1]), f"Mixture[{identity}]")
        self.source = CombinedShardSource([r.source for r in self.readers])
        self.keyed_reads = any(isinstance(r, KeyedReads) and r.keyed_reads for r in self.readers)
        self.epoch_length = self._epoch_length(epoch)
        self.epoch = epoch
        #: This process's running figures per source (`by_source`).
        self._figures = {name: dict.fromkeys(SOURCE_FIGURES, 0.0) for name in self.names}

    def _epoch_length(self, epoch: int | str | None) -> int:
        if epoch is None:
            return int(self.offsets[-1])
        if isinstance(epoch, str):
            return pass_length(self.names, self.sizes, list(self.weights.values()), epoch)
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"Mixture: epoch must be a positive number of samples, a source's "
                             f"name or None; got {epoch!r}")
        return epoch

    # -- its order ------------------------------------------------------------------------------
    def epoch_sampler(self, shuffle: bool) -> MixtureOrder:
        """The mixture's order, for the Loader (`OrdersItself`): each pass of a source
        permuted when `shuffle`, in sample order otherwise; the interleave is the same."""
        return MixtureOrder(self.names, self.sizes, list(self.weights.values()), self.epoch_length,
                            shuffle=shuffle, identity=self.index.fingerprint)

    # -- a map-style dataset --------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, sample: int) -> Any:
        sample = int(sample)
        if sample < 0:
            sample += len(self)
        if not 0 <= sample < len(self):
            raise IndexError(f"Mixture: sample {sample} is out of range for {len(self)} samples")
        return self.get_many(np.array([sample], dtype=np.int64))[0]

    def locate(self, samples: np.ndarray) -> np.ndarray:
        """The source of each global sample index."""
        samples = np.asarray(samples, dtype=np.int64)
        if samples.size and (samples.min() < 0 or samples.max() >= len(self)):
            raise IndexError(f"Mixture: samples must lie in [0, {len(self)}); got "
                             f"{samples.min()}..{samples.max()}")
        return np.searchsorted(self.offsets, samples, side="right") - 1

    def get_many(self, samples: Sequence[int] | np.ndarray) -> list[Any]:
        """The samples in the order given; each source's in one `get_many` call."""
        return self._read(np.asarray(samples, dtype=np.int64), None, None)

    def read_keyed(self, samples: np.ndarray, keys: Sequence[int], lock: threading.Lock) -> list[Any]:
        """As `get_many`, a source that draws random numbers in `__getitem__` read under each
        sample's key (`KeyedReads`)."""
        return self._read(np.asarray(samples, dtype=np.int64), np.asarray(keys, dtype=np.uint64), lock)

    def _read(self, samples: np.ndarray, keys: np.ndarray | None, lock: threading.Lock | None) -> list[Any]:
        which = self.locate(samples)
        out: list[Any] = [None] * samples.size
        for i in np.unique(which).tolist():
            positions = np.flatnonzero(which == i)
            local = samples[positions] - self.offsets[i]
            reader = self.readers[i]
            source = reader.source
            counted = source.counters()["bytes_downloaded"] if source.counts_reads else 0
            waited, start = reader.shard_wait_seconds(), time.perf_counter()
            try:
                if keys is not None and lock is not None and isinstance(reader, KeyedReads) and reader.keyed_reads:
                    records = reader.read_keyed(local, keys[positions].tolist(), lock)
                else:
                    records = reader.get_many(local)
            except SampleFailed as e:  # name the mixture's sample, not the source's
                sample = None if e.sample is None else int(e.sample + self.offsets[i])
                raise SampleFailed(e.error, sample) from None
            figures = self._figures[self.names[i]]
            figures["samples"] += positions.size
            figures["read_seconds"] += time.perf_counter() - start
            figures["shard_wait_seconds"] += reader.shard_wait_seconds() - waited
            if source.counts_reads:
                figures["bytes_downloaded"] += source.counters()["bytes_downloaded"] - counted
            transform = self.transforms[i]
            for pos, record in zip(positions.tolist(), records, strict=True):
                if transform is not None:
                    try:
                        record = transform(record)
                    except Exception as e:  # noqa: BLE001 - the source transform's error, for this sample
                        raise SampleFailed(e, int(samples[pos])) from None
                if isinstance(record, dict) and "__index__" in record:
                    record["__index__"] = int(samples[pos])
                out[pos] = record
        return out

    # -- what the Loader asks of a dataset, forwarded to the sources --------------------------
    def shard_wait_seconds(self) -> float:
        return float(sum(r.shard_wait_seconds() for r in self.readers))

    def by_source(self) -> dict[str, dict[str, float]]:
        """This process's figures per source since it started (`ReadsBySource`): samples read,
        seconds reading them (the source's `get_many`, shard wait included), seconds waiting
        for its shard files, bytes its reads downloaded. The Loader reports them per batch and
        sums them in `stats()` as `source.<name>.<figure>`."""
        return {name: dict(figures) for name, figures in self._figures.items()}

    def check_capacity(self, *, num_workers: int) -> None:
        for reader in self.readers:
            reader.check_capacity(num_workers=num_workers)

    def prime(self, samples: Sequence[int] | np.ndarray, *, ahead: bool = False) -> int:
        samples = np.asarray(samples, dtype=np.int64)
        which = self.locate(samples)
        return sum(self.readers[i].prime(samples[which == i] - self.offsets[i], ahead=ahead)
                   for i in np.unique(which).tolist())

    def warm_up(self) -> None:
        for reader in self.readers:
            reader.warm_up()

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def check_length(self) -> None:
        for reader in self.readers:
            reader.check_length()

    def __repr__(self) -> str:
        parts = ", ".join(f"{n!r}: ({len(r)} samples, {self.weights[n]:g})"
                          for n, r in zip(self.names, self.readers, strict=True))
        return f"Mixture({{{parts}}}, epoch={self.epoch!r})"
