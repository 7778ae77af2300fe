"""Decoding WebDataset tar members by their extension, as webdataset users expect.

A tar shard stores every field as bytes; webdataset's default decoders turn the conventional
extensions into Python values, and `Dataset` does the same for tar shards (`decode=True`):

- ``cls cls2 class count index inx id`` -> ``int`` (decimal text, surrounding whitespace ignored)
- ``txt text transcript`` -> ``str`` (UTF-8)
- ``json jsn`` -> the parsed JSON value (``io.jsondata.parse_json``: data only, nesting bounded)
- ``npy`` -> ``numpy.ndarray`` (``numpy.load`` with ``allow_pickle=False``), once its header's
  shape and dtype are checked against the bytes that follow it: a member that declares more
  (a few bytes claiming 8 TiB) is refused before anything is allocated

The extension is the part of the field name after its last dot (``seg.txt`` is text), as in
webdataset. Everything else stays bytes: images (jpg, png, ...) go to the transforms
(`DecodeImage`, `DecodeCropFlip`) undecoded, and formats that can run code when loaded
(``pyd``/``pickle``, ``pth``) are never decoded (invariant I12: stored bytes are data).

Decoding is a pure function of the bytes, so it keeps resume exact. A member that does not
parse as its extension says is a `FieldDecodeError` naming the shard, sample key and field.
`decode=False` gives raw bytes; a collection of field names decodes only those fields.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

from shardloader.errors import ShardError
from shardloader.io.jsondata import parse_json


class FieldDecodeError(ShardError):
    """A tar member's bytes do not parse as its extension says (e.g. a ``.cls`` that is not
    an integer)."""


def _int(data: bytes) -> int:
    text = data.decode("ascii").strip()
    return int(text)


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _json(data: bytes) -> Any:
    return parse_json(data, what="the member")  # a ValueError, named with the sample below


def _npy(data: bytes) -> np.ndarray:
    stream = io.BytesIO(data)
    fmt = np.lib.format
    version = fmt.read_magic(stream)  # a ValueError when it is not .npy
    # Version 3.0 is laid out as 2.0 (its header text is UTF-8, read here as Latin-1: only
    # structured field names could differ, and they do not change the size).
    read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
    shape, _, dtype = read_header(stream)
    if any(d < 0 for d in shape):
        raise ValueError(f"its header declares the negative shape {shape}")
    if not dtype.hasobject:  # object arrays: np.load refuses them (allow_pickle=False)
        need, have = math.prod(shape) * dtype.itemsize, len(data) - stream.tell()
        if need > have:
            raise ValueError(f"its header declares shape {shape} of {dtype}, {need:,} bytes, "
                             f"but only {have:,} bytes follow the header")
    stream.seek(0)
    return np.load(stream, allow_pickle=False)


_DECODERS: dict[str, tuple[str, Callable[[bytes], Any]]] = {}
for _ext in ("cls", "cls2", "class", "count", "index", "inx", "id"):
    _DECODERS[_ext] = ("a decimal integer", _int)
for _ext in ("txt", "text", "transcript"):
    _DECODERS[_ext] = ("UTF-8 text", _text)
for _ext in ("json", "jsn"):
    _DECODERS[_ext] = ("JSON", _json)
_DECODERS["npy"] = ("a .npy array (without pickled objects)", _npy)

DECODED_EXTENSIONS = tuple(_DECODERS)
# Extensions whose decoded values are scalars every sample stores alike (int64, string):
# what `convert` decodes when it writes tars into typed Arrow shards.
SCALAR_EXTENSIONS = tuple(e for e, (_, fn) in _DECODERS.items() if fn in (_int, _text))


def extension(field: str) -> str:
    """The extension that decides how `field` decodes: the part after its last dot."""
    return field.rsplit(".", 1)[-1]


def decoded_fields(fields: Collection[str], decode: bool | Collection[str]) -> dict[str, str]:
    """Field -> extension of the `fields` that `decode` selects and that have a decoder.

    `decode`: True (every conventional field), False (none), or field names to decode (each
    must be one of `fields`, else ValueError naming it).
    """
    if decode is True:
        chosen = list(fields)
    elif decode is False:
        return {}
    else:
        if isinstance(decode, str):
            raise TypeError("decode must be True, False or a collection of field names, not a str")
        chosen = list(decode)
        unknown = [f for f in chosen if f not in fields]
        if unknown:
            raise ValueError(f"decode names fields {unknown} that the dataset does not have "
                             f"(fields: {sorted(fields)})")
    return {f: extension(f) for f in chosen if extension(f) in _DECODERS}


def scalar_fields(fields: Collection[str]) -> list[str]:
    """The `fields` whose extension decodes to an int or a str (see SCALAR_EXTENSIONS)."""
    return [f for f in fields if extension(f) in SCALAR_EXTENSIONS]


def decode_record(record: dict[str, Any], fields: Mapping[str, str], *, where: str) -> dict[str, Any]:
    """`record` with each field of `fields` (field -> extension) decoded in place; returns it.

    `where` names the shard for errors. Values that are not bytes (already decoded) are left.
    """
    for field, ext in fields.items():
        value = record.get(field)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            continue
        what, decoder = _DECODERS[ext]
        try:
            record[field] = decoder(bytes(value))
        except (ValueError, EOFError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            head = bytes(value[:40])
            raise FieldDecodeError(
                f"{where}: sample {record.get('__key__')!r} field {field!r}: {len(value)} bytes "
                f"(starting {head!r}) are not {what} as .{ext} members hold ({e}); pass "
                "decode=False (or a list of the fields to decode) to read raw bytes"
            ) from None
    return record
