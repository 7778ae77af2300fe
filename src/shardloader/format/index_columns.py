"""The in-memory columns of a dataset index (`shardloader.format.index.Index`).

The index holds one column per field instead of one ShardInfo per shard: numpy arrays and a
few bytes objects, whatever the shard count. A forked worker shares them copy-on-write and
never copies them (reference counting and the garbage collector touch a few dozen objects,
not several per shard), and a spawned one unpickles a few buffers. Each column answers for
one shard (`get(j, i)`: the j-th value the column holds, which is shard i's), and the index
builds `ShardInfo`s from them on demand. Values come back exactly as they went in: each
encoding below is chosen only where it gives every value back unchanged (a checksum column
as digest bytes only when every digest is lowercase hex of one length, a sidecar path as its
shard's path plus a suffix only where it is that, ...); anything else is kept as text or JSON.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import json
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_MISSING = object()
#: A field that all but at most this many shards have (or lack) lists those shards in a tuple.
_SHORT_LIST = 4096
def _small_ints(values: Sequence[int]) -> np.ndarray:
    """`values` (ints in int64 range) in the narrowest unsigned or int64 dtype that holds them."""
    array = np.array(values, dtype=np.int64) if len(values) else np.zeros(0, dtype=np.int64)
    if array.size and array.min() >= 0:
        top = int(array.max())
        for dtype in (np.uint8, np.uint16, np.uint32):
            if top <= np.iinfo(dtype).max:
                return array.astype(dtype)
    return array


class _Strings:
    """Strings as one UTF-8 buffer and an offsets array."""

    __slots__ = ("blob", "offsets")

    def __init__(self, values: Sequence[str]) -> None:
        joined = "".join(values)
        if joined.isascii():  # one byte per character: lengths without encoding each value
            self.blob = joined.encode("ascii")
            lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
        else:
            encoded = [v.encode("utf-8", "surrogatepass") for v in values]
            self.blob = b"".join(encoded)
            lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ends = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum(lengths, out=ends[1:])
        self.offsets = _small_ints(ends)

    def get(self, j: int, i: int) -> str:
        return self.blob[int(self.offsets[j]):int(self.offsets[j + 1])].decode("utf-8", "surrogatepass")

    @property
    def nbytes(self) -> int:
        return len(self.blob) + self.offsets.nbytes

    def __getstate__(self) -> tuple[bytes, np.ndarray]:
        return self.blob, self.offsets

    def __setstate__(self, state: tuple[bytes, np.ndarray]) -> None:
        self.blob, self.offsets = state


class _Column:
    """One field's present values, encoded; `get(j, i)`: the j-th present value, of shard i."""

    nbytes = 0

    def get(self, j: int, i: int) -> Any:
        raise NotImplementedError


class _Const(_Column):
    """Every value is the same scalar (str, int, float, bool or None)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self, j: int, i: int) -> Any:
        return self.value


class _Ints(_Column):
    def __init__(self, values: Sequence[int]) -> None:
        self.array = _small_ints(values)
        self.nbytes = self.array.nbytes

    def get(self, j: int, i: int) -> int:
        return int(self.array[j])


class _Str(_Column):
    def __init__(self, values: Sequence[str]) -> None:
        self.strings = _Strings(values)
        self.nbytes = self.strings.nbytes

    def get(self, j: int, i: int) -> str:
        return self.strings.get(j, i)


class _PathSuffix(_Column):
    """Every value is its shard's path plus one suffix (a sidecar named after its shard), but
    for a few `exceptions` (shard id -> value)."""

    def __init__(self, paths: _Strings, suffix: str, exceptions: dict[int, str]) -> None:
        self.paths, self.suffix, self.exceptions = paths, suffix, exceptions
        self.nbytes = sum(len(v) + 16 for v in exceptions.values())

    def get(self, j: int, i: int) -> str:
        if self.exceptions:
            value = self.exceptions.get(i)
            if value is not None:
                return value
        return self.paths.get(i, i) + self.suffix


class _HexDigests(_Column):
    """Every value is `prefix` + a lowercase hex digest of one length (a checksum): digests as
    bytes, half the size of their hex."""

    def __init__(self, prefix: str, digests: np.ndarray) -> None:
        self.prefix = prefix
        self.array = digests
        self.nbytes = self.array.nbytes

    def get(self, j: int, i: int) -> str:
        return self.prefix + self.array[j].tobytes().hex()


class _Json(_Column):
    """Anything else: each value's JSON text, parsed on demand (a fresh object every time)."""

    def __init__(self, values: Sequence[Any]) -> None:
        self.strings = _Strings([json.dumps(v, ensure_ascii=False, allow_nan=True) for v in values])
        self.nbytes = self.strings.nbytes

    def get(self, j: int, i: int) -> Any:
        return json.loads(self.strings.get(j, i))


