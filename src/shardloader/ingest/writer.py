"""Writing samples (dicts) into shards plus `index.json`.

`write_shards` streams samples into shards of at most `shard_bytes` payload bytes (and at most
`shard_samples` samples), as native Arrow IPC files (default) or WebDataset tars. Every file
appears atomically (see `OutputDir`), and `index.json` is written last, so a directory with an
index always holds every shard the index lists.

Schema: given, or inferred from the first sample (type names in `shardloader.format.schema`).
Every later sample must have the same fields with values that fit their types, else
`SchemaError` names the sample number (0-based position in the input) and the field. Fields
named ``__*__`` are metadata and are not stored, except ``__key__`` (a string field in Arrow
shards; the member name prefix in tars, defaulting to the sample number zero-padded to 9 digits).

A sample larger than `shard_bytes` is not an error: it goes alone into its own shard. A binary or
string value over 2 GiB (`ARROW_VALUE_LIMIT`) is stored in an Arrow shard whose column for that
field is large_binary / large_string (read back as any binary or string field): a shard's
column types are chosen from its first sample, and a later sample that needs a large column
the shard does not have starts a new shard. A value no Arrow column can hold (over 2 GiB inside
a struct field) is a SchemaError naming the sample and the field.
Empty input is an error (`ShardloaderError`): an index of zero samples is useless to a loader,
and writing one would hide an upstream bug.

`shuffle=True` writes in the order of `shardloader.ingest.shuffled`. An input without random
access is spilled here first: written in its own order to a temporary dataset (with this same
writer) and read back by row in the permuted order; the copy is removed on exit, also on error.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import pyarrow as pa
from tqdm.auto import tqdm

from shardloader.errors import SchemaError, ShardloaderError
from shardloader.format.index import INDEX_NAME, Index, ShardInfo
from shardloader.format.ranges import RANGES_KEY, ranges_entry, ranges_path
from shardloader.format.registry import table_of_file
from shardloader.format.schema import (
    ARROW_VALUE_LIMIT,
    arrow_type,
    build_array,
    value_nbytes,
)
from shardloader.format.tar import KEY_FIELD, OFFSETS_KEY, offsets_entry, sidecar_path
from shardloader.format.tar_writer import TarShardWriter, check_tar_field
from shardloader.ingest.samples import SampleSchema, large_fields
from shardloader.ingest.shuffled import (
    DEFAULT_INDEX_FIELD,
    is_sequence,
    permuted_rows,
    permuted_sequence,
    shuffled_schema,
    with_index,
)
from shardloader.ingest.target import OutputDir, discard
from shardloader.io.checksum import checksum_file

WRITE_FORMATS = ("arrow", "tar")


def check_write_options(format: str, shard_bytes: int, shard_samples: int | None) -> None:
    """ValueError naming the argument when a write's shard format or size bounds are bad: the
    one check for `write_shards` and the engine writes (`ingest.parts`)."""
    if format not in WRITE_FORMATS:
        raise ValueError(f"format must be one of {', '.join(WRITE_FORMATS)}, got {format!r}")
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    if shard_samples is not None and shard_samples <= 0:
        raise ValueError(f"shard_samples must be positive or None, got {shard_samples}")


_BATCH_ROWS = 4096  # rows per Arrow record batch, at most
_BATCH_BYTES = 16 << 20  # payload bytes per Arrow record batch, at most
# The temporary copy of a shuffled stream: large shards, all kept open, so that reading it in
# random order touches memory maps, not file opens (2 GiB x 128 covers 256 GiB before readers
# are reopened).
_SPILL_SHARD_BYTES = 2 << 30
_SPILL_OPEN_SHARDS = 128


class _ArrowShard:
    """One Arrow IPC file being written: buffers columns, writes record batches. The fields in
    `large` are stored as large_binary / large_string (see the module doc)."""

    extension = "arrow"

    def __init__(self, path: str, schema: SampleSchema, large: frozenset[str] = frozenset()) -> None:
        self.types = schema.types
        self.large = large
        self.arrow_schema = pa.schema([(f, arrow_type(t, f in large)) for f, t in self.types.items()])
        self._sink = pa.OSFile(path, "wb")
        self._writer = pa.ipc.new_file(self._sink, self.arrow_schema)
        self._columns: dict[str, list[Any]] = {f: [] for f in self.types}
        self._numbers: list[int] = []  # the pending rows' sample numbers, for errors
        self._pending_rows = 0
        self._pending_bytes = 0
        self.samples = 0

    def holds(self, large: frozenset[str]) -> bool:
        """Whether a sample whose `large_fields` are `large` fits this shard's column types."""
        return large <= self.large

    def add(self, values: dict[str, Any], nbytes: int, number: int) -> None:
        # A record batch's column holds at most ARROW_VALUE_LIMIT bytes: a sample that would
        # take the pending rows past it starts a batch of its own.
        if self._pending_rows and self._pending_bytes + nbytes > ARROW_VALUE_LIMIT:
            self._flush()
        for field, value in values.items():
            self._columns[field].append(value)
        self._numbers.append(number)
        self._pending_rows += 1
        self._pending_bytes += nbytes
        self.samples += 1
        if self._pending_rows >= _BATCH_ROWS or self._pending_bytes >= _BATCH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._pending_rows:
            return
        arrays = [self._array(f, t) for f, t in self.types.items()]
        self._writer.write_batch(pa.record_batch(arrays, schema=self.arrow_schema))
        self._columns = {f: [] for f in self.types}
        self._numbers = []
        self._pending_rows = self._pending_bytes = 0

    def _array(self, field: str, name: str) -> pa.Array:
        """The pending rows' column `field`, or a SchemaError naming the sample and the field
        whose value no Arrow array of its type holds (over 2 GiB inside a struct)."""
        values = self._columns[field]
        try:
            return build_array(values, name, field in self.large)
        except pa.ArrowCapacityError as e:
            sizes = [value_nbytes(v) for v in values]
            largest = max(range(len(values)), key=sizes.__getitem__)
            raise SchemaError(
                f"sample {self._numbers[largest]}: field {field!r} ({name}) holds "
                f"{sizes[largest]:,} bytes, more than an Arrow column of that type can hold "
                f"({ARROW_VALUE_LIMIT:,} bytes: {e}); store the value in a binary or string "
                "field of its own (those become large_binary / large_string), or split it"
            ) from None

    def close(self) -> None:
        self._flush()
        self._writer.close()
        self._sink.close()

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self._sink.close()


