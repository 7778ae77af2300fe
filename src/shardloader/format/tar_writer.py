"""Writing WebDataset tars that `webdataset.WebDataset` and `shardloader.format.tar` read.

Member names follow the grouping rule the readers apply (see `shardloader.format.tar`): a
sample's key and field become the member ``<key>.<field>``, so keys must hold no dot in their
last component and fields must be lowercase. The member table is recorded while writing, so
the offsets sidecar needs no scan of the finished tar.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Mapping
from typing import Any, BinaryIO

import numpy as np

from shardloader.errors import SchemaError
from shardloader.format.tar import BLOCK, KEY_FIELD, META_RE, TarOffsets
from shardloader.io.paths import safe_relative_path


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
    if META_RE.match(key):
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
    return -(-size // BLOCK) * BLOCK
