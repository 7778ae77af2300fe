"""WebDataset tar shards: read in place by seeking to member offsets (written by
`shardloader.format.tar_writer`).

Grouping follows webdataset's rule: a member's key is its path up to the first dot of its
basename and its field is the rest of the name, lowercased (``a/0001.seg.PNG`` -> key
``a/0001``, field ``seg.png``); consecutive members with the same key form one sample. As in
webdataset, directories, members whose basename has no dot, and metadata members matching
``__*__`` at the start of the name are skipped. Unlike webdataset, which silently skips them,
links and device files are an error, as are names that are absolute or contain ``..``.

Every sample of a shard must hold the same fields. A sample reads back as
``{field: bytes, ..., "__key__": key}``.

Offsets. A reader needs, for each sample, each field's (data offset, size) in the tar. They
come from a sidecar file ``<shard>.idx`` (written by `shardloader index` and by the writer,
recorded in the shard's index entry under ``"offsets"`` with its own size and checksum, and
expected next to the shard's local file) or, when the sidecar is absent or does not verify, from
a scan of the tar headers with `tarfile` (seeking over member data, never extracting). Either
way the sample count must equal the index entry's. `tarfile` is used for the scan rather than a
hand-written header parser: it handles PAX and GNU long names, and the scan is only the fallback.

Sidecar layout (little-endian)::

    b"SLTIDX1\\n" | uint64 header length | header JSON (utf-8):
        {"fields": [...], "keys": [...], "samples": n, "tar_bytes": size}
    | int64[n, len(fields), 2]  (data offset, size) per sample and field

Every (offset, size) of a sidecar must lie inside the tar (``0 <= offset``, ``0 <= size``,
``offset + size <= tar_bytes``): one that does not is a ShardError naming the sidecar, the sample
and the field, and a reader then scans the tar instead, with a warning (as for a sidecar that
does not match its index entry).
"""

from __future__ import annotations

import json
import os
import re
import struct
import tarfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardloader.errors import SchemaError, ShardError, ShardloaderError
from shardloader.format.protocol import FormatCode, ShardEntry
from shardloader.format.ranges import RangeTable, RangeTableBuilder
from shardloader.format.rows import check_schema, pread_full
from shardloader.io.checksum import checksum_bytes, parse_checksum
from shardloader.io.identity import FileGuard, FileIdentity
from shardloader.io.jsondata import parse_json
from shardloader.io.paths import safe_relative_path

KEY_FIELD = "__key__"
SIDECAR_SUFFIX = ".idx"
OFFSETS_KEY = "offsets"  # the shard index entry's key describing the sidecar
_SIDECAR_MAGIC = b"SLTIDX1\n"
BLOCK = 512
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext rule
META_RE = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta rule


def split_member_name(name: str) -> tuple[str, str] | None:
    """(key, field) of a tar member name by webdataset's rule, or None when it has no field."""
    match = _KEY_RE.match(name)
    if not match:
        return None
    return match.group(1), match.group(2).lower()


def sidecar_path(shard_path: str) -> str:
    """Where the offsets sidecar of the tar at `shard_path` lives (local path or relative)."""
    return shard_path + SIDECAR_SUFFIX


