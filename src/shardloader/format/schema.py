"""Field types: the names used in `index.json`, their Arrow types, and Python values.

Type names in an index schema (field -> name):

- ``binary`` (Python ``bytes``), ``string`` (``str``), ``bool``
- ``int8`` .. ``int64``, ``uint8`` .. ``uint64`` (``int``); ``float16``, ``float32``,
  ``float64`` (``float``)
- ``array<DTYPE>[D0,D1,...]``: a numpy array of fixed shape and numeric dtype, e.g.
  ``array<float32>[3,224,224]`` (stored as Arrow's fixed-shape tensor extension type)
- ``struct<NAME: T, ...>``: a dict with exactly those keys, each value of type T (any writable
  type name) or None. Hugging Face `datasets` stores images this way
  (``struct<bytes: binary, path: string>``), so `convert` keeps such columns as they are.
- other Arrow types found in Parquet files: ``list<T>``, ``fixed_size_list<T>[N]`` (T a type
  name), anything else in Arrow's own spelling (``str(type)``, e.g. ``timestamp[ms]``). Their
  values come back as pyarrow's `to_pylist` gives them, except fixed-size lists of numbers,
  which come back as 1-D numpy arrays.

The writer infers a schema from the first sample: ``bytes``/``bytearray``/``memoryview`` ->
binary, ``int`` -> int64, ``float`` -> float64, ``str`` -> string, ``bool`` -> bool, numpy
scalars -> their dtype, numpy arrays (numeric, at least 1-D) -> ``array<dtype>[shape]``.
Large Arrow variants (large_binary, large_string) read as binary and string. The writer stores
a binary or string field as its large variant in a shard that holds a value too large for the
plain one (more than `ARROW_VALUE_LIMIT` bytes: Arrow's binary and string arrays have 32-bit
offsets), so a sample over 2 GiB is written like any other.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from shardloader.errors import SchemaError
from shardloader.format.rows import pread_values

_SCALARS: dict[str, pa.DataType] = {
    "binary": pa.binary(),
    "string": pa.string(),
    "bool": pa.bool_(),
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "uint8": pa.uint8(),
    "uint16": pa.uint16(),
    "uint32": pa.uint32(),
    "uint64": pa.uint64(),
    "float16": pa.float16(),
    "float32": pa.float32(),
    "float64": pa.float64(),
}
#: The most bytes the values of one Arrow binary or string array can hold (32-bit offsets, as
#: pyarrow's builders count: int32 max - 1); a value over it needs large_binary / large_string.
ARROW_VALUE_LIMIT = 2**31 - 2
_LARGE_TYPES = {"binary": pa.large_binary(), "string": pa.large_string()}
_INT_NAMES = frozenset(n for n in _SCALARS if n.startswith(("int", "uint")))
_FLOAT_NAMES = frozenset(n for n in _SCALARS if n.startswith("float"))
_ARRAY_RE = re.compile(r"^array<([a-z0-9]+)>\[([0-9]+(?:,[0-9]+)*)\]$")
_ARRAY_KINDS = "iuf"  # numpy dtype kinds an array field may have
#: Arrow numeric type -> numpy dtype (the names are numpy's). Used instead of pyarrow's
#: `to_numpy`/`to_pandas_dtype`, which import pandas on first use: 0.25 s and ~40 MiB in every
#: process that reads a shard (a loader's workers included) for nothing we need.
_NUMPY_DTYPES: dict[pa.DataType, np.dtype] = {
    t: np.dtype(n) for n, t in _SCALARS.items() if n in _INT_NAMES or n in _FLOAT_NAMES}


# -- names <-> Arrow types ---------------------------------------------------------------------
def array_type_name(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    return f"array<{np.dtype(dtype).name}>[{','.join(str(int(d)) for d in shape)}]"


def parse_array_type(name: str) -> tuple[np.dtype, tuple[int, ...]] | None:
    """(dtype, shape) of an ``array<...>[...]`` type name, or None for any other name."""
    match = _ARRAY_RE.match(name)
    if not match:
        return None
    dtype = np.dtype(match.group(1))
    return dtype, tuple(int(d) for d in match.group(2).split(","))


def arrow_type(name: str, large: bool = False) -> pa.DataType:
    """The Arrow type the writer stores a field of type `name` as; with `large`, a binary or
    string field as large_binary / large_string (64-bit offsets)."""
    if large and name in _LARGE_TYPES:
        return _LARGE_TYPES[name]
    if name in _SCALARS:
        return _SCALARS[name]
    parsed = parse_array_type(name)
    if parsed is not None and parsed[0].kind in _ARRAY_KINDS:
        return pa.fixed_shape_tensor(pa.from_numpy_dtype(parsed[0]), list(parsed[1]))
    fields = parse_struct_type(name)
    if fields is not None:
        return pa.struct([(field, arrow_type(child)) for field, child in fields.items()])
    raise SchemaError(
        f"type {name!r} cannot be written (writable: {', '.join(_SCALARS)}, array<DTYPE>[SHAPE], "
        "struct<NAME: TYPE, ...>)"
    )


def struct_type_name(fields: Mapping[str, str]) -> str:
    """The type name of a struct with `fields` (field -> type name), in pyarrow's spelling."""
    return "struct<" + ", ".join(f"{field}: {name}" for field, name in fields.items()) + ">"


