"""Arrow IPC files read without pyarrow, for the column types shardloader's writer produces.

Why not pyarrow here: a loader's training process and each of its workers read Arrow shards,
and loading pyarrow maps its eight shared libraries (libarrow, compute, acero, dataset,
substrait, parquet, ...) whose load-time initialisers alone touch ~20 MiB of their pages, plus
~5 MiB of heap. Measured with `benchmarks.memory` (20k JPEGs, 2 workers): pyarrow was 26.5 MiB
of the process tree's PSS and most of what kept it above torch DataLoader's. Reading a shard
needs none of it: the file is uncompressed (the writer makes it so), its columns are plain
buffers, and a row is a slice of them.

What is parsed: the file's footer (schema, record batch blocks) and each record batch's
message (field nodes, buffer offsets), all FlatBuffers, with a reader of the few FlatBuffers
rules they use (tables through vtables, vectors, strings, structs); for rows read by range
(`shardloader.format.arrow_ranges`), the footer and only the record batches the rows lie in.
Spec: https://arrow.apache.org/docs/format/Columnar.html#ipc-file-format (and the `File.fbs`,
`Message.fbs`, `Schema.fbs` it links).

Supported: fields of type binary, string (and their large variants), int8..uint64, float16..64,
and `arrow.fixed_shape_tensor` of those numbers in row-major order, little-endian, no nulls, no
compression, no dictionaries. `parse_file` returns None for anything else, and for any file
that does not parse or whose buffers do not lie inside it: the caller then opens the file with
pyarrow, which reads every type and words the error for a damaged file. So this module never
changes what a shard reads as, only which library reads it.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardloader.format.rows import pread_values
from shardloader.io.jsondata import parse_json

_MAGIC = b"ARROW1"
_CONTINUATION = 0xFFFFFFFF
# Schema.fbs `Type` union ids, and what each supported one reads as.
_INT, _FLOAT, _BINARY, _UTF8, _FIXED_SIZE_LIST, _LARGE_BINARY, _LARGE_UTF8 = 2, 3, 4, 5, 16, 19, 20
_FLOAT_DTYPES = {0: "float16", 1: "float32", 2: "float64"}  # FloatingPoint.precision
_RECORD_BATCH = 3  # Message.fbs MessageHeader id
_TENSOR_EXTENSION = "arrow.fixed_shape_tensor"


class Unsupported(Exception):
    """The file is outside what this module reads (or malformed): read it with pyarrow."""


#: What parsing raises on a file outside this module's types or a damaged one (a deeply nested
#: JSON metadata raises RecursionError): the caller is given None and reads it with pyarrow.
_DECLINED = (Unsupported, struct.error, ValueError, KeyError, TypeError, IndexError, OverflowError,
             RecursionError, UnicodeDecodeError)


class _Buffer:
    """FlatBuffers reading over a bytes-like object (little-endian, as the format is)."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.size = len(data)

    def _unpack(self, fmt: str, pos: int) -> Any:
        if pos < 0 or pos + struct.calcsize(fmt) > self.size:
            raise Unsupported(f"FlatBuffers read out of bounds at {pos}")
        return struct.unpack_from(fmt, self.data, pos)[0]

    def u8(self, pos: int) -> int:
        return self._unpack("<B", pos)

    def i16(self, pos: int) -> int:
        return self._unpack("<h", pos)

    def u32(self, pos: int) -> int:
        return self._unpack("<I", pos)

    def i32(self, pos: int) -> int:
        return self._unpack("<i", pos)

    def i64(self, pos: int) -> int:
        return self._unpack("<q", pos)

    def root(self, start: int) -> int:
        """Position of the root table of the FlatBuffer that begins at `start`."""
        return start + self.u32(start)

    def field(self, table: int, index: int) -> int:
        """Position of field `index` of the table at `table`, or 0 when it is absent."""
        vtable = table - self.i32(table)
        vtable_size = self._unpack("<H", vtable)
        if 4 + 2 * index >= vtable_size:
            return 0
        offset = self._unpack("<H", vtable + 4 + 2 * index)
        return table + offset if offset else 0

    def scalar(self, table: int, index: int, reader: Callable[[int], int], default: int) -> int:
        pos = self.field(table, index)
        return reader(pos) if pos else default

    def ref(self, table: int, index: int) -> int:
        """Position a reference field (table, vector, string) points at, or 0 when absent."""
        pos = self.field(table, index)
        return pos + self.u32(pos) if pos else 0

    def vector(self, table: int, index: int) -> tuple[int, int]:
        """(position of the first element, length) of a vector field; (0, 0) when absent."""
        pos = self.ref(table, index)
        return (pos + 4, self.u32(pos)) if pos else (0, 0)

    def tables(self, table: int, index: int) -> list[int]:
        start, count = self.vector(table, index)
        return [start + 4 * i + self.u32(start + 4 * i) for i in range(count)]

    def string(self, table: int, index: int) -> str | None:
        pos = self.ref(table, index)
        if not pos:
            return None
        length = self.u32(pos)
        if pos + 4 + length > self.size:
            raise Unsupported("FlatBuffers string out of bounds")
        return bytes(self.data[pos + 4:pos + 4 + length]).decode("utf-8")