class _Dicts(_Column):
    """Every value is a dict: one field per key (keys in order of first appearance)."""

    def __init__(self, values: Sequence[Mapping[str, Any]], paths: _Paths, rows: np.ndarray | None,
                 skip: frozenset[str] = frozenset()) -> None:
        """`values`: dicts (their keys other than `skip` are the fields)."""
        keys = [k for k in dict.fromkeys(itertools.chain.from_iterable(map(dict.keys, values))) if k not in skip]
        self.fields = {k: _Field.build(list(map(operator.methodcaller("get", k, _MISSING), values)), paths, rows)
                       for k in keys}
        self.nbytes = sum(f.nbytes for f in self.fields.values())

    def get(self, j: int, i: int) -> dict[str, Any]:
        out = {}
        for key, f in self.fields.items():
            value = f.get(j, i)
            if value is not _MISSING:
                out[key] = value
        return out


class _Field:
    """A column with a presence record: shard i (row j of the enclosing column) may lack it.
    Rows that have the value, or rows that lack it, whichever are fewer, are kept as a sorted
    array: an index where every shard but a few has a sidecar pays for the few."""

    __slots__ = ("column", "rows", "listed_present", "nbytes")

    def __init__(self, column: _Column, rows: np.ndarray | tuple[int, ...] | None = None,
                 listed_present: bool = False) -> None:
        self.column = column
        self.rows = rows  # None: every row has a value
        self.listed_present = listed_present  # rows lists the rows that have one (else: that lack one)
        self.nbytes = column.nbytes + (0 if rows is None else 8 * len(rows) if isinstance(rows, tuple)
                                       else rows.nbytes)

    @classmethod
    def build(cls, values: Sequence[Any], paths: _Paths, rows: np.ndarray | None = None) -> _Field:
        """`values[j]` is row j's value or `_MISSING`; `rows[j]` is row j's shard (None: j)."""
        present = [v for v in values if v is not _MISSING]
        if len(present) == len(values):
            return cls(_encode(present, paths, rows))
        mask = np.fromiter((v is not _MISSING for v in values), dtype=bool, count=len(values))
        shards = np.flatnonzero(mask) if rows is None else rows[mask]
        listed_present = 2 * len(present) <= len(values)
        listed = np.flatnonzero(mask if listed_present else ~mask)
        listed = listed.astype(np.uint32) if len(values) < 2**32 else listed
        if listed.size <= _SHORT_LIST:  # bisect on a short list: faster than numpy's call
            return cls(_encode(present, paths, shards), tuple(listed.tolist()), listed_present)
        return cls(_encode(present, paths, shards), listed, listed_present)

    def get(self, j: int, i: int) -> Any:
        rows = self.rows
        if rows is not None:
            if isinstance(rows, tuple):
                k = bisect.bisect_left(rows, j)
                hit = k < len(rows) and rows[k] == j
            else:
                k = int(np.searchsorted(rows, j))
                hit = k < rows.size and int(rows[k]) == j
            if self.listed_present:
                if not hit:
                    return _MISSING
                j = k
            else:
                if hit:
                    return _MISSING
                j -= k
        return self.column.get(j, i)


