"""Parquet shards, read in place by row group.

Parquet cannot address a single row: the unit of decoding is a row group. The reader decodes
only the row groups that hold the requested rows and keeps recently decoded ones in an LRU
bounded by `cache_bytes` (default 32 MiB per open shard, but always the last two row groups),
so that the batches the Loader draws from a window of shards decode each row group about once
rather than once per batch. Files with small row groups (a few MB) suit random access best;
see benchmarks/read_rows.py for the cost of each.

The file is memory-mapped: like the Arrow reader, this one checks the file's identity before
and after each read, so a shard truncated under it is a ShardError naming it, not SIGBUS. A
null in a row that is read is a SchemaError naming the file, row and field.

By byte range (see `shardloader.format.ranges`), the unit is the row group too: a read needs
the footer and the column chunks of the row groups its rows lie in, and rebuilds the rows from
an image of the file holding just those (`shardloader.format.spans`), decoded as here.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardloader.errors import ShardError, ShardloaderError
from shardloader.format.mapped import MappedPages, memory_map_shard
from shardloader.format.protocol import FormatCode, ShardEntry
from shardloader.format.ranges import RangeTable, RangeTableBuilder
from shardloader.format.rows import check_shard, gather_rows
from shardloader.format.schema import BatchRows, schema_names
from shardloader.format.spans import file_image
from shardloader.io.identity import FileIdentity


def row_group_rows(file: pq.ParquetFile, group: int, *, where: str, first_row: int) -> BatchRows:
    """Row access to row group `group` of `file`, decoded whole (the unit Parquet decodes);
    a ShardError naming `where` when it cannot be decoded. Shared with reads by byte range
    (`rows_from_spans`), so both give the same values."""
    try:
        table = file.read_row_group(group)
    except (pa.ArrowException, OSError) as e:
        raise ShardError(f"{where}: row group {group} cannot be decoded (corrupt?): {e}") from None
    batches = table.combine_chunks().to_batches()
    batch = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)
    return BatchRows(batch, where=where, first_row=first_row)


class ParquetShardReader:
    """Row access to one Parquet file shard, decoding whole row groups on demand."""

    def __init__(
        self,
        path: str,
        info: ShardEntry,
        schema: Mapping[str, str] | None = None,
        *,
        cache_bytes: int = 32 << 20,
        expect: FileIdentity | None = None,
    ) -> None:
        self.path = path
        self.info = info
        self.cache_bytes = cache_bytes
        self._source, self._guard = memory_map_shard(path, info, expect)
        self._pages = MappedPages(self._source)
        try:
            self._file = pq.ParquetFile(self._source)
            meta = self._file.metadata
            counts = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
            file_schema = self._file.schema_arrow
        except (pa.ArrowException, OSError) as e:
            self._source.close()
            raise ShardError(f"{path}: not a readable Parquet file (truncated or corrupt?): {e}") from None
        self._offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(counts, dtype=np.int64)])
        self._cache: OrderedDict[int, BatchRows] = OrderedDict()
        self._cached_bytes = 0
        try:
            check_shard(path, len(self), info.samples, schema_names(file_schema), schema)
        except ShardloaderError:
            self.close()
            raise

    @property
    def num_row_groups(self) -> int:
        return len(self._offsets) - 1

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def _row_group(self, group: int) -> BatchRows:
        cached = self._cache.get(group)
        if cached is not None:
            self._cache.move_to_end(group)
            return cached
        rows = row_group_rows(self._file, group, where=self.path, first_row=int(self._offsets[group]))
        batch = rows.batch
        self._cache[group] = rows
        self._cached_bytes += batch.nbytes
        while len(self._cache) > 2 and self._cached_bytes > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.batch.nbytes
        return rows

    def read(self, row: int) -> dict[str, Any]:
        return self.read_rows([row])[0]

    def read_rows(self, rows: Sequence[int]) -> list[dict[str, Any]]:
        """Rows in the order given (repeats allowed), decoding each row group touched once.

        The file's identity is checked before decoding (a shrunk file would fault) and after."""
        self._guard.check()
        records = gather_rows(self._offsets, rows,
                              lambda g, local: self._row_group(g).records(local), where=self.path)
        self._guard.check()
        self._pages.drop()  # decoded row groups are copies: the touched pages need not stay
        return records

    def null_counts(self) -> dict[str, int]:
        """Field -> number of null values in the file, for the fields that hold any.

        From the row groups' statistics where the writer recorded a null count for a top-level
        column, else by decoding that column of that row group (one at a time)."""
        self._guard.check()
        meta = self._file.metadata
        names = self._file.schema_arrow.names
        counts: dict[str, int] = {}
        for group in range(meta.num_row_groups):
            row_group = meta.row_group(group)
            stats = {}
            for c in range(row_group.num_columns):
                column = row_group.column(c)
                if column.statistics is not None and column.statistics.has_null_count:
                    stats[column.path_in_schema] = column.statistics.null_count
            for name in names:
                nulls = stats.get(name)
                if nulls is None:
                    try:
                        nulls = self._file.read_row_group(group, columns=[name]).column(0).null_count
                    except (pa.ArrowException, OSError) as e:
                        raise ShardError(f"{self.path}: row group {group} cannot be decoded "
                                         f"(corrupt?): {e}") from None
                if nulls:
                    counts[name] = counts.get(name, 0) + nulls
        self._guard.check()
        return counts

    def close(self) -> None:
        self._cache.clear()
        self._cached_bytes = 0
        self._source.close()

    def __enter__(self) -> ParquetShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def range_table(data: memoryview | bytes, member_spans: np.ndarray | None = None) -> RangeTable:
    """The range table of a Parquet file whose bytes are `data`: the footer, and each row
    group's column chunks (the unit Parquet decodes). A Parquet file has no member spans."""
    view = memoryview(data)
    size = len(view)
    (footer_len,) = struct.unpack_from("<i", view, size - 8)
    b = RangeTableBuilder(view)
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


def rows_from_spans(table: RangeTable, fetched: Mapping[int, bytes], rows: Sequence[int] | np.ndarray,
                    *, where: str, members: Any = None) -> list[dict[str, Any]]:
    """Records of `rows` of a Parquet file from verified spans `fetched`, decoding each row
    group touched (see `shardloader.format.protocol.RowsFromSpans`; no `members`)."""
    rows = np.asarray(rows, dtype=np.int64)
    image = file_image(table, fetched, table.needed(rows))
    file = pq.ParquetFile(pa.BufferReader(pa.py_buffer(image)))

    def read_group(g: int, local: np.ndarray) -> list[dict[str, Any]]:
        return row_group_rows(file, g, where=where, first_row=int(table.group_rows[g])).records(local)

    return gather_rows(table.group_rows, rows, read_group, where=where)


FORMAT_CODE = FormatCode(open_reader=ParquetShardReader, range_table=range_table,
                         rows_from_spans=rows_from_spans)