def parse_struct_type(name: str) -> dict[str, str] | None:
    """Field -> type name of a ``struct<NAME: T, ...>`` type name, or None for any other name.

    Splits on the top-level ", " only, so that children may be structs or lists themselves.
    """
    if not (name.startswith("struct<") and name.endswith(">")):
        return None
    body, parts, depth, start = name[len("struct<"):-1], [], 0, 0
    for i, char in enumerate(body):
        if char in "<[":
            depth += 1
        elif char in ">]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(body[start:i].strip())
            start = i + 1
    if body.strip():
        parts.append(body[start:].strip())
    fields: dict[str, str] = {}
    for part in parts:
        field, sep, child = part.partition(": ")
        if not sep or not field or field in fields:
            raise SchemaError(f"malformed struct type {name!r} (at {part!r})")
        fields[field] = child
    if not fields:
        raise SchemaError(f"struct type {name!r} has no fields")
    return fields


def type_name(dtype: pa.DataType) -> str:
    """The index type name of an Arrow type (inverse of `arrow_type` for writable types)."""
    if isinstance(dtype, pa.FixedShapeTensorType):
        value = _NUMPY_DTYPES.get(dtype.value_type)
        if value is None:  # not writable by us; pyarrow knows (and imports pandas for it)
            value = np.dtype(dtype.value_type.to_pandas_dtype())
        return array_type_name(value, tuple(dtype.shape))
    if pa.types.is_large_binary(dtype) or pa.types.is_binary(dtype):
        return "binary"
    if pa.types.is_large_string(dtype) or pa.types.is_string(dtype):
        return "string"
    for name, scalar in _SCALARS.items():
        if dtype == scalar:
            return name
    if pa.types.is_struct(dtype):
        return struct_type_name({dtype.field(i).name: type_name(dtype.field(i).type)
                                 for i in range(dtype.num_fields)})
    # List types are named without their item field's name, which Parquet round trips rename.
    if pa.types.is_fixed_size_list(dtype):
        return f"fixed_size_list<{type_name(dtype.value_type)}>[{dtype.list_size}]"
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        return f"list<{type_name(dtype.value_type)}>"
    return str(dtype)


def schema_names(schema: pa.Schema) -> dict[str, str]:
    """Field -> type name for every field of an Arrow schema, in schema order."""
    return {f.name: type_name(f.type) for f in schema}


# -- Python values -----------------------------------------------------------------------------
def infer_type(value: Any) -> str:
    """The type name of a Python value; raises SchemaError (without context) if unsupported."""
    if isinstance(value, (bool, np.bool_)):
        return "bool"
    if isinstance(value, int):
        return "int64"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "binary"
    if isinstance(value, np.generic) and value.dtype.kind in _ARRAY_KINDS:
        return value.dtype.name
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise SchemaError("0-d numpy arrays are not stored; pass a scalar (`.item()`) instead")
        if value.dtype.kind not in _ARRAY_KINDS:
            raise SchemaError(
                f"numpy arrays of dtype {value.dtype} are not stored (numeric dtypes only; "
                "store bool arrays as uint8)"
            )
        return array_type_name(value.dtype, value.shape)
    if value is None:
        raise SchemaError("None values are not stored (every field needs a value)")
    if isinstance(value, Mapping) and value and all(isinstance(k, str) and k for k in value):
        try:
            return struct_type_name({k: infer_type(v) for k, v in value.items()})
        except SchemaError as e:
            raise SchemaError(f"dict value: {e}") from None
    raise SchemaError(
        f"values of type {type(value).__name__} are not stored (use bytes, str, int, float, bool, "
        "a numeric numpy array, or a dict of those with string keys)"
    )


def value_fits(value: Any, name: str) -> bool:
    """True when `value` can be stored in a field of type `name` without losing information."""
    struct = parse_struct_type(name) if name.startswith("struct<") else None
    if struct is not None:
        return isinstance(value, Mapping) and value.keys() == struct.keys() and all(
            v is None or value_fits(v, struct[k]) for k, v in value.items()
        )
    try:
        inferred = infer_type(value)
    except SchemaError:
        return False
    if inferred == name:
        return True
    if inferred == "bool":
        return False
    if name in _INT_NAMES and inferred in _INT_NAMES:
        info = np.iinfo(np.dtype(name))
        return info.min <= int(value) <= info.max
    if name in _FLOAT_NAMES:
        return inferred in _INT_NAMES or inferred in _FLOAT_NAMES
    return False


