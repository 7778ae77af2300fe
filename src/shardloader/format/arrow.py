"""Native shards: Arrow IPC *file* format, memory-mapped, read row by row.

The file is memory-mapped and its record batches are opened zero-copy with pyarrow's IPC
reader, so opening a shard reads only its footer and batch metadata. Reading rows slices just
those rows out of the mapped column buffers and converts only them to Python values; binary and
string values are read with `pread` at their place in the file (see `schema.BatchRows`). Files
are written uncompressed (see `shardloader.ingest.writer`) so that nothing has to be decoded.

Shards are untrusted input: every record batch is checked with pyarrow's full validation
(`RecordBatch.validate(full=True)`: offsets in order and inside their buffers, buffers inside
the file, UTF-8 valid) before a row is read, and a file that does not open or validate is a
ShardError naming it.

pyarrow is the only reader (issue 37): a reader of its own (`format/ipc.py`, removed) saved a
fixed 26-32 MiB of what the process tree takes, the same at 1, 2 and 8 workers (pyarrow is
loaded before the workers fork, so they share its pages): `benchmarks/ipc_memory.py`, 2,000
ImageNet-sized JPEGs, 3 rounds; with pyarrow the tree stays within 49-54 MiB of torch
DataLoader's at 1-2 workers and below it at 8 (growth 6.1 MiB a worker against DataLoader's
21.2), inside the 64 MiB fixed cost a process tree may take above DataLoader's.

Before and after each read the reader checks that the mapped file still has the identity it was
opened with (`shardloader.io.identity`), so a shard truncated under it is a ShardError
naming it rather than SIGBUS on a page past the new end of the file.

Rows read by byte range from a file not fetched whole: `shardloader.format.arrow_ranges`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardloader.errors import ShardError, ShardloaderError
from shardloader.format import arrow_ranges
from shardloader.format.mapped import MappedPages, memory_map_shard
from shardloader.format.protocol import FormatCode, ShardEntry
from shardloader.format.rows import check_shard, gather_rows
from shardloader.io.identity import FileIdentity


class ArrowShardReader:
    """Row access to one memory-mapped Arrow IPC file shard.

    Checks on open: the file is a readable Arrow IPC file, its row count equals the index
    entry's `samples`, and (when `schema` is given) its fields and types equal the index schema.
    With `expect`, the file must be the one its source verified (see
    `shardloader.format.registry.open_shard`).
    """

    def __init__(self, path: str, info: ShardEntry, schema: Mapping[str, str] | None = None, *,
                 expect: FileIdentity | None = None) -> None:
        self.path = path
        self.info = info
        self._raw: list[Any] = []
        names = self._open(path, info, expect)
        counts = np.fromiter((b.num_rows for b in self._batches), dtype=np.int64,
                             count=len(self._batches))
        self._offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(counts)])
        # Binary and string values are read with pread, numbers touch a few bytes a row: only
        # a shard with other columns (tensors...) maps enough pages to be worth the madvise
        # after each read (which makes the next read fault its pages in again).
        self._drop_pages = any(b.maps_rows for b in self._batches)
        try:
            check_shard(path, len(self), info.samples, names, schema)
        except ShardloaderError:
            self.close()
            raise

    def _open(self, path: str, info: ShardEntry, expect: FileIdentity | None) -> dict[str, str]:
        """Open and validate the file with pyarrow; returns its schema."""
        import pyarrow as pa

        from shardloader.format.schema import BatchRows, MappedFile, schema_names

        self._map, self._guard = memory_map_shard(path, info, expect)
        self._pages = MappedPages(self._map)
        mapped = (MappedFile(self._map.fileno(), self._pages.address, self._pages.size, path)
                  if self._pages.address else None)
        try:
            reader = pa.ipc.open_file(self._map)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            for batch in batches:
                batch.validate(full=True)
            firsts = np.cumsum([0] + [b.num_rows for b in batches])
            self._batches = [BatchRows(b, where=path, first_row=int(first), mapped=mapped)
                             for b, first in zip(batches, firsts)]
        except (pa.ArrowException, OSError, ValueError) as e:
            self._map.close()
            raise ShardError(
                f"{path}: not a readable Arrow IPC file (truncated or corrupt?): {e}"
            ) from None
        self._raw = batches
        return schema_names(reader.schema)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def read(self, row: int) -> dict[str, Any]:
        return self.read_rows([row])[0]

    def read_rows(self, rows: Sequence[int]) -> list[dict[str, Any]]:
        """Rows in the order given (repeats allowed), grouped by the record batch holding them.

        The file's identity is checked before the mapped pages are touched (a shrunk file
        would fault) and after (a file rewritten during the read gave mixed bytes)."""
        self._guard.check()
        records = gather_rows(self._offsets, rows,
                              lambda b, local: self._batches[b].records(local), where=self.path)
        self._guard.check()
        if self._drop_pages:
            self._pages.drop()  # the rows are copies: the touched pages need not stay resident
        return records

    def null_counts(self) -> dict[str, int]:
        """Field -> number of null values in the shard, for the fields that hold any."""
        self._guard.check()
        from shardloader.format.schema import null_counts

        return null_counts(self._raw)

    def close(self) -> None:
        self._batches = []
        self._raw = []
        self._pages = None
        self._map.close()

    def __del__(self) -> None:
        """A reader dropped without `close()` (a Dataset freed unclosed, as most are) gives its
        descriptor back: the mmap unmaps itself when freed, the raw descriptor would not."""
        if "_map" in self.__dict__ and "_guard" in self.__dict__:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to free
                pass

    def __enter__(self) -> ArrowShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


FORMAT_CODE = FormatCode(open_reader=ArrowShardReader, range_table=arrow_ranges.range_table,
                         rows_from_spans=arrow_ranges.rows_from_spans)