class _TarShard:
    """One WebDataset tar being written."""

    extension = "tar"

    def __init__(self, path: str, schema: SampleSchema, large: frozenset[str] = frozenset()) -> None:
        self._writer = TarShardWriter(path)
        self.samples = 0

    def holds(self, large: frozenset[str]) -> bool:
        return True  # a tar member has no size limit

    def add(self, values: dict[str, Any], nbytes: int, number: int) -> None:
        if KEY_FIELD not in values:
            values = {KEY_FIELD: f"{number:09d}", **values}
        try:
            self._writer.write(values)
        except ShardloaderError as e:  # bad key or field: name the sample
            raise type(e)(f"sample {number}: {e}") from None
        self.samples += 1

    def close(self) -> None:
        self._writer.close()

    abort = close

    def sidecar(self, tar_bytes: int) -> bytes:
        """The offsets sidecar of the closed tar (recorded while writing, not scanned)."""
        return self._writer.offsets(tar_bytes).encode()

    def member_spans(self, tar_bytes: int) -> Any:
        return self._writer.offsets(tar_bytes).spans


def write_shards(
    samples: Iterable[Mapping[str, Any]],
    out: str | os.PathLike[str],
    *,
    shard_bytes: int = 256 << 20,
    shard_samples: int | None = None,
    format: str = "arrow",
    schema: Mapping[str, str] | None = None,
    progress: bool = False,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    shuffle: bool = False,
    seed: int = 0,
    source_index_field: str | None = DEFAULT_INDEX_FIELD,
    workdir: str | None = None,
    shard_table: str = "auto",
) -> Index:
    """Write `samples` as shards plus `index.json` into directory `out` (path or fsspec URL).

    Shards are named ``shard-00000.<arrow|tar>``; a tar shard also gets an offsets sidecar
    ``shard-00000.tar.idx``, and every shard a range sidecar ``<shard>.ranges`` (the byte spans
    of its rows with their hashes, for reads by range from a cold cache; see
    `shardloader.format.ranges`). Refuses a directory that already holds an `index.json` unless
    `overwrite`. On error, the shards written so far are removed and no index is written.

    `shuffle=True` writes the samples in a seeded random order (a pure function of the sample
    count and `seed`) and stores each one's input position in the int64 field
    `source_index_field` (None: not stored), so that any read order mixes them even when the
    input is sorted (see `shardloader.ingest.shuffled`). A sequence is read by index; any
    other iterable is first copied to a temporary dataset under `workdir`.

    `shard_table`: "json" lists the shards in `index.json`; "table" puts them in an Arrow table
    beside it (`shardloader.format.index_table`: opens in milliseconds at 10^6 shards); "auto"
    picks the table above `TABLE_ABOVE_SHARDS` shards.
    """
    if shard_table not in ("auto", "json", "table"):
        raise ValueError(f"shard_table must be 'auto', 'json' or 'table', got {shard_table!r}")
    if shuffle:
        _refuse_existing(out, overwrite, storage_options)
        with _shuffled(samples, seed, index_field=source_index_field, schema=schema,
                       workdir=workdir) as (ordered, ordered_schema):
            return write_shards(ordered, out, shard_bytes=shard_bytes, shard_samples=shard_samples,
                                format=format, schema=ordered_schema, progress=progress,
                                overwrite=overwrite, storage_options=storage_options,
                                shard_table=shard_table)
    check_write_options(format, shard_bytes, shard_samples)
    out = os.fspath(out)
    target = OutputDir(out, storage_options)
    written: list[str] = []
    try:
        if target.exists(INDEX_NAME):
            if not overwrite:
                raise _exists_error(target)
            target.remove(INDEX_NAME)
        stored, infos = write_shard_files(
            samples, target, _shard_name, written, shard_bytes=shard_bytes,
            shard_samples=shard_samples, format=format, schema=schema, progress=progress)
        if not infos:
            raise ShardloaderError(f"{out}: no samples to write (the input is empty); nothing was written")
        index = Index(schema=stored, shards=tuple(infos))
        write_index(target, index, shard_table, written)
        return index
    except BaseException:
        for name in written:
            target.remove(name)
        raise
    finally:
        target.close()


