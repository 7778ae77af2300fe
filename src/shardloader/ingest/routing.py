"""Where each row goes when a distributed engine writes shuffled shards, from its content alone.

`write_shards(shuffle=True)` on one machine writes every sample at a seeded random position,
so every shard is a uniform sample of the dataset. An engine's partitions can be anything: a
DataFrame sorted by class, range-partitioned, one class per partition; shuffling each partition
on its own would leave such shards holding one class. So shuffled engine writes move rows
between partitions, decided here by a keyed hash of each row's values (`row_digests`):

- the output partition of a row is its digest's first 8 bytes modulo the partition count: each
  output partition is a uniform random subset of the rows;
- inside an output partition, rows are written sorted by their digest: a uniform random order.

The digest depends on the row's values and the seed only, never on which engine, partition or
attempt saw the row, so the same rows give the same partitions, the same order and the same
shards (byte for byte) whichever engine moved them, and a retried task writes what the first
attempt would have. Identical rows get identical digests; their relative order does not change
the bytes written. Distinct rows collide with probability about n^2 / 2^129 (xxh3_128).

The engine adapters add the two columns (`with_shuffle_keys`, one pass over each input
partition), group by `ROUTE_FIELD` (the engine's own exchange), and hand each group to
`shardloader.ingest.parts.write_part`, which sorts by `ORDER_FIELD` and drops both.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from shardloader.format.schema import batch_records
from shardloader.order.keys import TAG_WRITE, derive_key

ROUTE_FIELD = "__route__"  # int64: the output partition of the row
ORDER_FIELD = "__order__"  # binary, 16 bytes: the row's digest, its sort key inside the partition
KEY_FIELDS = (ROUTE_FIELD, ORDER_FIELD)
_MASK64 = (1 << 64) - 1


def _feed(hasher: Any, value: Any) -> None:
    """Update `hasher` with `value` in a form that tells values (and their types) apart."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        hasher.update(b"b%d:" % len(data))
        hasher.update(data)
    elif isinstance(value, str):
        data = value.encode()
        hasher.update(b"s%d:" % len(data))
        hasher.update(data)
    elif isinstance(value, np.ndarray):
        hasher.update(f"a{value.dtype.str}{value.shape}:".encode())
        hasher.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        hasher.update(b"d%d:" % len(value))
        for key, item in value.items():
            _feed(hasher, str(key))
            _feed(hasher, item)
    elif isinstance(value, (list, tuple)):
        hasher.update(b"l%d:" % len(value))
        for item in value:
            _feed(hasher, item)
    else:  # int, float, bool, numpy scalars: repr is exact and names the kind
        hasher.update(f"v{type(value).__name__}:{value!r};".encode())


def row_digests(batch: pa.RecordBatch, seed: int) -> list[bytes]:
    """The 16-byte keyed digest of every row of `batch` (fields in the batch's order)."""
    key = derive_key(TAG_WRITE, seed, 1) & _MASK64
    out = []
    for record in batch_records(batch, np.arange(batch.num_rows)):
        hasher = xxhash.xxh3_128(seed=key)
        for value in record.values():
            _feed(hasher, value)
        out.append(hasher.digest())
    return out


def with_shuffle_keys(batch: pa.RecordBatch, seed: int, partitions: int) -> pa.RecordBatch:
    """`batch` plus `ROUTE_FIELD` (output partition, 0..partitions-1) and `ORDER_FIELD`."""
    if partitions <= 0:
        raise ValueError(f"partitions must be positive, got {partitions}")
    digests = row_digests(batch, seed)
    routes = [int.from_bytes(d[:8], "big") % partitions for d in digests]
    return pa.RecordBatch.from_arrays(
        [*batch.columns, pa.array(routes, pa.int64()), pa.array(digests, pa.binary())],
        names=[*batch.schema.names, *KEY_FIELDS],
    )


def keyed_schema(schema: pa.Schema) -> pa.Schema:
    """The Arrow schema of `with_shuffle_keys`'s output for input `schema`."""
    return schema.append(pa.field(ROUTE_FIELD, pa.int64())).append(pa.field(ORDER_FIELD, pa.binary()))


def in_write_order(batches: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
    """One output partition's keyed rows sorted by `ORDER_FIELD`, key columns dropped."""
    if not batches:
        return []
    table = pa.Table.from_batches(batches).sort_by(ORDER_FIELD).drop_columns(list(KEY_FIELDS))
    return table.to_batches()