@dataclass(frozen=True)
class TarOffsets:
    """The member table of one tar shard: keys, fields and (offset, size) per sample x field."""

    keys: list[str]
    fields: tuple[str, ...]
    spans: np.ndarray  # int64 [samples, fields, 2]
    tar_bytes: int

    def __len__(self) -> int:
        return len(self.keys)

    def encode(self) -> bytes:
        """The sidecar bytes of this table."""
        header = json.dumps(
            {"fields": list(self.fields), "keys": self.keys, "samples": len(self.keys),
             "tar_bytes": self.tar_bytes},
            ensure_ascii=False, separators=(",", ":"),
        ).encode()
        spans = np.ascontiguousarray(self.spans, dtype="<i8")
        return _SIDECAR_MAGIC + struct.pack("<Q", len(header)) + header + spans.tobytes()

    @classmethod
    def decode(cls, data: bytes, *, where: str) -> TarOffsets:
        """Parse sidecar bytes, raising ShardError naming `where` if they are malformed."""
        prefix = len(_SIDECAR_MAGIC) + 8
        if len(data) < prefix or not data.startswith(_SIDECAR_MAGIC):
            raise ShardError(f"{where}: not a shardloader tar offsets sidecar (bad magic)")
        (header_len,) = struct.unpack_from("<Q", data, len(_SIDECAR_MAGIC))
        try:
            header = parse_json(data[prefix:prefix + header_len], what="sidecar header")
            fields, keys = tuple(header["fields"]), list(header["keys"])
            samples, tar_bytes = int(header["samples"]), int(header["tar_bytes"])
        except (ValueError, KeyError, TypeError) as e:
            raise ShardError(f"{where}: malformed sidecar header ({e})") from None
        body = data[prefix + header_len:]
        if samples != len(keys) or len(body) != samples * len(fields) * 16:
            raise ShardError(f"{where}: sidecar is truncated or inconsistent")
        spans = np.frombuffer(body, dtype="<i8").reshape(samples, len(fields), 2).astype(np.int64)
        _check_spans(spans, keys, fields, tar_bytes, where=where)
        return cls(keys, fields, spans, tar_bytes)


def _check_spans(spans: np.ndarray, keys: list[str], fields: tuple[str, ...], tar_bytes: int, *,
                 where: str) -> None:
    """A ShardError naming `where` and the first member whose (offset, size) leaves the tar."""
    if tar_bytes < 0:
        raise ShardError(f"{where}: sidecar header gives the tar a negative size ({tar_bytes})")
    offsets, sizes = spans[..., 0], spans[..., 1]
    # offset > tar_bytes - size, not offset + size > tar_bytes: no int64 overflow
    outside = (offsets < 0) | (sizes < 0) | (offsets > tar_bytes - sizes)
    if outside.any():
        sample, field = (int(i) for i in np.argwhere(outside)[0])
        offset, size = spans[sample, field].tolist()
        raise ShardError(
            f"{where}: sample {keys[sample]!r} field {fields[field]!r}: the sidecar puts the "
            f"member at offset {offset} ({size} bytes), outside the tar's {tar_bytes} bytes; "
            "the offsets sidecar is damaged")


def _member_kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return "symbolic link"
    if member.islnk():
        return "hard link"
    if member.ischr():
        return "character device"
    if member.isblk():
        return "block device"
    if member.isfifo():
        return "fifo"
    return f"member of type {member.type!r}"


def _check_member(tar_name: str, member: tarfile.TarInfo) -> None:
    safe_relative_path(member.name, what=f"{tar_name}: tar member {member.name!r}")
    if not (member.isreg() or member.isdir()):
        raise ShardError(
            f"{tar_name}: tar member {member.name!r} is a {_member_kind(member)}; "
            "only regular files (and directories, skipped) may appear in a shard"
        )