class _Paths:
    """The shards' paths while columns are built: stored (`strings`) and as a list (`names`)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.strings = _Strings(names)


def _encode(values: Sequence[Any], paths: _Paths, rows: np.ndarray | None) -> _Column:
    """The smallest column that gives `values` back unchanged. `rows[j]`: value j's shard
    (None: value j is shard j's)."""
    if not values:
        return _Const(None)
    kinds = set(map(type, values))
    if len(kinds) == 1:
        kind = next(iter(kinds))
        if kind in (str, int, bool, type(None)) and values.count(values[0]) == len(values):
            return _Const(values[0])  # not floats: -0.0 == 0.0, and NaN != NaN
        if kind is int and min(values) >= -2**63 and max(values) < 2**63:
            return _Ints(values)
        if kind is str:
            return _encode_strings(values, paths, rows)
        if kind is dict:
            return _Dicts(values, paths, rows)
    return _Json(values)


def _encode_strings(values: Sequence[str], paths: _Paths, rows: np.ndarray | None) -> _Column:
    shards = range(len(values)) if rows is None else rows.tolist()
    names = paths.names if rows is None else [paths.names[r] for r in shards]
    suffixes = collections.Counter(v[len(n):] for v, n in zip(values[:64], names) if v.startswith(n))
    for suffix, _ in suffixes.most_common(1):
        derived = [name + suffix for name in names]
        if derived != values:
            differ = [k for k, (v, d) in enumerate(zip(values, derived)) if v != d]
            if len(differ) * 64 > len(values):
                break
            return _PathSuffix(paths.strings, suffix, {shards[k]: values[k] for k in differ})
        return _PathSuffix(paths.strings, suffix, {})
    digests = hex_digests(values)
    if digests is not None:
        return _HexDigests(*digests)
    return _Str(values)


_HEX_VALUE = np.full(256, 255, dtype=np.uint8)
_HEX_VALUE[np.frombuffer(b"0123456789abcdef", dtype=np.uint8)] = np.arange(16, dtype=np.uint8)


def hex_digests(values: Sequence[str]) -> tuple[str, np.ndarray] | None:
    """(prefix, digests) when every value is one `prefix` ("algorithm:") then a lowercase hex
    digest of one even length: the digests as an (n, length/2) uint8 array. Else None."""
    first = values[0]
    prefix, sep, digest = first.partition(":")
    width = len(digest)
    if not sep or not width or width % 2 or not prefix:
        return None
    prefix += ":"
    total = len(first)
    if set(map(len, values)) != {total}:
        return None
    joined = "".join(values)
    if not joined.isascii():
        return None
    chars = np.frombuffer(joined.encode("ascii"), dtype=np.uint8).reshape(len(values), total)
    if not (chars[:, :len(prefix)] == chars[0, :len(prefix)]).all():
        return None
    nibbles = _HEX_VALUE[chars[:, len(prefix):]]
    if (nibbles == 255).any():
        return None
    return prefix, (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]


class ShardColumns:
    """The shards' entries as columns (see above)."""

    def __init__(self, paths: Sequence[str], formats: Sequence[str], samples: Sequence[int],
                 sizes: Sequence[int], checksums: Sequence[str], extras: Sequence[Mapping[str, Any]],
                 skip: frozenset[str] = frozenset()) -> None:
        """One value per shard in each argument; `extras[i]`: shard i's other keys, as a dict
        whose keys in `skip` are not extras (the parsed entries themselves can be passed)."""
        n = len(paths)
        self.count = n
        built = _Paths(list(paths))
        self.paths = built.strings
        self.format_names = tuple(dict.fromkeys(formats))
        codes = {name: code for code, name in enumerate(self.format_names)}
        self.formats = np.fromiter(map(codes.__getitem__, formats), dtype=np.uint8, count=n)
        self.samples = np.array(samples, dtype=np.int64) if n else np.zeros(0, dtype=np.int64)
        self.sizes = np.array(sizes, dtype=np.int64) if n else np.zeros(0, dtype=np.int64)
        self.checksums = _encode(list(checksums), built, None)
        extra = _Dicts(extras, built, None, skip) if extras else None
        self.extra = _Field(extra, None) if extra is not None and extra.fields else None

    @property
    def nbytes(self) -> int:
        """Bytes the columns hold (arrays and buffers; not the few objects around them)."""
        return (self.paths.nbytes + self.formats.nbytes + self.samples.nbytes + self.sizes.nbytes
                + self.checksums.nbytes + (0 if self.extra is None else self.extra.nbytes))


class _JsonObjects(_Column):
    """Each shard's extra keys as one JSON object's text ("" where it has none), parsed on
    demand: the table form of the index (`shardloader.format.index_table`) stores them so."""

    def __init__(self, strings: _Strings, where: str) -> None:
        self.strings = strings
        self.where = where
        self.nbytes = strings.nbytes

    def get(self, j: int, i: int) -> dict[str, Any]:
        from shardloader.errors import DatasetIndexError
        from shardloader.io.jsondata import parse_json

        text = bytes(self.strings.blob[int(self.strings.offsets[j]):int(self.strings.offsets[j + 1])])
        if not text:
            return {}
        value = parse_json(text, what=f"{self.where}: row {j}, column 'extra'", error=DatasetIndexError)
        if not isinstance(value, dict):
            raise DatasetIndexError(f"{self.where}: row {j}, column 'extra' must hold a JSON object")
        return value


def columns_from_buffers(paths: tuple[bytes, np.ndarray], format_names: Sequence[str], formats: np.ndarray,
                         samples: np.ndarray, sizes: np.ndarray, digests: tuple[str, np.ndarray],
                         extras: tuple[bytes, np.ndarray] | None, where: str) -> ShardColumns:
    """`ShardColumns` straight from validated buffers (no per-shard Python objects): `paths` and
    `extras` as (UTF-8 bytes or a uint8 array: a view of the mapped table is kept, not
    copied, offsets from 0), `digests` as (prefix "algorithm:", (n, width)
    uint8 array); `where` names the file in errors found later (an extra's bad JSON)."""
    columns = object.__new__(ShardColumns)
    columns.count = len(samples)
    columns.paths = _strings_of(*paths)
    columns.format_names = tuple(format_names)
    columns.formats = formats
    columns.samples = samples
    columns.sizes = sizes
    columns.checksums = _HexDigests(*digests)
    columns.extra = None if extras is None else _Field(_JsonObjects(_strings_of(*extras), where), None)
    return columns


def _strings_of(blob: bytes, offsets: np.ndarray) -> _Strings:
    strings = object.__new__(_Strings)
    strings.blob = blob
    strings.offsets = _small_ints(offsets)
    return strings
