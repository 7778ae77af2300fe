"""Range tables: which bytes of a shard file hold which rows, with a hash of each byte range.

A cold cache should not make the first batch wait for whole shards: a reader can fetch just the
bytes its rows live in, by range, while whole shards download behind it. A range table records
which byte ranges ("spans") of a shard file those are, with an xxh3-64 hash of each span, in a
sidecar ``<shard>.ranges`` written with the shard (by the writer and by `shardloader index`).
The index entry of the shard describes the sidecar under ``"ranges"`` (path, size, checksum),
so the sidecar is verified by the index, and every span read by range is verified by its hash
in the sidecar: bytes read by range are never silently wrong (I6, I9).

What a read of some rows needs (span ids into the table):

- ``shared``: spans every read needs (Arrow: magic, schema and footer; Parquet: the footer);
- per group (Arrow record batch, Parquet row group; a tar is one group): spans any read of a row
  of that group needs (Arrow: the batch's message metadata; Parquet: the row group's column
  chunks, the unit Parquet decodes);
- per row: the spans that hold that row's values (Arrow: each column's offsets entries and
  value bytes; tar: each member's data). Parquet rows have none: the row group is the unit.

Which spans those are is each format's to say: its code builds the table from the file's bytes
with a `RangeTableBuilder` (`FormatCode.range_table`, see `shardloader.format.registry`), and
turns verified spans back into records through the same code its local reader uses
(`FormatCode.rows_from_spans`), so rows read by range are byte-identical to rows read from
the whole file. This module is the table itself, its sidecar bytes and the sidecar's names.

Sidecar layout (little-endian)::

    b"SLRNG1\\n\\0" | uint64 header length | header JSON {"format", "shard_bytes", "rows",
        "groups", "spans", "row_refs", "group_refs", "shared": [span ids]}
    | int64[spans, 2] (offset, length) | uint64[spans] xxh3-64 | int64[groups + 1] first rows
    | int64[groups + 1] group_ptr | int64[group_refs] group span ids
    | int64[rows + 1] row_ptr | int64[row_refs] row span ids
    | the bytes of the inline spans (header "inline": their ids), concatenated

Small spans (schemas, footers, batch metadata, offsets entries, fixed-width values; see
`INLINE_BYTES`) are kept in the sidecar itself, so that a read by range fetches only the
rows' large values, in as few requests as possible.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from shardloader.errors import ShardError
from shardloader.format.arrays import sorted_unique
from shardloader.io.checksum import checksum_bytes
from shardloader.io.jsondata import parse_json

RANGES_KEY = "ranges"  # the shard index entry's key describing the sidecar (every format has one)
RANGES_SUFFIX = ".ranges"
_MAGIC = b"SLRNG1\n\0"
#: Shared and group spans (headers, footers, batch metadata) of at most this many bytes, and
#: row spans (offsets entries, fixed-width values) of at most `INLINE_ROW_BYTES`, are kept in
#: the sidecar (see `RangeTable.inline`); a row's large values never are.
INLINE_BYTES = 4096
INLINE_ROW_BYTES = 16


def ranges_path(shard_path: str) -> str:
    """Where the range sidecar of the shard at `shard_path` lives (relative or local path)."""
    return shard_path + RANGES_SUFFIX


def ranges_entry(relative_path: str, data: bytes) -> dict[str, Any]:
    """The index entry value (under ``"ranges"``) describing sidecar bytes `data`."""
    return {"path": relative_path, "bytes": len(data), "checksum": checksum_bytes(data)}


def span_hash(data: bytes | memoryview) -> int:
    """The hash recorded for one span: xxh3-64 (GB/s; a row's spans hash in microseconds)."""
    return xxhash.xxh3_64_intdigest(data)


def _csr(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(lists) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists], dtype=np.int64)
    ids = np.fromiter((i for x in lists for i in x), dtype=np.int64, count=int(ptr[-1]))
    return ptr, ids