def value_nbytes(value: Any) -> int:
    """Approximate stored size of a value, for shard size accounting."""
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, Mapping):
        return sum(value_nbytes(v) for v in value.values() if v is not None)
    return 8


def needs_large(value: Any, name: str) -> bool:
    """Whether a field of type `name` holding `value` must be stored as large_binary /
    large_string: more than `ARROW_VALUE_LIMIT` bytes (a str: possibly, at 4 UTF-8 bytes a
    character, so that it is never encoded here to find out)."""
    if name == "binary":
        return value_nbytes(value) > ARROW_VALUE_LIMIT
    return name == "string" and isinstance(value, str) and 4 * len(value) > ARROW_VALUE_LIMIT


def build_array(values: list[Any], name: str, large: bool = False) -> pa.Array:
    """An Arrow array of type `arrow_type(name, large)` from Python values already checked with
    `value_fits`."""
    dtype = arrow_type(name, large)
    if isinstance(dtype, pa.FixedShapeTensorType):
        np_dtype, shape = parse_array_type(name)  # type: ignore[misc]
        stacked = np.ascontiguousarray(np.stack(values).astype(np_dtype, copy=False))
        flat = pa.array(stacked.reshape(-1))
        size = int(np.prod(shape))
        storage = pa.FixedSizeListArray.from_arrays(flat, size)
        return pa.ExtensionArray.from_storage(dtype, storage)
    if name == "binary":
        values = [bytes(v) if isinstance(v, memoryview) else v for v in values]
    return pa.array(values, type=dtype)


class MappedFile:
    """Where a memory-mapped file lies, for reading its bytes with `pread` instead of through
    the mapping: `fd` is open on the file, which is mapped at `address` for `size` bytes."""

    __slots__ = ("fd", "address", "size", "where")

    def __init__(self, fd: int, address: int, size: int, where: str) -> None:
        self.fd, self.address, self.size, self.where = fd, address, size, where

    def offset_of(self, buffer: pa.Buffer) -> int | None:
        """The file offset of `buffer` if it lies in the mapping, else None."""
        start = buffer.address - self.address
        return start if 0 <= start and start + buffer.size <= self.size else None


def column_reader(array: pa.Array, mapped: MappedFile | None = None) -> Callable[[np.ndarray], list[Any]]:
    """A function from row positions (int64 array, any order, repeats allowed) to those rows'
    Python values, touching only those rows.

    Built once per column: binary and string rows are sliced straight out of the column's data
    buffer (for a memory-mapped file, one copy from the page cache into `bytes`), fixed-width
    numbers and tensors are indexed through zero-copy numpy views. Tensor and fixed-size-list
    rows come back as numpy arrays (views of one writable array copied for the call); anything
    else (nulls, nested types) goes through `take` and `to_pylist`. Nothing returned refers to
    the column's buffers, so a memory-mapped file can be closed after the call.
    """
    dtype = array.type
    if array.null_count == 0:
        if isinstance(dtype, pa.FixedShapeTensorType):
            tensors = _tensor_view(array)
            return lambda rows: list(tensors[rows])
        large = pa.types.is_large_binary(dtype) or pa.types.is_large_string(dtype)
        if large or pa.types.is_binary(dtype) or pa.types.is_string(dtype):
            return _varlen_reader(array, large, text=pa.types.is_string(dtype)
                                  or pa.types.is_large_string(dtype), mapped=mapped)
        if dtype in _NUMPY_DTYPES:
            values = numeric_view(array)
            return _light(lambda rows: values[rows].tolist())
        if pa.types.is_fixed_size_list(dtype) and dtype.value_type in _NUMPY_DTYPES \
                and array.values.null_count == 0:
            matrix = numeric_view(array.flatten()).reshape(len(array), dtype.list_size)
            return lambda rows: list(matrix[rows])
    return lambda rows: array.take(pa.array(rows, type=pa.int64())).to_pylist()


