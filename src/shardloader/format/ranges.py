"""Range tables: which bytes of a shard file hold which rows, with a hash of each byte range.

A cold cache should not make the first batch wait for whole shards: a reader can fetch just the
bytes its rows live in, by range, while whole shards download behind it. This module knows,
for each shard format, which byte ranges ("spans") those are, and records them with an xxh3-64
hash of each span in a sidecar ``<shard>.ranges`` written with the shard (by the writer and by
`shardloader index`). The index entry of the shard describes the sidecar under ``"ranges"``
(path, size, checksum), so the sidecar is verified by the index, and every span read by range
is verified by its hash in the sidecar: bytes read by range are never silently wrong (I6, I9).

What a read of some rows needs (span ids into the table):

- ``shared``: spans every read needs (Arrow: magic, schema and footer; Parquet: the footer);
- per group (Arrow record batch, Parquet row group; a tar is one group): spans any read of a row
  of that group needs (Arrow: the batch's message metadata; Parquet: the row group's column
  chunks, the unit Parquet decodes);
- per row: the spans that hold that row's values (Arrow: each column's offsets entries and
  value bytes; tar: each member's data). Parquet rows have none: the row group is the unit.

`rows_from_spans` turns verified spans back into records through the same code the local
readers use, so rows read by range are byte-identical to rows read from the whole file: Arrow
and Parquet rebuild a sparse image of the file (zeros outside the fetched spans, which the
decode of the requested rows never touches) and read it with pyarrow and `BatchRows`; a tar's
records are the members' bytes, as `TarShardReader` returns them.

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
import mmap
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from shardloader.arrays import sorted_unique
from shardloader.errors import ShardError
from shardloader.format.checksum import checksum_bytes

RANGES_KEY = "ranges"  # the shard index entry's key describing the sidecar
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
            h = json.loads(data[prefix:prefix + header_len])
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


class _Builder:
    """Collects spans (deduplicated) while a table is built."""

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


# -- building: Arrow IPC -----------------------------------------------------------------------
def _fixed_width(dtype: Any) -> int | None:
    import pyarrow as pa

    if pa.types.is_integer(dtype) or pa.types.is_floating(dtype):
        return dtype.bit_width // 8
    return None


def _array_row_spans(a: Any, addr: Any, n: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[tuple[int, int]]]:
    """(per-row spans as (starts, lengths) arrays of length n, spans any read of the batch needs)
    of array `a` (n rows) whose buffers lie in the file at `addr(buffer)`. Types whose rows the
    readers might touch beyond their own bytes get all their buffers as batch-wide spans."""
    import pyarrow as pa

    dtype = a.type
    if isinstance(dtype, pa.ExtensionType):
        return _array_row_spans(a.storage, addr, n)
    buffers = a.buffers()
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    whole: list[tuple[int, int]] = []
    if a.null_count and buffers[0] is not None:  # BatchRows checks the whole validity bitmap
        whole.append((addr(buffers[0]), buffers[0].size))
    index = a.offset + np.arange(n, dtype=np.int64)
    width = _fixed_width(dtype)
    if width is not None and buffers[1] is not None:
        rows.append((addr(buffers[1]) + index * width, np.full(n, width, dtype=np.int64)))
        return rows, whole
    if pa.types.is_boolean(dtype) and buffers[1] is not None:
        rows.append((addr(buffers[1]) + index // 8, np.ones(n, dtype=np.int64)))
        return rows, whole
    varlen = {pa.types.is_binary: 4, pa.types.is_string: 4, pa.types.is_large_binary: 8,
              pa.types.is_large_string: 8}
    size = next((s for test, s in varlen.items() if test(dtype)), None)
    if size is not None and buffers[1] is not None:
        offsets = np.frombuffer(buffers[1], dtype=np.int32 if size == 4 else np.int64).astype(np.int64)
        rows.append((addr(buffers[1]) + index * size, np.full(n, 2 * size, dtype=np.int64)))
        if buffers[2] is not None and n:
            rows.append((addr(buffers[2]) + offsets[index], offsets[index + 1] - offsets[index]))
        return rows, whole
    if pa.types.is_fixed_size_list(dtype):
        child = a.values  # the child array of the unsliced list: row r is at (offset + r) * size
        child_width = _fixed_width(child.type)
        child_buffers = child.buffers()
        if child_width is not None and not child.null_count and child_buffers[1] is not None:
            step = dtype.list_size * child_width
            rows.append((addr(child_buffers[1]) + (child.offset * child_width) + index * step,
                         np.full(n, step, dtype=np.int64)))
            return rows, whole
    if pa.types.is_struct(dtype):
        for i in range(dtype.num_fields):
            child_rows, child_whole = _array_row_spans(a.field(i), addr, n)
            rows += child_rows
            whole += child_whole
        return rows, whole
    # Any other type: every buffer of the column (children included), for every read of its batch.
    return [], whole + [(addr(b), b.size) for b in buffers if b is not None and b.size]


def arrow_table(data: memoryview | bytes) -> RangeTable:
    """The range table of an Arrow IPC file whose bytes are `data`."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    view = memoryview(data)
    buf = pa.py_buffer(view)
    base = buf.address

    def addr(b: Any) -> int:
        return int(b.address - base)

    stream = pa.BufferReader(buf)
    stream.seek(8)
    messages = ipc.MessageReader.open_stream(stream)
    position, batch_spans = 8, []  # (message start, body start) per record batch
    first_batch = None
    while True:
        try:
            message = messages.read_next_message()
        except StopIteration:
            break
        end = stream.tell()
        if message.type == "record batch":
            body = message.body
            body_start = addr(body) if body is not None and body.size else end
            batch_spans.append((position, body_start))
            first_batch = position if first_batch is None else first_batch
        position = end
    reader = ipc.open_file(buf)
    if reader.num_record_batches != len(batch_spans):
        raise ShardError(f"file holds {reader.num_record_batches} record batches but its messages {len(batch_spans)}")
    b = _Builder(view)
    head_end = first_batch if first_batch is not None else position
    shared = [b.span(0, head_end), b.span(position, len(view) - position)]  # schema+dicts; footer
    groups: list[list[int | None]] = []
    rows: list[list[int | None]] = []
    group_rows = [0]
    for i, (start, body_start) in enumerate(batch_spans):
        batch = reader.get_batch(i)
        n = batch.num_rows
        group = [b.span(start, body_start - start)]
        per_row: list[list[int | None]] = [[] for _ in range(n)]
        for column in batch.columns:
            column_rows, column_whole = _array_row_spans(column, addr, n)
            group += [b.span(o, s) for o, s in column_whole]
            for starts, lengths in column_rows:
                for r, (o, s) in enumerate(zip(starts.tolist(), lengths.tolist())):
                    per_row[r].append(b.span(o, s))
        groups.append(group)
        rows += per_row
        group_rows.append(group_rows[-1] + n)
    return b.table("arrow", shared, group_rows, groups, rows)