def write_shard_files(
    samples: Iterable[Mapping[str, Any]],
    target: OutputDir,
    name_of: Callable[[int, str], str],
    written: list[str],
    *,
    shard_bytes: int,
    shard_samples: int | None = None,
    format: str = "arrow",
    schema: Mapping[str, str] | None = None,
    progress: bool = False,
    on_shard: Callable[[ShardInfo], None] | None = None,
) -> tuple[dict[str, str], list[ShardInfo]]:
    """Write `samples` as shards into `target`, shard k named `name_of(k, extension)`; no index.

    Returns (the schema the index records, the shards' index entries); (schema or {}, []) for
    an empty input. Every file made appears whole and is appended to `written` (the caller
    removes them on a later error); a shard being written when an error comes is discarded.
    `on_shard` is called with each shard's entry once its files have appeared.
    """
    spec = SampleSchema(schema) if schema is not None else None
    if spec is not None:
        _check_fields_for_format(spec, format)
    shard_cls = _ArrowShard if format == "arrow" else _TarShard
    infos: list[ShardInfo] = []
    current: _ArrowShard | _TarShard | None = None
    current_temp = ""
    current_bytes = 0
    try:
        for number, sample in enumerate(tqdm(samples, disable=not progress, unit="sample",
                                             desc=f"writing {target.url}")):
            if spec is None:
                spec = SampleSchema.infer(sample, number)
                _check_fields_for_format(spec, format)
            values = spec.check(sample, number)
            nbytes = sum(value_nbytes(v) for v in values.values())
            large = large_fields(values, spec) if format == "arrow" else frozenset()
            if current is not None and (
                (shard_samples is not None and current.samples >= shard_samples)
                or current_bytes + nbytes > shard_bytes
                or not current.holds(large)
            ):
                infos.append(_finish(target, current, current_temp, name_of(len(infos), current.extension), written))
                current = None
                if on_shard is not None:
                    on_shard(infos[-1])
            if current is None:
                current_temp = target.temp_path(name_of(len(infos), shard_cls.extension))
                current = shard_cls(current_temp, spec, large)
                current_bytes = 0
            current.add(values, nbytes, number)
            current_bytes += nbytes
        if current is not None:
            infos.append(_finish(target, current, current_temp, name_of(len(infos), current.extension), written))
            current = None
            if on_shard is not None:
                on_shard(infos[-1])
    except BaseException:
        if current is not None:
            try:
                current.abort()
            except Exception:  # the original error matters more than a failed cleanup
                pass
        if current_temp:
            discard(current_temp)
        raise
    if spec is None:
        return dict(schema or {}), infos
    stored = spec.types if format == "arrow" else {f: "binary" for f in spec.types if f != KEY_FIELD}
    return stored, infos