def scan_tar(path: str, *, name: str | None = None) -> TarOffsets:
    """Build the member table of the local tar at `path` by walking its headers.

    Raises ShardError (naming `name`, default `path`) for a truncated or corrupt tar, a
    duplicate field within a sample, and UnsafePathError for unsafe member names; SchemaError
    when samples hold different fields.
    """
    name = name or path
    size = os.path.getsize(path)
    keys: list[str] = []
    spans: list[dict[str, tuple[int, int]]] = []
    try:
        with open(path, "rb") as raw, tarfile.open(fileobj=raw, mode="r:") as tf:
            while True:
                member = tf.next()
                tf.members = []  # keep memory flat: we only need the current header
                if member is None:
                    break
                _check_member(name, member)
                if not member.isreg() or META_RE.match(member.name):
                    continue
                split = split_member_name(member.name)
                if split is None:
                    continue
                key, field = split
                if not field:
                    raise ShardError(f"{name}: tar member {member.name!r} has an empty extension")
                if not keys or keys[-1] != key:
                    keys.append(key)
                    spans.append({})
                elif field in spans[-1]:
                    raise ShardError(
                        f"{name}: tar member {member.name!r} repeats field {field!r} of sample {key!r}"
                    )
                spans[-1][field] = (member.offset_data, member.size)
            end = tf.offset
            raw.seek(end)
            trailer = raw.read(BLOCK)
    except tarfile.TarError as e:
        raise ShardError(f"{name}: not a readable tar file (truncated or corrupt?): {e}") from None
    if len(trailer) < BLOCK:
        raise ShardError(
            f"{name}: tar ends at byte {size} without the end-of-archive marker (truncated?)"
        )
    if trailer.count(0) != BLOCK:
        raise ShardError(f"{name}: invalid tar header at byte {end} (corrupt?)")
    fields = tuple(spans[0]) if spans else ()
    for key, sample in zip(keys, spans):
        if sample.keys() != set(fields):
            raise SchemaError(
                f"{name}: sample {key!r} has fields {sorted(sample)} but the first sample has "
                f"{sorted(fields)}; every sample of a shard must hold the same fields"
            )
    table = np.zeros((len(keys), len(fields), 2), dtype=np.int64)
    for i, sample in enumerate(spans):
        for j, field in enumerate(fields):
            table[i, j] = sample[field]
    return TarOffsets(keys, fields, table, size)


def offsets_entry(relative_path: str, data: bytes) -> dict[str, Any]:
    """The index entry value (under ``"offsets"``) describing sidecar bytes `data`."""
    return {"path": relative_path, "bytes": len(data), "checksum": checksum_bytes(data)}


def _load_sidecar(path: str, info: ShardEntry) -> TarOffsets | None:
    """The sidecar's table when the index describes one and the local file verifies, else None."""
    entry = info.extra.get(OFFSETS_KEY)
    local = sidecar_path(path)
    if not isinstance(entry, dict) or not os.path.exists(local):
        return None
    try:
        with open(local, "rb") as f:
            data = f.read()
        algorithm, _ = parse_checksum(str(entry.get("checksum")))
        if len(data) != entry.get("bytes") or checksum_bytes(data, algorithm) != entry["checksum"]:
            raise ShardError(f"{local}: sidecar does not match its index entry (size or checksum)")
        return TarOffsets.decode(data, where=local)
    except (ShardloaderError, ValueError, OSError) as e:
        warnings.warn(f"{e}; scanning the tar headers instead", stacklevel=3)
        return None


def load_offsets(path: str, info: ShardEntry) -> TarOffsets:
    """The member table of the tar at `path`: from its verified sidecar, else by scanning."""
    table = _load_sidecar(path, info)
    if table is None:
        table = scan_tar(path)
    if len(table) != info.samples:
        raise ShardError(f"{path}: tar holds {len(table)} samples but the index records {info.samples}")
    size = os.path.getsize(path)
    ends = table.spans[..., 0] + table.spans[..., 1]
    if table.tar_bytes != size or (ends.size and int(ends.max()) > size):
        raise ShardError(f"{path}: tar is {size} bytes, its member table expects {table.tar_bytes}")
    return table


def _open_fd(path: str, info: ShardEntry) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ShardError(f"{path}: shard file is missing (listed as {info.path!r})") from None
    except OSError as e:
        raise ShardError(f"{path}: cannot open shard ({e})") from None


