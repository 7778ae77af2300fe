"""Arrow IPC files by byte range: which spans of a file hold which rows, and rows rebuilt
from fetched spans.

The range table (see `shardloader.format.ranges`) of an Arrow file: shared spans are its
magic, schema and footer; a group is a record batch, whose message metadata any read of one of
its rows needs; a row's spans are each column's offsets entries and value bytes. Types whose
rows the readers might touch beyond their own bytes get all their buffers as spans of the
batch.

`rows_from_spans` rebuilds a sparse image of the file (`shardloader.format.spans`: zeros
outside the fetched spans, which the decode of the requested rows never touches) and reads it
as the local reader reads the whole file (pyarrow and `BatchRows`), so rows read by range are
byte-identical to rows read from the whole file. The record batches the rows lie in are
checked with pyarrow's structural validation first (buffers as long as their arrays need); not
its full one, which would read the offsets of rows not fetched (zeros in the image). Row values
are sliced out of memoryviews, with Python's bounds, so a hostile offset cannot reach past a
buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardloader.errors import ShardError
from shardloader.format.ranges import RangeTable, RangeTableBuilder
from shardloader.format.rows import gather_rows
from shardloader.format.spans import file_image


# -- the range table ------------------------------------------------------------------------
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


def range_table(data: memoryview | bytes, member_spans: np.ndarray | None = None) -> RangeTable:
    """The range table of an Arrow IPC file whose bytes are `data` (an Arrow file has no
    member spans)."""
    import pyarrow as pa
    import pyarrow.ipc as pa_ipc

    view = memoryview(data)
    buf = pa.py_buffer(view)
    base = buf.address

    def addr(b: Any) -> int:
        return int(b.address - base)

    stream = pa.BufferReader(buf)
    stream.seek(8)
    messages = pa_ipc.MessageReader.open_stream(stream)
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
    reader = pa_ipc.open_file(buf)
    if reader.num_record_batches != len(batch_spans):
        raise ShardError(f"file holds {reader.num_record_batches} record batches but its messages {len(batch_spans)}")
    b = RangeTableBuilder(view)
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


# -- rows from fetched spans ----------------------------------------------------------------
def rows_from_spans(table: RangeTable, fetched: Mapping[int, bytes], rows: Sequence[int] | np.ndarray,
                    *, where: str, members: Any = None) -> list[dict[str, Any]]:
    """Records of `rows` of an Arrow file from verified spans `fetched` (see
    `shardloader.format.protocol.RowsFromSpans`; an Arrow file has no `members`)."""
    rows = np.asarray(rows, dtype=np.int64)
    image = file_image(table, fetched, table.needed(rows))
    import pyarrow as pa
    import pyarrow.ipc as pa_ipc

    from shardloader.format.schema import BatchRows

    try:
        reader = pa_ipc.open_file(pa.py_buffer(image))
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ShardError(f"{where}: not a readable Arrow IPC file (truncated or corrupt?): {e}") from None

    def read_batch(g: int, local: np.ndarray) -> list[dict[str, Any]]:
        try:
            batch = reader.get_batch(g)
            batch.validate()
        except (pa.ArrowException, OSError, ValueError) as e:
            raise ShardError(f"{where}: record batch {g} is not readable (truncated or corrupt?): {e}") from None
        return BatchRows(batch, where=where, first_row=int(table.group_rows[g])).records(local)

    return gather_rows(table.group_rows, rows, read_batch, where=where)