@contextlib.contextmanager
def _shuffled(
    samples: Iterable[Mapping[str, Any]],
    seed: int,
    *,
    index_field: str | None,
    schema: Mapping[str, str] | None,
    workdir: str | None,
) -> Iterator[tuple[Iterable[dict[str, Any]], dict[str, str] | None]]:
    """(`samples` in the permuted order, each with its input position in `index_field`; the
    schema to write them with, `schema` plus the index field, or None to infer).

    A sequence is read directly; any other iterable is spilled to a temporary dataset under
    `workdir` (the system's temporary folder when None) first.
    """
    out_schema = shuffled_schema(schema, index_field)
    if is_sequence(samples):
        yield permuted_sequence(samples, seed, index_field), out_schema  # type: ignore[arg-type]
        return
    stream = iter(samples)
    first = next(stream, None)
    if first is None:  # let the writer report the empty input, naming its destination
        yield iter(()), out_schema
        return
    from shardloader.dataset.sharded import Dataset

    temp = tempfile.mkdtemp(prefix=".shardloader-shuffle-", dir=workdir)
    try:
        spill = os.path.join(temp, "source-order")
        indexed = (with_index(s, index_field, i) for i, s in enumerate(itertools.chain([first], stream)))
        index = write_shards(indexed, spill, schema=out_schema, shard_bytes=_SPILL_SHARD_BYTES)
        # written just now by this process: no need to verify its checksums again
        dataset = Dataset(spill, verify=False, max_open_shards=_SPILL_OPEN_SHARDS)
        try:
            yield permuted_rows(dataset, seed), dict(index.schema)
        finally:
            dataset.close()
    finally:
        shutil.rmtree(temp, ignore_errors=True)


#: Above this many shards, `shard_table="auto"` writes the table form of the index.
TABLE_ABOVE_SHARDS = 10_000


def write_index(target: OutputDir, index: Index, shard_table: str = "auto",
                written: list[str] | None = None) -> None:
    """Write `index` into `target` as `index.json` (last: its appearance completes a dataset),
    its shards in a table file beside it when `shard_table` says so (see `write_shards`)."""
    from shardloader.format.index_table import TABLE_NAME, table_form

    form = None
    if shard_table == "table" or (shard_table == "auto" and index.num_shards > TABLE_ABOVE_SHARDS):
        form = table_form(index)
        if form is None and shard_table == "table":
            raise ValueError("shard_table='table' needs every shard checksum of one algorithm")
    if form is None:
        target.remove(TABLE_NAME)  # a table-form index this one replaces: nothing would name it
        target.write_bytes(INDEX_NAME, index.dumps().encode())
        return
    document, table = form
    target.write_bytes(TABLE_NAME, table)
    if written is not None:
        written.append(TABLE_NAME)
    target.write_bytes(INDEX_NAME, document)


def _refuse_existing(out: str | os.PathLike[str], overwrite: bool,
                     storage_options: dict[str, Any] | None) -> None:
    """The writer's refusal of an existing dataset, checked before a shuffle's spill."""
    if overwrite:
        return
    target = OutputDir(os.fspath(out), storage_options)
    try:
        if target.exists(INDEX_NAME):
            raise _exists_error(target)
    finally:
        target.close()


def _exists_error(target: OutputDir) -> ShardloaderError:
    return ShardloaderError(
        f"{target.final_path(INDEX_NAME)}: the output directory already holds a dataset; "
        "choose an empty directory or pass overwrite=True (`--overwrite` for "
        "`shardloader convert`)"
    )


def _check_fields_for_format(spec: SampleSchema, format: str) -> None:
    """Tar members carry fields as lowercase extensions: refuse names that would not round trip."""
    if format == "tar":
        for field in spec.types:
            if field != KEY_FIELD:
                check_tar_field(field)


def _shard_name(number: int, extension: str) -> str:
    return f"shard-{number:05d}.{extension}"


def _finish(
    target: OutputDir, shard: _ArrowShard | _TarShard, temp: str, name: str, written: list[str]
) -> ShardInfo:
    """Close `shard`, checksum it, make it (and a tar's sidecar) appear as `name`; its entry."""
    shard.close()
    checksum, size = checksum_file(temp)
    extra: dict[str, Any] = {}
    tar_spans = None
    if isinstance(shard, _TarShard):
        sidecar = shard.sidecar(size)
        target.write_bytes(sidecar_path(name), sidecar)
        written.append(sidecar_path(name))
        extra[OFFSETS_KEY] = offsets_entry(sidecar_path(name), sidecar)
        tar_spans = shard.member_spans(size)
    ranges = table_of_file(temp, shard.extension, tar_spans).encode()
    target.write_bytes(ranges_path(name), ranges)
    written.append(ranges_path(name))
    extra[RANGES_KEY] = ranges_entry(ranges_path(name), ranges)
    target.commit(temp, name)
    written.append(name)
    return ShardInfo(name, shard.extension, shard.samples, size, checksum, extra)