@dataclass(frozen=True)
class Column:
    """One field: its index type name and how its rows lie in a record batch."""

    name: str
    type_name: str
    kind: str  # "varlen" (binary/string), "number", "tensor"
    dtype: np.dtype  # numbers and tensor elements; the offsets' type for varlen
    text: bool = False
    shape: tuple[int, ...] = ()

    @property
    def nodes(self) -> int:
        return 2 if self.kind == "tensor" else 1

    @property
    def buffers(self) -> int:
        return {"varlen": 3, "number": 2, "tensor": 3}[self.kind]


@dataclass
class RecordBatch:
    """One record batch: its row count, per column numpy views of its buffers, and per column
    where its values lie in the file (varlen columns: their data buffer's offset; else -1)."""

    num_rows: int
    columns: list[tuple[Column, tuple[np.ndarray, ...]]]
    data_offsets: list[int]


@dataclass
class IpcFile:
    columns: list[Column]
    batches: list[RecordBatch]

    @property
    def schema(self) -> dict[str, str]:
        return {c.name: c.type_name for c in self.columns}


@dataclass
class IpcFileLayout:
    """What an Arrow IPC file's footer says: its columns, and where each record batch lies
    (offset of its message, length of the message's metadata, length of its body)."""

    columns: list[Column]
    blocks: list[tuple[int, int, int]]


def parse_file(data: Any) -> IpcFile | None:
    """The schema and record batches of the Arrow IPC file in `data` (a bytes-like object, e.g.
    an mmap), with column buffers as zero-copy numpy views of it; None when the file is outside
    what this module reads or does not parse (see the module docstring)."""
    layout = parse_layout(data)
    if layout is None:
        return None
    batches = []
    for i in range(len(layout.blocks)):
        batch = parse_batch(data, layout, i)
        if batch is None:
            return None
        batches.append(batch)
    return IpcFile(layout.columns, batches)


def parse_layout(data: Any) -> IpcFileLayout | None:
    """The footer of the Arrow IPC file in `data`, without reading any record batch: for an
    image of a file of which only some byte ranges are present (see
    `shardloader.format.arrow_ranges`), whose other batches are zeros. None as `parse_file`."""
    if sys.byteorder != "little":
        return None
    try:
        return _layout(_Buffer(data))
    except _DECLINED:
        return None


def parse_batch(data: Any, layout: IpcFileLayout, index: int, rows: np.ndarray | None = None) -> RecordBatch | None:
    """Record batch `index` of the file in `data` (see `parse_layout`); None as `parse_file`.

    With `rows` (positions in the batch), only what reading those rows needs is checked: of a
    string or binary column, the offsets of those rows instead of the whole offsets buffer, of
    which a file image read by range holds just those rows' entries. Values of other rows must
    then not be read from the batch."""
    if sys.byteorder != "little":
        return None
    try:
        offset, meta_length, body_length = layout.blocks[index]
        return _record_batch(_Buffer(data), layout.columns, offset, meta_length, body_length, rows)
    except _DECLINED:
        return None


def _layout(buf: _Buffer) -> IpcFileLayout:
    size = buf.size
    if size < 18 or bytes(buf.data[:6]) != _MAGIC or bytes(buf.data[size - 6:]) != _MAGIC:
        raise Unsupported("not an Arrow IPC file")
    footer_length = buf.i32(size - 10)
    footer_start = size - 10 - footer_length
    if footer_length <= 0 or footer_start < 8:
        raise Unsupported("bad footer length")
    footer = buf.root(footer_start)
    schema = buf.ref(footer, 1)
    if not schema:
        raise Unsupported("no schema")
    if buf.scalar(schema, 0, buf.i16, 0) != 0:  # Endianness.Little
        raise Unsupported("big-endian file")
    columns = [_column(buf, field) for field in buf.tables(schema, 1)]
    if buf.vector(footer, 2)[1]:
        raise Unsupported("dictionaries")
    start, count = buf.vector(footer, 3)
    # struct Block { offset: long; metaDataLength: int; bodyLength: long }
    blocks = [(buf.i64(start + 24 * i), buf.i32(start + 24 * i + 8), buf.i64(start + 24 * i + 16))
              for i in range(count)]
    return IpcFileLayout(columns, blocks)