# -- building: Parquet -------------------------------------------------------------------------
def parquet_table(data: memoryview | bytes) -> RangeTable:
    """The range table of a Parquet file whose bytes are `data`: the footer, and each row
    group's column chunks (the unit Parquet decodes)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    view = memoryview(data)
    size = len(view)
    (footer_len,) = struct.unpack_from("<i", view, size - 8)
    b = _Builder(view)
    shared = [b.span(0, 4), b.span(size - 8 - footer_len, footer_len + 8)]
    meta = pq.ParquetFile(pa.BufferReader(pa.py_buffer(view))).metadata
    groups, group_rows = [], [0]
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        lo, hi = size, 0
        for c in range(rg.num_columns):
            col = rg.column(c)
            first = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset:
                first = min(first, col.dictionary_page_offset)
            lo, hi = min(lo, first), max(hi, first + col.total_compressed_size)
        groups.append([b.span(lo, hi - lo)] if hi > lo else [])
        group_rows.append(group_rows[-1] + rg.num_rows)
    return b.table("parquet", shared, group_rows, groups, [[] for _ in range(group_rows[-1])])


# -- building: tar -----------------------------------------------------------------------------
def tar_table(data: memoryview | bytes, spans: np.ndarray) -> RangeTable:
    """The range table of a tar whose bytes are `data`, from its member table `spans`
    (int64 [samples, fields, 2]: data offset, size): each row's spans are its members."""
    view = memoryview(data)
    b = _Builder(view)
    rows = [[b.span(o, s) for o, s in sample] for sample in spans.tolist()]
    return b.table("tar", [], [0, len(rows)], [[]], rows)


def build_table(fmt: str, data: memoryview | bytes, tar_spans: np.ndarray | None = None) -> RangeTable:
    """The range table of a shard file of format `fmt` (tar needs its member spans)."""
    if fmt == "arrow":
        return arrow_table(data)
    if fmt == "parquet":
        return parquet_table(data)
    if fmt == "tar":
        assert tar_spans is not None
        return tar_table(data, tar_spans)
    raise ValueError(f"unknown shard format {fmt!r}")


def table_of_file(path: str, fmt: str, tar_spans: np.ndarray | None = None) -> RangeTable:
    """The range table of the local shard file at `path` (memory-mapped while it is built)."""
    import mmap

    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            return build_table(fmt, b"", tar_spans)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                return build_table(fmt, view, tar_spans)
            finally:
                view.release()


# -- reading rows back from verified spans -----------------------------------------------------
def _image(table: RangeTable, fetched: Mapping[int, bytes], ids: np.ndarray) -> np.ndarray:
    """A zero-filled image of the file with spans `ids` (taken from `fetched`) in place; only
    the spans the read needs are placed (not every inline span of the sidecar: 2,000 writes per
    1,000-row shard, 5 ms, for a read of 4 rows).

    The image is an anonymous memory map: the kernel gives zero pages on first touch, so a
    large shard's image costs only the pages placed. `np.zeros` does not guarantee that: once
    glibc has raised its mmap threshold (it does after freeing a large block), a 15 MB zeros
    comes from the heap and is cleared whole, measured 9 ms per shard in a worker, 70 ms for
    the 8 shards of a cold first batch. Unmapped when the last view of it goes."""
    image = np.frombuffer(mmap.mmap(-1, max(1, table.shard_bytes)), dtype=np.uint8)[:table.shard_bytes]
    for i, (offset, length) in zip(ids.tolist(), table.spans[ids].tolist()):
        image[offset:offset + length] = np.frombuffer(fetched[i], dtype=np.uint8)
    return image


def _arrow_rows(table: RangeTable, image: np.ndarray, rows: np.ndarray, where: str) -> list[dict[str, Any]] | None:
    """`rows_from_spans` of an Arrow file by `shardloader.format.ipc`, which reads the image's
    footer and the record batches the rows lie in, nothing else; None for a file it does not
    read, which pyarrow then reads. Why: a worker's first read by range would otherwise import
    pyarrow, 66 of the 111 ms its first batch took in a cold start (profiled in the worker).
    The values are those of `BatchRows` (tests/test_format_ranges.py compares them)."""
    from shardloader.format import ipc
    from shardloader.format.rows import gather_rows

    layout = ipc.parse_layout(image)
    if layout is None or len(layout.blocks) != len(table.group_rows) - 1:
        return None

    def read_batch(g: int, local: np.ndarray) -> list[dict[str, Any]]:
        batch = ipc.parse_batch(image, layout, g, local)
        if batch is None or batch.num_rows != int(table.group_rows[g + 1] - table.group_rows[g]):
            raise _Declined
        return ipc.BatchReader(batch).records(local)

    try:
        return gather_rows(table.group_rows, rows, read_batch, where=where)
    except _Declined:
        return None


class _Declined(Exception):
    """A record batch `shardloader.format.ipc` does not read: pyarrow reads the file instead."""


def rows_from_spans(table: RangeTable, fetched: Mapping[int, bytes], rows: Sequence[int],
                    *, where: str, tar_offsets: Any = None) -> list[dict[str, Any]]:
    """Records of `rows` (any order, repeats allowed) from verified spans `fetched` (span id ->
    bytes; at least `table.needed(rows)`), byte-identical to the local reader's. A tar needs its
    member table `tar_offsets` (a `TarOffsets`, for the keys and the field order)."""
    rows = np.asarray(rows, dtype=np.int64)
    if table.format == "tar":
        from shardloader.format.tar import KEY_FIELD

        assert tar_offsets is not None
        ids = table.needed(rows)
        lookup = {(o, n): fetched[i] for i, (o, n) in zip(ids.tolist(), table.spans[ids].tolist())}
        out = []
        for r in rows.tolist():
            record: dict[str, Any] = {}
            for field, (offset, size) in zip(tar_offsets.fields, tar_offsets.spans[r].tolist()):
                record[field] = b"" if size == 0 else bytes(lookup[(offset, size)])
            record[KEY_FIELD] = tar_offsets.keys[r]
            out.append(record)
        return out
    image = _image(table, fetched, table.needed(rows))
    if table.format == "arrow":
        records = _arrow_rows(table, image, rows, where)
        if records is not None:
            return records
    import pyarrow as pa

    from shardloader.format.schema import BatchRows, gather_rows

    buf = pa.py_buffer(image)
    if table.format == "arrow":
        import pyarrow.ipc as ipc

        reader = ipc.open_file(buf)

        def read_batch(g: int, local: np.ndarray) -> list[dict[str, Any]]:
            return BatchRows(reader.get_batch(g), where=where, first_row=int(table.group_rows[g])).records(local)

        return gather_rows(table.group_rows, rows, read_batch, where=where)
    if table.format == "parquet":
        import pyarrow.parquet as pq

        from shardloader.format.parquet import row_group_rows

        file = pq.ParquetFile(pa.BufferReader(buf))

        def read_group(g: int, local: np.ndarray) -> list[dict[str, Any]]:
            return row_group_rows(file, g, where=where, first_row=int(table.group_rows[g])).records(local)

        return gather_rows(table.group_rows, rows, read_group, where=where)
    raise ValueError(f"{where}: unknown shard format {table.format!r}")


__all__ = [
    "RANGES_KEY", "RANGES_SUFFIX", "RangeTable", "arrow_table", "build_table", "parquet_table",
    "ranges_entry", "ranges_path", "rows_from_spans", "span_hash", "table_of_file", "tar_table",
]