def numeric_view(array: pa.Array) -> np.ndarray:
    """A zero-copy, read-only numpy view of a numeric Arrow array without nulls (int*, uint*,
    float*): what `array.to_numpy(zero_copy_only=True)` gives, without importing pandas."""
    dtype = _NUMPY_DTYPES[array.type]
    data = array.buffers()[1]
    if data is None or not len(array):
        return np.empty(0, dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


def _tensor_view(array: pa.ExtensionArray) -> np.ndarray:
    """Rows of a fixed-shape tensor array as one numpy array (rows, *shape), zero-copy where
    the layout allows (row-major, numeric, no nulls), else pyarrow's `to_numpy_ndarray`."""
    dtype = array.type
    storage = array.storage
    permutation = dtype.permutation
    plain = permutation is None or list(permutation) == list(range(len(dtype.shape)))
    if not plain or dtype.value_type not in _NUMPY_DTYPES or storage.values.null_count:
        return array.to_numpy_ndarray()
    return numeric_view(storage.flatten()).reshape(len(array), *dtype.shape)


def _varlen_reader(array: pa.Array, large: bool, text: bool,
                   mapped: MappedFile | None = None) -> Callable[[np.ndarray], list[Any]]:
    """Rows of a binary or string column. For a column of a memory-mapped file (`mapped`) the
    values are read with `pread`, not through the mapping: the same one copy from the page
    cache, without faulting the pages into this process (and, with the reader's `madvise`
    that keeps its resident set small, faulting them again every epoch). Measured on 15 KB
    JPEG rows, 64-row reads: 21 -> 10 us per row."""
    _, offsets_buf, data_buf = array.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64 if large else np.int32)
    offsets = offsets[array.offset:array.offset + len(array) + 1]
    file_offset = mapped.offset_of(data_buf) if mapped is not None and data_buf is not None else None
    data = memoryview(data_buf) if data_buf is not None else memoryview(b"")

    def read(rows: np.ndarray) -> list[Any]:
        starts, ends = offsets[rows].tolist(), offsets[rows + 1].tolist()
        if text:
            return [str(data[a:b], "utf-8") for a, b in zip(starts, ends)]
        return [data[a:b].tobytes() for a, b in zip(starts, ends)]

    def pread(rows: np.ndarray) -> list[Any]:
        return pread_values(mapped.fd, file_offset, offsets, rows, text, mapped.where)

    return read if file_offset is None else _light(pread)


def _light(reader: Callable[[np.ndarray], list[Any]]) -> Callable[[np.ndarray], list[Any]]:
    """Mark a column reader that touches at most 8 bytes of the mapping per row (a number, or a
    pread value's offsets): a file whose readers are all light need not give its touched pages
    back after each read (see `BatchRows.maps_rows`)."""
    reader.light = True  # type: ignore[attr-defined]
    return reader


class BatchRows:
    """Row access to one record batch through per-column readers built once.

    Every field of a shardloader schema holds a value in every row (a `None` would reach
    collate, far from its cause), so reading a row whose field is null is a SchemaError naming
    `where` (the file), the row (counted from `first_row`, the batch's first row in the file)
    and the field. Columns without nulls (all that the writer produces) cost nothing for this.
    """

    def __init__(self, batch: pa.RecordBatch, *, where: str = "record batch", first_row: int = 0,
                 mapped: MappedFile | None = None) -> None:
        self.batch = batch
        self.names = batch.schema.names
        self.num_rows = batch.num_rows
        self.where = where
        self.first_row = first_row
        self._readers = [column_reader(column, mapped) for column in batch.columns]
        #: Whether reading rows touches their data through the mapping (tensors, binary values
        #: not read with pread, ...), so that the reader should let go of the pages after.
        self.maps_rows = not all(getattr(read, "light", False) for read in self._readers)
        self._validity = [
            (name, column.is_valid().to_numpy(zero_copy_only=False))
            for name, column in zip(self.names, batch.columns) if column.null_count
        ]

    def _check_not_null(self, rows: np.ndarray) -> None:
        for name, valid in self._validity:
            bad = np.flatnonzero(~valid[rows])
            if bad.size:
                row = self.first_row + int(rows[bad[0]])
                raise SchemaError(
                    f"{self.where}: row {row}: field {name!r} is null; every field of a "
                    f"shardloader dataset needs a value in every row (fill or drop the nulls "
                    f"when writing; `shardloader verify` lists the fields that hold nulls)"
                )

    def records(self, rows: np.ndarray) -> list[dict[str, Any]]:
        """Rows `rows` (positions in the batch, any order, repeats allowed) as dicts."""
        if self._validity:
            self._check_not_null(rows)
        columns = [read(rows) for read in self._readers]
        if not columns:
            return [{} for _ in range(len(rows))]
        return [dict(zip(self.names, values)) for values in zip(*columns)]


def batch_records(batch: pa.RecordBatch, rows: np.ndarray, *, where: str = "record batch",
                  first_row: int = 0) -> list[dict[str, Any]]:
    """Rows `rows` of `batch` as dicts field -> value (a null is a SchemaError naming `where`)."""
    return BatchRows(batch, where=where, first_row=first_row).records(np.asarray(rows, dtype=np.int64))


def null_counts(batches: Any) -> dict[str, int]:
    """Field -> number of nulls over record batches or tables, for the fields that hold any."""
    counts: dict[str, int] = {}
    for batch in batches:
        for name, column in zip(batch.schema.names, batch.columns):
            if column.null_count:
                counts[name] = counts.get(name, 0) + column.null_count
    return counts
