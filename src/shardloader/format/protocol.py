"""What a shard format's code provides, and what it is given: the protocols between the formats
and everything that reads shards through `shardloader.format.registry`.

A `ShardReader` reads single rows or lists of rows of one local shard file without
materialising the whole shard as Python objects (Arrow is memory-mapped, tars are read by
seeking to recorded member offsets, Parquet reads only the row groups that hold the rows).
Values come back as plain Python objects per field: `bytes` for binary fields, `int`,
`float`, `str`, and `numpy.ndarray` for fixed-shape array fields.

Every reader holds its file open (pinning the inode it verified) and checks before and after
each read that the file did not change in place (see `shardloader.io.identity`): a shard
truncated or rewritten under an open reader is a `ShardChangedError` naming it, never a crash
by SIGBUS on a memory-mapped page that no longer exists.

A reader is given a `ShardEntry`, what the index says of its shard (the index's `ShardInfo` is
one): the formats' code depends on this protocol, not on `shardloader.format.index`, because
the index asks the registry which formats exist and the registry loads the formats' code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from shardloader.format.ranges import RangeTable
    from shardloader.io.identity import FileIdentity


class ShardEntry(Protocol):
    """What a reader is told of its shard by the index (`shardloader.format.index.ShardInfo`)."""

    @property
    def path(self) -> str: ...  # relative to the dataset root, as listed

    @property
    def format(self) -> str: ...

    @property
    def samples(self) -> int: ...

    @property
    def extra(self) -> Mapping[str, Any]: ...  # format-specific keys (a tar's offsets sidecar)


class ShardReader(Protocol):
    """Row access to one shard. Readers are opened per process and are not shared across fork."""

    def __len__(self) -> int: ...

    def read(self, row: int) -> dict[str, Any]: ...

    def read_rows(self, rows: Sequence[int]) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


class OpenReader(Protocol):
    """Opens the local file `path` of shard `entry`. With `schema` (the index's), the reader
    checks that the shard's fields and types match it; with `expect` (the identity its source
    verified), opening a different file is a ShardChangedError, raised before it is parsed."""

    def __call__(self, path: str, entry: ShardEntry, schema: Mapping[str, str] | None = None, /, *,
                 expect: FileIdentity | None = None) -> ShardReader: ...


class RowsFromSpans(Protocol):
    """Records of `rows` (any order, repeats allowed) from verified spans `fetched` (span id ->
    bytes; at least `table.needed(rows)`), byte-identical to the local reader's; `members` is
    the decoded companion sidecar of a format that has one (a tar's `TarOffsets`)."""

    def __call__(self, table: RangeTable, fetched: Mapping[int, bytes], rows: Sequence[int] | np.ndarray,
                 *, where: str, members: Any = None) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class FormatCode:
    """The code of one shard format, which its module exports as `FORMAT_CODE` and the registry
    imports on first use (so that naming a format loads none of its libraries)."""

    open_reader: OpenReader
    #: The range table of a shard file from its bytes (`shardloader.format.ranges`), and for a
    #: format with a companion sidecar its member spans (a tar's int64 [samples, fields, 2]).
    range_table: Callable[[memoryview | bytes, np.ndarray | None], RangeTable]
    rows_from_spans: RowsFromSpans
    #: Parses the companion sidecar's bytes (naming `where` when they are malformed) into the
    #: `members` that `rows_from_spans` needs; None for a format without a companion.
    decode_companion: Callable[..., Any] | None = None
