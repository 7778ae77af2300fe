"""The shard formats shardloader reads, what each provides, and the calls that dispatch to them.

Each format is one `ShardFormat` in `FORMATS`: what is known of it without loading its code
(file suffix, the companion sidecar its readers need, what `shardloader index` and `Dataset`
do with it), and a loader of its code, a `FormatCode` (reader, range table, rows from fetched
spans). The loader imports the format's module on first use: naming a format (validating an
index, naming a cache file) loads none of its libraries. Loading Arrow's code loads pyarrow's
IPC reader with it: a Loader loads its formats' code before forking its workers
(`BatchProducer.warm_up`), which then share pyarrow's pages instead of each importing it.

Adding a format: a module that exports its `FormatCode` as `FORMAT_CODE`, a loader of it below,
and its line in `FORMATS`.

The formats' code depends on `shardloader.format.protocol`, never on this module or on the
index (which asks this module which formats exist): so the loaders' imports make no circle.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardloader.format.protocol import FormatCode, ShardEntry, ShardReader

if TYPE_CHECKING:
    import numpy as np

    from shardloader.format.ranges import RangeTable
    from shardloader.io.identity import FileIdentity


@dataclass(frozen=True)
class Sidecar:
    """A file a format's readers need besides the shard file, written next to it as
    ``<shard><suffix>``, described in the shard's index entry under `key` (path, bytes,
    checksum) and kept next to the shard in the node cache."""

    key: str
    suffix: str


@dataclass(frozen=True)
class ShardFormat:
    """One shard format: its facts, and `load`, which imports its code the first time."""

    name: str  # as in the index entry's "format"; also the extension of its cache files
    suffix: str  # of its shard files
    load: Callable[[], FormatCode]
    companion: Sidecar | None = None
    #: `shardloader index` indexes a folder of such files in place (foreign files, not written
    #: by shardloader).
    indexable: bool = False
    #: Its fields are encoded member bytes named by extension (WebDataset), which
    #: `Dataset(decode=...)` decodes (`shardloader.format.wds_decode`).
    encoded_fields: bool = False
    #: A read by range fetches the whole group (row group) that holds a row, the unit it
    #: decodes; the index entry records the shard's groups under "row_groups".
    reads_whole_groups: bool = False

    def open_reader(self, path: str, entry: ShardEntry, schema: Mapping[str, str] | None = None, *,
                    expect: FileIdentity | None = None) -> ShardReader:
        return self.load().open_reader(path, entry, schema, expect=expect)

    def range_table(self, data: memoryview | bytes, member_spans: np.ndarray | None = None) -> RangeTable:
        return self.load().range_table(data, member_spans)

    def rows_from_spans(self, table: RangeTable, fetched: Mapping[int, bytes],
                        rows: Sequence[int] | np.ndarray, *, where: str,
                        members: Any = None) -> list[dict[str, Any]]:
        return self.load().rows_from_spans(table, fetched, rows, where=where, members=members)

    def decode_companion(self, data: bytes, *, where: str) -> Any:
        """The companion sidecar's bytes parsed (a tar's `TarOffsets`); ShardError naming
        `where` when they are malformed."""
        decode = self.load().decode_companion
        assert decode is not None, f"shard format {self.name!r} has no companion sidecar"
        return decode(data, where=where)


def _arrow() -> FormatCode:
    import pyarrow.ipc  # noqa: F401 - what the reader uses, loaded with its code (see above)

    from shardloader.format.arrow import FORMAT_CODE

    return FORMAT_CODE


def _tar() -> FormatCode:
    from shardloader.format.tar import FORMAT_CODE

    return FORMAT_CODE


def _parquet() -> FormatCode:
    from shardloader.format.parquet import FORMAT_CODE

    return FORMAT_CODE


#: The formats, in the order error messages list them.
FORMATS: dict[str, ShardFormat] = {
    "arrow": ShardFormat("arrow", ".arrow", _arrow),
    "tar": ShardFormat("tar", ".tar", _tar, companion=Sidecar("offsets", ".idx"), indexable=True,
                       encoded_fields=True),
    "parquet": ShardFormat("parquet", ".parquet", _parquet, indexable=True, reads_whole_groups=True),
}


def shard_format(name: object, *, where: str | None = None) -> ShardFormat:
    """The format called `name`; a ValueError naming it (after `where`, when given) and the
    known formats when there is none."""
    found = FORMATS.get(name) if isinstance(name, str) else None
    if found is None:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}unknown shard format {name!r} (known: {', '.join(FORMATS)})")
    return found


def open_shard(
    info: ShardEntry, local_path: str, schema: Mapping[str, str] | None = None, *,
    expect: FileIdentity | None = None,
) -> ShardReader:
    """Open the local file of shard `info` with the reader for its format.

    With `schema` (the index's), the reader checks that the shard's fields and types match it.
    With `expect` (the identity its source verified), opening a different file (one renamed
    over the path since) is a ShardChangedError, raised before the file is parsed.
    """
    return shard_format(info.format, where=info.path).open_reader(local_path, info, schema, expect=expect)


def table_of_file(path: str, fmt: str, tar_spans: np.ndarray | None = None) -> RangeTable:
    """The range table of the local shard file at `path` of format `fmt` (memory-mapped while it
    is built); a tar needs its member spans `tar_spans` (`TarOffsets.spans`)."""
    shard = shard_format(fmt)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            return shard.range_table(b"", tar_spans)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = memoryview(m)
            try:
                return shard.range_table(view, tar_spans)
            finally:
                view.release()


def rows_from_spans(table: RangeTable, fetched: Mapping[int, bytes], rows: Sequence[int] | np.ndarray,
                    *, where: str, tar_offsets: Any = None) -> list[dict[str, Any]]:
    """Records of `rows` (any order, repeats allowed) from verified spans `fetched` (span id ->
    bytes; at least `table.needed(rows)`), byte-identical to the local reader's, by the code of
    the table's format. A tar needs its member table `tar_offsets` (its decoded companion, a
    `TarOffsets`: the keys and the field order)."""
    return shard_format(table.format, where=where).rows_from_spans(
        table, fetched, rows, where=where, members=tar_offsets)
