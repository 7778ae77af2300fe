"""Native shards: Arrow IPC *file* format, memory-mapped, read row by row.

The file is mapped with `pa.memory_map` and its record batches are opened zero-copy, so opening
a shard reads only its footer and batch metadata. Reading rows slices just those rows out of
the mapped column buffers (`BatchRows`) and converts only them to Python values; binary and
string values are read with `pread` at their place in the file (see `schema._varlen_reader`). Files are
written uncompressed (see `shardloader.format.writer`) so that nothing has to be decoded.
Before and after each read the reader checks that the mapped file still has the identity it was
opened with (`shardloader.format.identity`), so a shard truncated under it is a ShardError
naming it rather than SIGBUS on a page past the new end of the file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from shardloader.errors import ShardError, ShardloaderError
from shardloader.format.identity import FileIdentity
from shardloader.format.index import ShardInfo
from shardloader.format.reader import MappedPages, memory_map_shard
from shardloader.format.schema import (
    BatchRows,
    MappedFile,
    check_shard,
    gather_rows,
    null_counts,
    schema_names,
)


class ArrowShardReader:
    """Row access to one memory-mapped Arrow IPC file shard.

    Checks on open: the file is a readable Arrow IPC file, its row count equals the index
    entry's `samples`, and (when `schema` is given) its fields and types equal the index schema.
    With `expect`, the file must be the one its source verified (see `open_shard`).
    """

    def __init__(self, path: str, info: ShardInfo, schema: Mapping[str, str] | None = None, *,
                 expect: FileIdentity | None = None) -> None:
        self.path = path
        self.info = info
        self._map, self._guard = memory_map_shard(path, info, expect)
        self._pages = MappedPages(self._map)
        try:
            reader = pa.ipc.open_file(self._map)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            for batch in batches:
                batch.validate()
            counts = np.fromiter((b.num_rows for b in batches), dtype=np.int64, count=len(batches))
            self._offsets = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(counts)])
            mapped = (MappedFile(self._map.fileno(), self._pages.address, self._pages.size, path)
                      if self._pages.address else None)
            self._batches = [BatchRows(b, where=path, first_row=int(first), mapped=mapped)
                             for b, first in zip(batches, self._offsets)]
        except (pa.ArrowException, OSError, ValueError) as e:
            self._map.close()
            raise ShardError(
                f"{path}: not a readable Arrow IPC file (truncated or corrupt?): {e}"
            ) from None
        self._raw = batches
        # Rows read with pread (binary, strings) and numbers leave few pages mapped: the
        # madvise after each read would cost more (the offsets refault) than it saves.
        self._drop_pages = any(b.maps_rows for b in self._batches)
        try:
            check_shard(path, len(self), info.samples, schema_names(reader.schema), schema)
        except ShardloaderError:
            self.close()
            raise

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
        return null_counts(self._raw)

    def close(self) -> None:
        self._batches = []
        self._raw = []
        self._map.close()

    def __enter__(self) -> ArrowShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