@dataclass(frozen=True)
class RangeTable:
    """Spans of one shard file and which of them each row, group and read needs."""

    format: str
    shard_bytes: int
    spans: np.ndarray  # int64 [K, 2]: offset, length
    hashes: np.ndarray  # uint64 [K]
    shared: np.ndarray  # int64 span ids
    group_rows: np.ndarray  # int64 [G + 1]: group g holds rows group_rows[g] .. group_rows[g+1]-1
    group_ptr: np.ndarray
    group_ids: np.ndarray
    row_ptr: np.ndarray
    row_ids: np.ndarray
    #: Bytes of small spans kept in the sidecar itself (span id -> bytes): the headers, footers,
    #: offsets entries and fixed-width values a read needs cost no request of their own.
    inline: Mapping[int, bytes] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return int(self.group_rows[-1])

    def groups_of(self, rows: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.group_rows, rows, side="right") - 1

    def needed(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """Sorted span ids a read of `rows` needs."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.rows):
            raise IndexError(f"rows out of range for a shard of {self.rows} rows")
        parts = [self.shared]
        for g in sorted_unique(self.groups_of(rows)).tolist():
            parts.append(self.group_ids[self.group_ptr[g]:self.group_ptr[g + 1]])
        for r in sorted_unique(rows).tolist():
            parts.append(self.row_ids[self.row_ptr[r]:self.row_ptr[r + 1]])
        return sorted_unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)

    def needed_bytes(self, ids: np.ndarray) -> int:
        return int(self.spans[ids, 1].sum()) if len(ids) else 0

    # -- sidecar bytes ----------------------------------------------------------------------------
    def encode(self) -> bytes:
        inline_ids = sorted(self.inline)
        blob = b"".join(bytes(self.inline[i]) for i in inline_ids)
        header = json.dumps({
            "format": self.format, "shard_bytes": self.shard_bytes, "rows": self.rows,
            "groups": len(self.group_rows) - 1, "spans": len(self.spans),
            "group_refs": len(self.group_ids), "row_refs": len(self.row_ids),
            "shared": [int(i) for i in self.shared], "inline": inline_ids,
        }, separators=(",", ":")).encode()
        arrays = (
            np.ascontiguousarray(self.spans, dtype="<i8"), np.ascontiguousarray(self.hashes, dtype="<u8"),
            *(np.ascontiguousarray(a, dtype="<i8") for a in (
                self.group_rows, self.group_ptr, self.group_ids, self.row_ptr, self.row_ids)),
        )
        return (_MAGIC + struct.pack("<Q", len(header)) + header
                + b"".join(a.tobytes() for a in arrays) + blob)

    @classmethod
    def decode(cls, data: bytes, *, where: str) -> RangeTable:
        """Parse sidecar bytes; ShardError naming `where` when they are malformed."""
        prefix = len(_MAGIC) + 8
        if len(data) < prefix or not data.startswith(_MAGIC):
            raise ShardError(f"{where}: not a shardloader range sidecar (bad magic)")
        (header_len,) = struct.unpack_from("<Q", data, len(_MAGIC))
        try:
            h = parse_json(data[prefix:prefix + header_len], what="range sidecar header")
            fmt, size, rows, groups = str(h["format"]), int(h["shard_bytes"]), int(h["rows"]), int(h["groups"])
            k, grefs, rrefs = int(h["spans"]), int(h["group_refs"]), int(h["row_refs"])
            shared = np.asarray([int(i) for i in h["shared"]], dtype=np.int64)
            inline_ids = [int(i) for i in h.get("inline", [])]
        except (ValueError, KeyError, TypeError) as e:
            raise ShardError(f"{where}: malformed range sidecar header ({e})") from None
        counts = (2 * k, k, groups + 1, groups + 1, grefs, rows + 1, rrefs)
        body = memoryview(data)[prefix + header_len:]
        if min(counts) < 0 or len(body) < 8 * sum(counts) or any(not 0 <= i < k for i in inline_ids):
            raise ShardError(f"{where}: range sidecar is truncated or inconsistent")
        out, pos = [], 0
        for n, dtype in zip(counts, ("<i8", "<u8", "<i8", "<i8", "<i8", "<i8", "<i8")):
            out.append(np.frombuffer(body[pos:pos + 8 * n], dtype=dtype).astype(dtype[1:]))
            pos += 8 * n
        spans = out[0].reshape(k, 2)
        ids = np.asarray(inline_ids, dtype=np.int64)
        lengths = spans[ids, 1]
        if len(lengths) and int(lengths.min()) < 0 or pos + int(lengths.sum()) != len(body):
            raise ShardError(f"{where}: range sidecar is truncated or inconsistent")
        starts = pos + np.cumsum(lengths) - lengths
        table = cls(fmt, size, spans, out[1], shared, *out[2:],
                    inline=InlineSpans(body, ids, starts, lengths, out[1], where))
        table._check(where)
        return table

    def _check(self, where: str) -> None:
        """Every id in range, every span inside the file, pointers monotonic."""
        k = len(self.spans)
        spans_ok = not k or (int(self.spans.min()) >= 0 and int((self.spans[:, 0] + self.spans[:, 1]).max())
                             <= self.shard_bytes)
        ids_ok = all(not len(a) or (int(a.min()) >= 0 and int(a.max()) < k)
                     for a in (self.shared, self.group_ids, self.row_ids))
        ptr_ok = all(a[0] == 0 and a[-1] == len(ids) and bool(np.all(np.diff(a) >= 0))
                     for a, ids in ((self.group_ptr, self.group_ids), (self.row_ptr, self.row_ids)))
        rows_ok = self.group_rows[0] == 0 and bool(np.all(np.diff(self.group_rows) >= 0))
        if not (spans_ok and ids_ok and ptr_ok and rows_ok):
            raise ShardError(f"{where}: range sidecar is inconsistent (spans outside the shard or bad ids)")


class InlineSpans(Mapping[int, bytes]):
    """The inline spans of a decoded sidecar (span id -> bytes), each checked against its hash
    in the sidecar when first read. A sidecar holds thousands (every row's offsets entries and
    fixed-width values) and a read needs a few: copying and hashing all of them when the sidecar
    is decoded cost 3 ms per 1,000-row shard, on the cold first batch's path, for each process.
    (The sidecar as a whole is verified against the index before it is decoded.)"""

    def __init__(self, body: memoryview, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                 hashes: np.ndarray, where: str) -> None:
        order = np.argsort(ids, kind="stable")  # sorted already when written by `encode`
        self._ids, self._starts, self._lengths = ids[order], starts[order], lengths[order]
        self._body, self._hashes, self._where = body, hashes, where
        self._checked: dict[int, bytes] = {}

    def _find(self, span: object) -> int:
        if not isinstance(span, (int, np.integer)):
            return -1
        j = int(np.searchsorted(self._ids, span))
        return j if j < len(self._ids) and self._ids[j] == span else -1

    def __getitem__(self, span: int) -> bytes:
        data = self._checked.get(span)
        if data is None:
            j = self._find(span)
            if j < 0:
                raise KeyError(span)
            start, length = int(self._starts[j]), int(self._lengths[j])
            data = bytes(self._body[start:start + length])
            if span_hash(data) != int(self._hashes[span]):
                raise ShardError(f"{self._where}: range sidecar's inline bytes of span {span} do not "
                                 "match their hash")
            self._checked[int(span)] = data
        return data

    def __contains__(self, span: object) -> bool:
        return self._find(span) >= 0

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids.tolist())

    def __len__(self) -> int:
        return len(self._ids)


class RangeTableBuilder:
    """Collects the spans of a file (deduplicated) while its format's code builds its table:
    `span` gives the id of a byte range (None for an empty one), `table` the finished table."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.ids: dict[tuple[int, int], int] = {}

    def span(self, offset: int, length: int) -> int | None:
        if length <= 0:
            return None
        key = (int(offset), int(length))
        found = self.ids.get(key)
        if found is None:
            if key[0] < 0 or key[0] + key[1] > len(self.data):
                raise ShardError(f"span {key} lies outside the file")
            found = self.ids[key] = len(self.ids)
        return found

    def table(self, fmt: str, shared: list[int | None], group_rows: Sequence[int],
              groups: list[list[int | None]], rows: list[list[int | None]]) -> RangeTable:
        spans = np.array(list(self.ids), dtype=np.int64).reshape(-1, 2)
        hashes = np.fromiter((span_hash(self.data[o:o + n]) for o, n in spans.tolist()),
                             dtype=np.uint64, count=len(spans))

        def clean(ids: list[int | None]) -> list[int]:
            return sorted({i for i in ids if i is not None})

        group_ptr, group_ids = _csr([clean(g) for g in groups])
        row_ptr, row_ids = _csr([clean(r) for r in rows])
        structural = set(clean(shared)).union(*(clean(g) for g in groups))
        small = [i for i, (_, n) in enumerate(spans.tolist())
                 if n <= (INLINE_BYTES if i in structural else INLINE_ROW_BYTES)]
        inline = {i: bytes(self.data[spans[i, 0]:spans[i, 0] + spans[i, 1]]) for i in small}
        return RangeTable(fmt, len(self.data), spans, hashes, np.asarray(clean(shared), dtype=np.int64),
                          np.asarray(group_rows, dtype=np.int64), group_ptr, group_ids, row_ptr, row_ids,
                          inline)
