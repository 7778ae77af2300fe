"""WebDataset tar shards: read in place by seeking to member offsets, and written.

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
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
import tarfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from shardloader.errors import SchemaError, ShardError, ShardloaderError
from shardloader.format.checksum import checksum_bytes, parse_checksum
from shardloader.format.identity import FileGuard, FileIdentity
from shardloader.format.index import ShardInfo
from shardloader.format.paths import safe_relative_path
from shardloader.format.rows import check_schema

KEY_FIELD = "__key__"
SIDECAR_SUFFIX = ".idx"
OFFSETS_KEY = "offsets"  # the shard index entry's key describing the sidecar
_SIDECAR_MAGIC = b"SLTIDX1\n"
_BLOCK = 512
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext rule
_META_RE = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta rule


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
            header = json.loads(data[prefix:prefix + header_len])
            fields, keys = tuple(header["fields"]), list(header["keys"])
            samples, tar_bytes = int(header["samples"]), int(header["tar_bytes"])
        except (ValueError, KeyError, TypeError) as e:
            raise ShardError(f"{where}: malformed sidecar header ({e})") from None
        body = data[prefix + header_len:]
        if samples != len(keys) or len(body) != samples * len(fields) * 16:
            raise ShardError(f"{where}: sidecar is truncated or inconsistent")
        spans = np.frombuffer(body, dtype="<i8").reshape(samples, len(fields), 2).astype(np.int64)
        return cls(keys, fields, spans, tar_bytes)


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
                if not member.isreg() or _META_RE.match(member.name):
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
            trailer = raw.read(_BLOCK)
    except tarfile.TarError as e:
        raise ShardError(f"{name}: not a readable tar file (truncated or corrupt?): {e}") from None
    if len(trailer) < _BLOCK:
        raise ShardError(
            f"{name}: tar ends at byte {size} without the end-of-archive marker (truncated?)"
        )
    if trailer.count(0) != _BLOCK:
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


def _load_sidecar(path: str, info: ShardInfo) -> TarOffsets | None:
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


def load_offsets(path: str, info: ShardInfo) -> TarOffsets:
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


def _open_fd(path: str, info: ShardInfo) -> int:
    try:
        return os.open(path, os.O_RDONLY)
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

    def __init__(self, path: str, info: ShardInfo, schema: Mapping[str, str] | None = None, *,
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
        self.info: ShardInfo | None = info

    @classmethod
    def unindexed(cls, path: str) -> TarShardReader:
        """A reader of a tar no index describes: its member table comes from a header scan."""
        reader = cls.__new__(cls)
        reader.path = path
        reader._fd = os.open(path, os.O_RDONLY)
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
            data = os.pread(self._fd, size, offset)
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


# -- writing -----------------------------------------------------------------------------------
def encode_value(value: Any) -> bytes:
    """The bytes a tar member stores for a field value.

    bytes-like values as they are; str as UTF-8; bool/int/float as their decimal text (as
    webdataset's ``.cls`` convention); numpy arrays in ``.npy`` format.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, np.ndarray):
        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        return buf.getvalue()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (bool, int, float)):
        return repr(value).encode()
    raise SchemaError(f"cannot store a {type(value).__name__} in a tar member")


def check_tar_key(key: Any) -> str:
    """Validate a sample key for a tar: a safe relative path whose basename has no dot."""
    if not isinstance(key, str):
        raise SchemaError(f"__key__ must be a string, got {type(key).__name__}")
    safe_relative_path(key, what="__key__")
    base = key.rsplit("/", 1)[-1]
    if not base or "." in base:
        raise SchemaError(f"__key__ {key!r}: its last component must be non-empty and hold no dot")
    if _META_RE.match(key):
        raise SchemaError(f"__key__ {key!r}: names starting with __...__ are skipped by readers")
    return key


def check_tar_field(field: str) -> str:
    """Validate a field name for a tar: non-empty, lowercase (readers lowercase), no slash."""
    if not field or field != field.lower() or "/" in field:
        raise SchemaError(
            f"field {field!r} cannot be a tar member extension (it must be non-empty, lowercase "
            "and hold no '/')"
        )
    return field


class TarShardWriter:
    """Writes samples as a WebDataset tar (`webdataset.WebDataset` reads it).

    Each sample needs a ``__key__``; every other field (names not of the form ``__*__``)
    becomes a member ``<key>.<field>`` holding `encode_value(value)`. Members get mtime 0,
    mode 0444 and no owner, so equal samples give equal bytes. Every sample must hold the same
    fields (as readers require). The member table is recorded while writing, so `offsets()`
    gives the sidecar's content without scanning the finished tar.
    """

    def __init__(self, path_or_fileobj: str | BinaryIO) -> None:
        if isinstance(path_or_fileobj, str):
            self._tar = tarfile.open(path_or_fileobj, "w", format=tarfile.PAX_FORMAT)
        else:
            self._tar = tarfile.open(fileobj=path_or_fileobj, mode="w", format=tarfile.PAX_FORMAT)
        self._keys: list[str] = []
        self._fields: tuple[str, ...] | None = None
        self._spans: list[list[tuple[int, int]]] = []
        self._closed = False

    @property
    def samples(self) -> int:
        return len(self._keys)

    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample; a sample that fails validation writes nothing."""
        key = check_tar_key(sample.get(KEY_FIELD))
        if self._keys and key == self._keys[-1]:
            raise SchemaError(f"__key__ {key!r} repeats the previous sample's key; readers would merge them")
        members = {
            check_tar_field(field): encode_value(value)
            for field, value in sample.items()
            if not (field.startswith("__") and field.endswith("__"))
        }
        if self._fields is None:
            self._fields = tuple(members)
        elif members.keys() != set(self._fields):
            raise SchemaError(
                f"sample {key!r} has fields {sorted(members)} but the first sample has "
                f"{sorted(self._fields)}; every sample of a shard must hold the same fields"
            )
        spans = {}
        for field, data in members.items():
            member = tarfile.TarInfo(f"{key}.{field}")
            member.size = len(data)
            member.mtime = 0
            member.mode = 0o444
            self._tar.addfile(member, io.BytesIO(data))
            # addfile leaves `offset` after the data, padded to whole blocks.
            spans[field] = (self._tar.offset - _padded(len(data)), len(data))
        self._tar.members = []  # tarfile keeps every TarInfo otherwise; we never look back
        self._keys.append(key)
        self._spans.append([spans[field] for field in self._fields])

    def close(self) -> None:
        if not self._closed:
            self._tar.close()
            self._closed = True

    def offsets(self, tar_bytes: int) -> TarOffsets:
        """The member table of the closed tar, whose size is `tar_bytes`."""
        if not self._closed:
            raise RuntimeError("close the TarShardWriter before asking for its offsets")
        table = np.array(self._spans, dtype=np.int64).reshape(len(self._keys), len(self._fields or ()), 2)
        return TarOffsets(list(self._keys), self._fields or (), table, tar_bytes)

    def __enter__(self) -> TarShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK
