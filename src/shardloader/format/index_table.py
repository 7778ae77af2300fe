"""The table form of a dataset index: the shards in an Arrow IPC file beside `index.json`.

An index of 10^6 shards as one JSON list is ~260 MB that takes ~30 s to open (parsing,
validating entry by entry, building columns, hashing for the fingerprint). In the table form
`index.json` keeps its header and, instead of ``shards``, names the table::

    "shard_table": {"path": "index.shards.arrow", "bytes": N, "checksum": "xxh3_128:...",
                    "rows": S, "formats": ["arrow", "tar"], "checksum_algorithm": "xxh3_128"}

The table (one record batch, uncompressed, no nulls) has the columns ``path`` (utf8),
``format`` (uint8: a position in ``formats``), ``samples`` and ``bytes`` (int64), ``digest``
(binary: each shard's checksum digest, all of ``checksum_algorithm``) and ``extra`` (utf8: the
entry's format-specific keys as a JSON object, "" where none). It is written and read with
pyarrow: its size and checksum are checked against `index.json`, the record batch with
pyarrow's full validation (offsets in order and inside their buffers, UTF-8 valid), then every
column at once with numpy views of its buffers, before any Python object per shard exists. An
error names the file, the column and the row.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from shardloader.errors import DatasetIndexError, UnsafePathError
from shardloader.format.index import INDEX_FORMAT, MAX_SAMPLES, MAX_SHARD_BYTES, Index
from shardloader.format.index_columns import ShardColumns, columns_from_buffers, hex_digests
from shardloader.format.registry import FORMATS
from shardloader.io.checksum import DEFAULT_ALGORITHM, checksum_bytes, new_hasher, parse_checksum
from shardloader.io.paths import safe_relative_path

TABLE_NAME = "index.shards.arrow"
TABLE_KEY = "shard_table"
_COLUMNS = (("path", "varlen", True), ("format", "number", False), ("samples", "number", False),
            ("bytes", "number", False), ("digest", "varlen", False), ("extra", "varlen", True))
_TYPES = {"format": "uint8", "samples": "int64", "bytes": "int64"}  # pyarrow's names (str(type))
_ENTRY_KEYS = {"path", "bytes", "checksum", "rows", "formats", "checksum_algorithm"}


# -- writing ----------------------------------------------------------------------------------
def table_form(index: Index, name: str = TABLE_NAME) -> tuple[bytes, bytes] | None:
    """(`index.json` bytes, table bytes) of `index` in the table form; None when its checksums
    are not all one algorithm's lowercase hex digests of one length (then only JSON holds it)."""
    import pyarrow as pa  # at write time only

    shards = index.shards
    checksums = [s.checksum for s in shards]
    digests = hex_digests(checksums) if checksums else (f"{DEFAULT_ALGORITHM}:", np.zeros((0, 16), np.uint8))
    if digests is None:
        return None
    prefix, digest_array = digests
    algorithm = prefix[:-1]
    try:
        parse_checksum(f"{algorithm}:00")
    except ValueError:
        return None
    if digest_array.shape[1] != new_hasher(algorithm).digest_size:
        return None
    formats = list(dict.fromkeys(s.format for s in shards))
    codes = {f: i for i, f in enumerate(formats)}
    batch = pa.record_batch({
        "path": pa.array([s.path for s in shards], pa.string()),
        "format": pa.array([codes[s.format] for s in shards], pa.uint8()),
        "samples": pa.array([s.samples for s in shards], pa.int64()),
        "bytes": pa.array([s.bytes for s in shards], pa.int64()),
        "digest": pa.array([row.tobytes() for row in digest_array], pa.binary()),
        "extra": pa.array([json.dumps(dict(s.extra), sort_keys=True, ensure_ascii=False) if s.extra else ""
                           for s in shards], pa.string()),
    })
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)  # one batch, even of no rows
    data = sink.getvalue().to_pybytes()
    document = {
        "format": INDEX_FORMAT,
        "version": index.version,
        "schema": dict(index.schema),
        TABLE_KEY: {"path": name, "bytes": len(data), "checksum": checksum_bytes(data),
                    "rows": len(shards), "formats": formats, "checksum_algorithm": algorithm},
    }
    text = json.dumps(document, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    return text.encode(), data


# -- reading ----------------------------------------------------------------------------------
def table_entry(entry: Any, *, source: str) -> dict[str, Any]:
    """The validated ``shard_table`` entry of `index.json` (`source`)."""
    where = f"{source}: {TABLE_KEY!r}"
    if not isinstance(entry, dict) or set(entry) != _ENTRY_KEYS:
        raise DatasetIndexError(f"{where} must be an object with the keys {', '.join(sorted(_ENTRY_KEYS))}")
    try:
        path = safe_relative_path(entry["path"], what=where)
    except UnsafePathError as e:
        raise UnsafePathError(f"{e} (in the index)") from None
    for key, bound in (("bytes", 2**62), ("rows", MAX_SAMPLES)):
        value = entry[key]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= bound:
            raise DatasetIndexError(f"{where}: field {key!r} must be an integer in 0..{bound}, got {value!r}")
    formats = entry["formats"]
    if not isinstance(formats, list) or len(formats) > 255 or not all(
            isinstance(f, str) and f in FORMATS for f in formats):
        raise DatasetIndexError(f"{where}: field 'formats' must list known shard formats "
                                f"(known: {', '.join(FORMATS)}), got {formats!r}")
    try:
        if not isinstance(entry["checksum"], str):
            raise ValueError("field 'checksum' must be a string")
        parse_checksum(entry["checksum"])
        new_hasher(entry["checksum_algorithm"])
    except (ValueError, TypeError) as e:
        raise DatasetIndexError(f"{where}: {e}") from None
    return {**entry, "path": path}


def read_table(data: Any, entry: Mapping[str, Any], *, source: str) -> ShardColumns:
    """The shards' columns from the table bytes `data` (bytes or an mmap), checked against the
    ``shard_table`` `entry` (see `table_entry`); `source` names the table file in errors."""
    if len(data) != entry["bytes"]:
        raise DatasetIndexError(f"{source}: the shard table has {len(data)} bytes, index.json says "
                                f"{entry['bytes']}: the dataset is damaged or half-copied")
    algorithm = parse_checksum(entry["checksum"])[0]
    if checksum_bytes(data, algorithm) != entry["checksum"]:
        raise DatasetIndexError(f"{source}: the shard table's checksum differs from the one in index.json "
                                "(the file is damaged or does not belong to this index)")
    views = _columns(data, entry, source)
    n = entry["rows"]
    samples, sizes, codes = views["samples"][0], views["bytes"][0], views["format"][0]
    _check_range(samples, MAX_SAMPLES, "samples", source)
    _check_range(sizes, MAX_SHARD_BYTES, "bytes", source)
    _check_range(codes, len(entry["formats"]) - 1, "format", source)
    if n and float(samples.sum(dtype=np.float64)) > 2.0 * MAX_SAMPLES or int(samples.sum()) > MAX_SAMPLES:
        raise DatasetIndexError(f"{source}: column 'samples' adds up to more than the {MAX_SAMPLES} "
                                "a dataset may hold (shardloader.format.index.MAX_SAMPLES)")
    width = new_hasher(entry["checksum_algorithm"]).digest_size
    offsets, blob = views["digest"]
    bad = np.flatnonzero(np.diff(offsets) != width)
    if bad.size:
        raise DatasetIndexError(f"{source}: column 'digest', row {int(bad[0])}: a digest of "
                                f"{int(offsets[bad[0] + 1] - offsets[bad[0]])} bytes, not {width}")
    digests = blob[int(offsets[0]):int(offsets[-1])].reshape(n, width)
    paths = _check_paths(*views["path"], source)
    extra_offsets, extra_blob = views["extra"]
    extras = None
    if int(extra_offsets[-1]) > int(extra_offsets[0]):
        extras = (extra_blob[int(extra_offsets[0]):int(extra_offsets[-1])],
                  (extra_offsets - extra_offsets[0]).astype(np.int64))
    return columns_from_buffers(paths, entry["formats"], codes, samples, sizes,
                                (f"{entry['checksum_algorithm']}:", digests), extras, source)


def _columns(data: Any, entry: Mapping[str, Any], source: str) -> dict[str, tuple[np.ndarray, ...]]:
    """Per column, numpy views of its buffers: (values,) for a number, (offsets, bytes) for
    binary and string; the table checked to be one valid record batch of the expected columns,
    without nulls, of `entry["rows"]` rows."""
    import pyarrow as pa

    try:
        reader = pa.ipc.open_file(pa.py_buffer(data))
        batch = reader.get_batch(0) if reader.num_record_batches == 1 else None
        if batch is not None:
            batch.validate(full=True)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DatasetIndexError(f"{source}: not a shard table (an Arrow IPC file of one valid record "
                                f"batch): {e}") from None
    if batch is None:
        raise DatasetIndexError(f"{source}: not a shard table (an Arrow IPC file of one record batch): "
                                f"it holds {reader.num_record_batches}")
    found = [(f.name, *_kind(f.type)) for f in batch.schema]
    if found != list(_COLUMNS) or any(str(f.type) != _TYPES[f.name] for f in batch.schema if f.name in _TYPES):
        raise DatasetIndexError(f"{source}: the shard table's columns are {found}, expected {list(_COLUMNS)}")
    if any(column.null_count for column in batch.columns):
        raise DatasetIndexError(f"{source}: the shard table holds nulls")
    if batch.num_rows != entry["rows"]:
        raise DatasetIndexError(f"{source}: the shard table has {batch.num_rows} rows, index.json "
                                f"says {entry['rows']}")
    return {name: _views(column) for name, column in zip(batch.schema.names, batch.columns)}


def _kind(dtype: Any) -> tuple[str, bool]:
    """("varlen", is text) for binary and string types, ("number", False) for others."""
    import pyarrow as pa

    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return "varlen", True
    if pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype):
        return "varlen", False
    return ("number", False) if pa.types.is_integer(dtype) else (str(dtype), False)


