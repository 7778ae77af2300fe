"""Checks and row gathering shared by every shard reader, without pyarrow.

The tar reader needs these but not pyarrow, which `shardloader.format.schema` imports: kept
here so that importing it loads no pyarrow.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from shardloader.errors import SchemaError, ShardChangedError, ShardError
from shardloader.format.arrays import sorted_unique


def check_schema(actual: Mapping[str, str], expected: Mapping[str, str], *, where: str) -> None:
    """Raise SchemaError, prefixed by `where`, naming each differing field unless equal."""
    if dict(actual) == dict(expected):
        return
    problems = []
    for name in expected:
        if name not in actual:
            problems.append(f"field {name!r} ({expected[name]}) is missing")
        elif actual[name] != expected[name]:
            problems.append(f"field {name!r} is {actual[name]}, expected {expected[name]}")
    problems += [f"unexpected field {n!r} ({actual[n]})" for n in actual if n not in expected]
    raise SchemaError(f"{where}: {'; '.join(problems)}")


def check_shard(path: str, rows: int, expected_rows: int, names: Mapping[str, str],
                schema: Mapping[str, str] | None) -> None:
    """Raise ShardError / SchemaError naming `path` unless a shard's row count and schema
    (`names`) match its index entry and the index schema (when given)."""
    if rows != expected_rows:
        raise ShardError(f"{path}: shard holds {rows} rows but the index records {expected_rows}")
    if schema is not None:
        check_schema(names, schema, where=f"{path}: schema differs from the index")


def gather_rows(
    offsets: np.ndarray,
    rows: Sequence[int] | np.ndarray,
    read_group: Callable[[int, np.ndarray], list[dict[str, Any]]],
    *,
    where: str,
) -> list[dict[str, Any]]:
    """Records of `rows` (any order, repeats allowed) of a file split into groups (record
    batches, row groups): group g holds rows offsets[g]..offsets[g+1]-1. Calls
    `read_group(g, rows within g)` once per group touched and returns records in `rows` order.
    """
    rows = np.asarray(rows, dtype=np.int64)
    total = int(offsets[-1])
    # builtins on the list: a batch reads a few rows per shard, where numpy's min and max cost
    # ~2 us each (13 shard reads per 64-sample batch)
    listed = rows.tolist()
    if listed and (min(listed) < 0 or max(listed) >= total):
        raise IndexError(f"{where}: rows out of range for a shard of {total} rows")
    if len(offsets) == 2:
        return read_group(0, rows)
    groups = np.searchsorted(offsets, rows, side="right") - 1
    out: list[Any] = [None] * len(rows)
    for group in sorted_unique(groups).tolist():
        positions = np.flatnonzero(groups == group)
        for pos, record in zip(positions.tolist(), read_group(group, rows[positions] - offsets[group])):
            out[pos] = record
    return out


#: The most bytes one `pread` returns on Linux (INT_MAX rounded down to a page): a value larger
#: than this is read in several calls.
_PREAD_MAX = 0x7FFFF000


def pread_full(fd: int, size: int, offset: int) -> bytes:
    """`size` bytes of `fd` at `offset` (fewer only at the end of the file): `os.pread`, or for
    a value over the 2 GiB one call returns at most, a buffered read that repeats it into one
    `bytes` (no second copy of a multi-GiB value)."""
    if size <= _PREAD_MAX:
        return os.pread(fd, size, offset)
    return io.BufferedReader(_PreadFile(fd, offset)).read(size)


class _PreadFile(io.RawIOBase):
    """`fd` read from `offset` on with pread (its file position, shared with other users of
    `fd`, is left alone)."""

    def __init__(self, fd: int, offset: int) -> None:
        self.fd, self.position = fd, offset

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = os.preadv(self.fd, [buffer], self.position)
        self.position += n
        return n


def pread_values(fd: int, base: int, offsets: np.ndarray, rows: np.ndarray, text: bool,
                 where: str) -> list[Any]:
    """Rows `rows` of a binary (or, with `text`, string) column read from the open file `fd`
    with pread: row r is bytes offsets[r]..offsets[r+1] of the column's data buffer, which
    starts at `base` in the file. A short read means the file shrank under its reader: a
    ShardChangedError naming `where` and the bytes."""
    starts, ends = offsets[rows].tolist(), offsets[rows + 1].tolist()
    values = [pread_full(fd, b - a, base + a) for a, b in zip(starts, ends)]
    for value, a, b in zip(values, starts, ends):
        if len(value) != b - a:
            raise ShardChangedError(
                f"{where}: the file is shorter than when it was opened (bytes {base + a}-"
                f"{base + b} read {len(value)}): it changed under the reader")
    return [str(v, "utf-8") for v in values] if text else values
