"""Samples in a seeded random order, for writing shards that are already mixed.

Why shuffle at write time: a loader can only mix the shards it holds at once (see
`shardloader.order`). When the input is sorted — an image folder listed class by class, a log
written by time — every shard holds one kind of sample; mixing at read time then costs either
many resident shards or batches of few classes. Written in a random order, every shard is a
uniform sample of the dataset, and any read order mixes.

The order is a keyed permutation of the input positions (a pure function of the sample count
and `seed`): output sample j is input sample `perm(j)`. The input position is stored in a field
(`source_index` by default), so the source order stays recoverable: sort by that field.

Random access is needed to read the input in that order. A sequence (len() and indexing) is
read directly (`permuted_sequence`). Any other iterable is first written, in its own order, to
a temporary Arrow dataset (one extra copy of the data on local disk), then read back by row in
the permuted order through memory maps (`permuted_rows`); the writer makes and removes that
copy (`shardloader.ingest.writer`), since writing it is the writer's job and this module only
decides the order: it imports no writer and no dataset.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from shardloader.order.keys import TAG_WRITE, derive_key
from shardloader.order.permute import feistel_permute

DEFAULT_INDEX_FIELD = "source_index"
_CHUNK = 4096  # samples read per call to the random-access input


class RowReader(Protocol):
    """What `permuted_rows` reads: a dataset of `len()` rows, read by position in batches."""

    def __len__(self) -> int: ...

    def get_many(self, indices: Any) -> list[dict[str, Any]]: ...


def write_permutation(n: int, seed: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Input positions of output samples start..stop-1 of `n` shuffled with `seed`."""
    stop = n if stop is None else min(stop, n)
    if n <= 1:
        return np.arange(start, stop, dtype=np.int64)
    return feistel_permute(np.arange(start, stop), n, np.uint64(derive_key(TAG_WRITE, seed)))


def with_index(sample: Mapping[str, Any], field: str | None, position: int) -> dict[str, Any]:
    """`sample` with its input `position` in `field` (None: not stored)."""
    if field is None or field in sample:
        # A sample that has the field already keeps it: re-sharding a converted dataset keeps
        # each sample's position in the original source.
        return dict(sample)
    return {**sample, field: position}


def permuted_sequence(samples: Sequence[Mapping[str, Any]], seed: int,
                      field: str | None) -> Iterator[dict[str, Any]]:
    """The samples of a sequence in the order of `seed`, each with its position in `field`."""
    n = len(samples)
    for start in range(0, n, _CHUNK):
        for position in write_permutation(n, seed, start, min(start + _CHUNK, n)).tolist():
            yield with_index(samples[position], field, position)


def permuted_rows(rows: RowReader, seed: int) -> Iterator[dict[str, Any]]:
    """The rows of a random-access dataset in the order of `seed` (read `_CHUNK` at a time)."""
    n = len(rows)
    for start in range(0, n, _CHUNK):
        yield from rows.get_many(write_permutation(n, seed, start, min(start + _CHUNK, n)))


def is_sequence(samples: Any) -> bool:
    """True for inputs read by index (len() and indexing, not a mapping)."""
    return hasattr(samples, "__len__") and hasattr(samples, "__getitem__") and not isinstance(
        samples, Mapping)


def shuffled_schema(schema: Mapping[str, str] | None, field: str | None) -> dict[str, str] | None:
    """The schema to write shuffled samples with: `schema` plus the int64 index `field` (kept as
    it is where the source has it), or None to infer it."""
    out = None if schema is None else dict(schema)
    if out is not None and field is not None:
        out.setdefault(field, "int64")
    return out