def _views(array: Any) -> tuple[np.ndarray, ...]:
    """Zero-copy numpy views of a validated column without nulls."""
    from shardloader.format.schema import numeric_view

    if _kind(array.type)[0] == "number":
        return (numeric_view(array),)
    _, offsets, values = array.buffers()
    width = 8 if str(array.type) in ("large_string", "large_binary") else 4
    offsets = np.frombuffer(offsets, dtype=f"<i{width}", count=len(array) + 1, offset=array.offset * width)
    return offsets, (np.frombuffer(values, dtype=np.uint8) if values is not None else np.empty(0, np.uint8))


def _check_range(values: np.ndarray, top: int, name: str, source: str) -> None:
    bad = np.flatnonzero((values < 0) | (values > top))
    if bad.size:
        row = int(bad[0])
        raise DatasetIndexError(f"{source}: column {name!r}, row {row}: {int(values[row])} is outside "
                                f"0..{top}: the index is damaged; rebuild it")


_SLASH, _DOT = ord("/"), ord(".")


def _check_paths(offsets: np.ndarray, blob: np.ndarray, source: str) -> tuple[bytes, np.ndarray]:
    """The paths' (UTF-8 bytes, offsets from 0), each checked safe and normal, none repeated.
    Bytes that might make a path unsafe or not normal (controls, non-ASCII, '\\', ':', a '/' or
    '.' at a name's edge) flag their row for `safe_relative_path`; the rest are plain names."""
    first = int(offsets[0])
    offsets = offsets.astype(np.int64) - first
    data = blob[first:first + int(offsets[-1])]
    n = len(offsets) - 1
    lengths = np.diff(offsets)
    if n == 0:
        return b"", offsets
    suspect = (data < 0x20) | (data >= 0x7F) | (data == ord("\\")) | (data == ord(":"))
    slash = data == _SLASH
    edge = slash[1:] & ((data[:-1] == _DOT) | slash[:-1])
    edge |= slash[:-1] & (data[1:] == _DOT)
    suspect[1:] |= edge
    rows = set((np.searchsorted(offsets, np.flatnonzero(suspect), side="right") - 1).tolist())
    nonempty = lengths > 0
    starts, ends = offsets[:-1][nonempty], offsets[1:][nonempty] - 1
    edges = (data[starts] == _SLASH) | (data[starts] == _DOT) | (data[ends] == _SLASH) | (data[ends] == _DOT)
    rows.update(np.flatnonzero(nonempty)[edges].tolist())
    rows.update(np.flatnonzero(~nonempty).tolist())
    buffer = data.tobytes()
    for row in sorted(rows):
        where = f"{source}: column 'path', row {row}"
        try:
            path = buffer[offsets[row]:offsets[row + 1]].decode("utf-8")
        except UnicodeDecodeError:
            raise DatasetIndexError(f"{where}: the path is not UTF-8") from None
        try:
            normal = safe_relative_path(path, what=where)
        except UnsafePathError as e:
            raise UnsafePathError(f"{e} (in the index)") from None
        if normal != path:
            raise DatasetIndexError(f"{where}: path {path!r} is not in normal form ({normal!r})")
    _check_unique(data, offsets, lengths, buffer, source)
    return buffer, offsets