def _column(buf: _Buffer, field: int) -> Column:
    name = buf.string(field, 0)
    if name is None or buf.ref(field, 4):  # a dictionary-encoded field
        raise Unsupported("unnamed or dictionary field")
    type_id, type_table = buf.scalar(field, 2, buf.u8, 0), buf.ref(field, 3)
    metadata = {}
    for kv in buf.tables(field, 6):
        metadata[buf.string(kv, 0)] = buf.string(kv, 1)
    extension = metadata.get("ARROW:extension:name")
    if type_id == _FIXED_SIZE_LIST and extension == _TENSOR_EXTENSION:
        children = buf.tables(field, 5)
        if len(children) != 1:
            raise Unsupported("tensor storage without one child")
        child = _number_dtype(buf, buf.scalar(children[0], 2, buf.u8, 0), buf.ref(children[0], 3))
        params = parse_json(metadata.get("ARROW:extension:metadata") or "{}",
                            what="tensor extension metadata", error=Unsupported)
        shape = tuple(int(d) for d in params["shape"])
        permutation = params.get("permutation")
        if permutation is not None and list(permutation) != list(range(len(shape))):
            raise Unsupported("permuted tensor")
        if not shape or int(np.prod(shape)) != buf.scalar(type_table, 0, buf.i32, 0):
            raise Unsupported("tensor shape does not match its list size")
        type_name = f"array<{child.name}>[{','.join(str(d) for d in shape)}]"
        return Column(name, type_name, "tensor", child, shape=shape)
    if extension is not None:
        raise Unsupported(f"extension type {extension}")
    if type_id in (_BINARY, _UTF8, _LARGE_BINARY, _LARGE_UTF8):
        text = type_id in (_UTF8, _LARGE_UTF8)
        offsets = np.dtype("<i8" if type_id in (_LARGE_BINARY, _LARGE_UTF8) else "<i4")
        return Column(name, "string" if text else "binary", "varlen", offsets, text=text)
    dtype = _number_dtype(buf, type_id, type_table)
    return Column(name, dtype.name, "number", dtype)


def _number_dtype(buf: _Buffer, type_id: int, table: int) -> np.dtype:
    if type_id == _INT and table:
        width, signed = buf.scalar(table, 0, buf.i32, 0), buf.scalar(table, 1, buf.u8, 0)
        if width not in (8, 16, 32, 64):
            raise Unsupported(f"int width {width}")
        return np.dtype(f"<{'i' if signed else 'u'}{width // 8}")
    if type_id == _FLOAT and table:
        return np.dtype(_FLOAT_DTYPES[buf.scalar(table, 0, buf.i16, 0)]).newbyteorder("<")
    raise Unsupported(f"type id {type_id}")


def _record_batch(buf: _Buffer, columns: list[Column], offset: int, meta_length: int,
                  body_length: int, rows: np.ndarray | None = None) -> RecordBatch:
    body = offset + meta_length
    if offset < 8 or meta_length < 8 or body_length < 0 or body + body_length > buf.size:
        raise Unsupported("record batch block outside the file")
    start = offset + 8 if buf.u32(offset) == _CONTINUATION else offset + 4
    message = buf.root(start)
    if buf.scalar(message, 1, buf.u8, 0) != _RECORD_BATCH:
        raise Unsupported("block is not a record batch")
    header = buf.ref(message, 2)
    if not header or buf.ref(header, 3):  # compressed bodies are not read here
        raise Unsupported("compressed or empty record batch")
    num_rows = buf.i64(buf.field(header, 0)) if buf.field(header, 0) else 0
    if num_rows < 0:
        raise Unsupported("negative row count")
    nodes_at, node_count = buf.vector(header, 1)
    buffers_at, buffer_count = buf.vector(header, 2)
    if node_count != sum(c.nodes for c in columns) or buffer_count != sum(c.buffers for c in columns):
        raise Unsupported("field nodes or buffers do not match the schema")
    nodes = [(buf.i64(nodes_at + 16 * i), buf.i64(nodes_at + 16 * i + 8)) for i in range(node_count)]
    spans = []
    for i in range(buffer_count):
        at, length = buf.i64(buffers_at + 16 * i), buf.i64(buffers_at + 16 * i + 8)
        if at < 0 or length < 0 or at + length > body_length:
            raise Unsupported("buffer outside the record batch body")
        spans.append((body + at, length))
    views, data_offsets = [], []
    node = span = 0
    for column in columns:
        data_offsets.append(spans[span + 2][0] if column.kind == "varlen" else -1)
        length, nulls = nodes[node]
        if length != num_rows or nulls:
            raise Unsupported("column length differs from the batch, or holds nulls")
        views.append((column, _views(buf.data, column, num_rows, nodes[node + 1:node + 2],
                                     spans[span:span + column.buffers], rows)))
        node, span = node + column.nodes, span + column.buffers
    return RecordBatch(num_rows, views, data_offsets)


