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
read directly. Any other iterable is first written, in its own order, to a temporary Arrow
dataset in `workdir` (one extra copy of the data on local disk), then read back by row in the
permuted order through memory maps; the temporary copy is removed on exit, also on error.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from shardloader.order.keys import TAG_WRITE, derive_key
from shardloader.order.permute import feistel_permute

DEFAULT_INDEX_FIELD = "source_index"
_CHUNK = 4096  # samples read per call to the temporary dataset
# The temporary copy: large shards, all kept open, so that reading it in random order touches
# memory maps, not file opens (2 GiB x 128 covers 256 GiB before readers are reopened).
_SPILL_SHARD_BYTES = 2 << 30
_SPILL_OPEN_SHARDS = 128


def write_permutation(n: int, seed: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Input positions of output samples start..stop-1 of `n` shuffled with `seed`."""
    stop = n if stop is None else min(stop, n)
    if n <= 1:
        return np.arange(start, stop, dtype=np.int64)
    return feistel_permute(np.arange(start, stop), n, np.uint64(derive_key(TAG_WRITE, seed)))


def _with_index(sample: Mapping[str, Any], field: str | None, position: int) -> dict[str, Any]:
    if field is None or field in sample:
        # A sample that has the field already keeps it: re-sharding a converted dataset keeps
        # each sample's position in the original source.
        return dict(sample)
    return {**sample, field: position}


def _from_sequence(samples: Sequence[Mapping[str, Any]], seed: int,
                   field: str | None) -> Iterator[dict[str, Any]]:
    n = len(samples)
    for start in range(0, n, _CHUNK):
        for position in write_permutation(n, seed, start, min(start + _CHUNK, n)).tolist():
            yield _with_index(samples[position], field, position)


def _is_sequence(samples: Any) -> bool:
    return hasattr(samples, "__len__") and hasattr(samples, "__getitem__") and not isinstance(
        samples, Mapping)


@contextlib.contextmanager
def shuffled_samples(
    samples: Iterable[Mapping[str, Any]],
    seed: int,
    *,
    index_field: str | None = DEFAULT_INDEX_FIELD,
    schema: Mapping[str, str] | None = None,
    workdir: str | None = None,
) -> Iterator[tuple[Iterable[dict[str, Any]], dict[str, str] | None]]:
    """(`samples` in the permuted order, each with its input position in `index_field`; the
    schema to write them with, `schema` plus the index field, or None to infer).

    A sequence is read directly; any other iterable is spilled to a temporary dataset under
    `workdir` (the system's temporary folder when None) first.
    """
    out_schema = None if schema is None else dict(schema)
    if out_schema is not None and index_field is not None:
        out_schema.setdefault(index_field, "int64")  # kept as it is where the source has it
    if _is_sequence(samples):
        yield _from_sequence(samples, seed, index_field), out_schema  # type: ignore[arg-type]
        return
    stream = iter(samples)
    first = next(stream, None)
    if first is None:  # let the writer report the empty input, naming its destination
        yield iter(()), out_schema
        return
    from shardloader.dataset import Dataset
    from shardloader.format.writer import write_shards

    temp = tempfile.mkdtemp(prefix=".shardloader-shuffle-", dir=workdir)
    try:
        spill = os.path.join(temp, "source-order")
        indexed = (_with_index(s, index_field, i) for i, s in enumerate(itertools.chain([first], stream)))
        index = write_shards(indexed, spill, schema=out_schema, shard_bytes=_SPILL_SHARD_BYTES)
        # written just now by this process: no need to verify its checksums again
        dataset = Dataset(spill, verify=False, max_open_shards=_SPILL_OPEN_SHARDS)
        try:
            n = len(dataset)

            def permuted() -> Iterator[dict[str, Any]]:
                for start in range(0, n, _CHUNK):
                    yield from dataset.get_many(write_permutation(n, seed, start, min(start + _CHUNK, n)))

            yield permuted(), dict(index.schema)
        finally:
            dataset.close()
    finally:
        shutil.rmtree(temp, ignore_errors=True)