def _check_unique(data: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, buffer: bytes,
                  source: str) -> None:
    """Raise if two paths are equal: a hash of each path (a random weight per position in the
    path, so no per-path object), sorted; paths of equal hashes are then compared as bytes."""
    hashes = _path_hashes(data, offsets, lengths)
    ranked = np.sort(hashes)
    if not (ranked[1:] == ranked[:-1]).any():
        return
    order = np.argsort(hashes, kind="stable")
    ranked = hashes[order]
    for k in np.flatnonzero(ranked[1:] == ranked[:-1]).tolist():
        a, b = sorted((int(order[k]), int(order[k + 1])))
        if buffer[offsets[a]:offsets[a + 1]] == buffer[offsets[b]:offsets[b + 1]]:
            raise DatasetIndexError(f"{source}: column 'path', row {b} repeats path "
                                    f"{buffer[offsets[b]:offsets[b + 1]].decode()!r} (also row {a})")


_SHORT_PATH = 96  # paths up to this long are hashed one position at a time over all rows


def _path_hashes(data: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    longest = int(lengths.max())
    weights = np.random.default_rng(0x5EED).integers(1, 2**63, size=longest, dtype=np.uint64)
    hashes = lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    one = np.uint64(1)
    if longest <= _SHORT_PATH:  # no temporary the size of all paths as uint64
        starts = offsets[:-1]
        for k in range(longest):
            rows = np.flatnonzero(lengths > k) if k >= int(lengths.min()) else None
            at = starts + k if rows is None else starts[rows] + k
            term = (data[at].astype(np.uint64) + one) * weights[k]
            if rows is None:
                hashes += term
            else:
                hashes[rows] += term
        return hashes
    position = np.arange(len(data), dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    products = (data.astype(np.uint64) + one) * weights[position]
    return hashes + np.add.reduceat(products, offsets[:-1])