def _views(data: Any, column: Column, rows: int, child: list[tuple[int, int]],
           spans: list[tuple[int, int]], read: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Numpy views of a column's buffers, checked to hold `rows` rows (validity buffers are
    skipped: the column has no nulls); string offsets checked for all rows, or for the rows
    `read` only."""
    def array(span: tuple[int, int], dtype: np.dtype, count: int) -> np.ndarray:
        at, length = span
        if count * dtype.itemsize > length:
            raise Unsupported("buffer shorter than its rows")
        return np.frombuffer(data, dtype=dtype, count=count, offset=at)

    if column.kind == "number":
        return (array(spans[1], column.dtype, rows),)
    if column.kind == "tensor":
        size = int(np.prod(column.shape))
        if not child or child[0] != (rows * size, 0):
            raise Unsupported("tensor values do not match the rows, or hold nulls")
        values = array(spans[2], column.dtype, rows * size)
        return (values.reshape(rows, *column.shape),)
    offsets = array(spans[1], column.dtype, rows + 1)
    if read is not None:
        starts, ends = offsets[read], offsets[read + 1]
        if len(read) and (int(starts.min()) < 0 or int(ends.max()) > spans[2][1] or np.any(ends < starts)):
            raise Unsupported("string offsets of the rows read out of order or past the data")
    elif int(offsets[0]) < 0 or int(offsets[-1]) > spans[2][1] or (rows and np.any(np.diff(offsets) < 0)):
        raise Unsupported("string offsets out of order or past the data")
    return offsets, np.frombuffer(data, dtype=np.uint8, count=spans[2][1], offset=spans[2][0])



class BatchReader:
    """Rows of one parsed record batch as dicts, with pyarrow's `BatchRows` values and types:
    bytes, str, int, float, and numpy arrays (rows of one writable copy) for tensors.

    With `fd` (the file, open) and `where` (its name), binary and string values are read with
    `pread` at their place in the file instead of through the mapping: the same one copy from
    the page cache, without faulting the pages into this process (and, with the `madvise`
    that keeps a reader's resident set small, faulting them in again every epoch). Measured on
    15 KB JPEG rows, 64-row reads: 21 -> 10.7 us per row."""

    def __init__(self, batch: RecordBatch, fd: int = -1, where: str = "") -> None:
        self.num_rows = batch.num_rows
        self.names = [column.name for column, _ in batch.columns]
        self._columns = [(column.kind, column.text, views) for column, views in batch.columns]
        self._data_offsets = batch.data_offsets
        self._fd, self._where = fd, where
        #: Whether reads touch row data through the mapping (tensors; varlen values without
        #: `fd`), so that the reader should give the touched pages back after each read.
        self.maps_rows = any(kind == "tensor" or (kind == "varlen" and fd < 0)
                             for kind, _, _ in self._columns)

    def records(self, rows: np.ndarray) -> list[dict[str, Any]]:
        columns = [_read(kind, text, views, rows) if kind != "varlen" or self._fd < 0
                   else pread_values(self._fd, at, views[0], rows, text, self._where)
                   for (kind, text, views), at in zip(self._columns, self._data_offsets)]
        if not columns:
            return [{} for _ in range(len(rows))]
        return [dict(zip(self.names, values)) for values in zip(*columns)]

    def close(self) -> None:
        self._columns = []


def _read(kind: str, text: bool, views: tuple[np.ndarray, ...], rows: np.ndarray) -> list[Any]:
    if kind == "number":
        return views[0][rows].tolist()
    if kind == "tensor":
        return list(views[0][rows])
    offsets, data = views
    starts, ends = offsets[rows].tolist(), offsets[rows + 1].tolist()
    raw = memoryview(data)
    try:
        if text:
            return [str(raw[a:b], "utf-8") for a, b in zip(starts, ends)]
        return [raw[a:b].tobytes() for a, b in zip(starts, ends)]
    finally:
        raw.release()