class TarShardReader:
    """Row access to one WebDataset tar by `os.pread` at recorded member offsets.

    The reader holds the tar open (so a file renamed over its path does not affect it) and
    checks before and after each read that it did not change in place (ShardChangedError).
    With `expect`, the file must be the one its source verified (see `open_shard`).
    """

    def __init__(self, path: str, info: ShardEntry, schema: Mapping[str, str] | None = None, *,
                 expect: FileIdentity | None = None) -> None:
        self.path = path
        self._fd = _open_fd(path, info)
        try:
            self._guard = FileGuard(path, self._fd, expect)
            table = load_offsets(path, info)  # by path: it must still name the file held open
            self._guard.check_path()
            if schema is not None and len(table):
                check_schema({f: "binary" for f in table.fields}, schema,
                             where=f"{path}: schema differs from the index")
        except BaseException:
            self.close()
            raise
        self._table = table
        self.info: ShardEntry | None = info

    @classmethod
    def unindexed(cls, path: str) -> TarShardReader:
        """A reader of a tar no index describes: its member table comes from a header scan."""
        reader = cls.__new__(cls)
        reader.path = path
        reader._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            reader._guard = FileGuard(path, reader._fd)
            reader._table = scan_tar(path)
            reader._guard.check_path()
        except BaseException:
            reader.close()
            raise
        reader.info = None
        return reader

    @property
    def keys(self) -> list[str]:
        return self._table.keys

    @property
    def fields(self) -> tuple[str, ...]:
        return self._table.fields

    def __len__(self) -> int:
        return len(self._table)

    def read(self, row: int) -> dict[str, Any]:
        self._guard.check()
        record = self._read(row)
        self._guard.check()
        return record

    def _read(self, row: int) -> dict[str, Any]:
        n = len(self._table)
        if not -n <= row < n:
            raise IndexError(f"{self.path}: row {row} out of range for a shard of {n} rows")
        record: dict[str, Any] = {}
        for field, (offset, size) in zip(self._table.fields, self._table.spans[row].tolist()):
            data = pread_full(self._fd, size, offset)
            if len(data) != size:
                raise ShardError(
                    f"{self.path}: member {self._table.keys[row]}.{field} is truncated "
                    f"(read {len(data)} of {size} bytes at offset {offset})"
                )
            record[field] = data
        record[KEY_FIELD] = self._table.keys[row]
        return record

    def read_rows(self, rows: Sequence[int]) -> list[dict[str, Any]]:
        self._guard.check()
        records = [self._read(int(r)) for r in rows]
        self._guard.check()
        return records

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # a reader retired while another thread used it
        self.close()

    def __enter__(self) -> TarShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- by byte range -----------------------------------------------------------------------------
def range_table(data: memoryview | bytes, member_spans: np.ndarray | None) -> RangeTable:
    """The range table of a tar whose bytes are `data`, from its member spans (`TarOffsets.spans`,
    int64 [samples, fields, 2]: data offset, size): one group, and each row's spans are its
    members."""
    assert member_spans is not None
    view = memoryview(data)
    b = RangeTableBuilder(view)
    rows = [[b.span(o, s) for o, s in sample] for sample in member_spans.tolist()]
    return b.table("tar", [], [0, len(rows)], [[]], rows)


def rows_from_spans(table: RangeTable, fetched: Mapping[int, bytes], rows: Sequence[int] | np.ndarray,
                    *, where: str, members: TarOffsets | None = None) -> list[dict[str, Any]]:
    """Records of `rows` from verified spans `fetched`: the members' bytes, as `TarShardReader`
    returns them. `members` is the tar's member table (for the keys and the field order)."""
    assert members is not None
    rows = np.asarray(rows, dtype=np.int64)
    ids = table.needed(rows)
    lookup = {(o, n): fetched[i] for i, (o, n) in zip(ids.tolist(), table.spans[ids].tolist())}
    out = []
    for r in rows.tolist():
        record: dict[str, Any] = {}
        for field, (offset, size) in zip(members.fields, members.spans[r].tolist()):
            record[field] = b"" if size == 0 else bytes(lookup[(offset, size)])
        record[KEY_FIELD] = members.keys[r]
        out.append(record)
    return out


FORMAT_CODE = FormatCode(open_reader=TarShardReader, range_table=range_table,
                         rows_from_spans=rows_from_spans, decode_companion=TarOffsets.decode)
