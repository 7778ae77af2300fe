"""The dataset index: `index.json` at a dataset's root.

The index is the single description of a dataset that everything else trusts: which shards
exist, in which format, how many samples each holds, how large each file is and what it hashes
to. Samples are numbered `0..N-1` in shard order then row order (write order). The index's
fingerprint (a hash of its canonical JSON) goes into loader state, so a changed dataset is
detected on resume.

Format (version 1)::

    {
      "format": "shardloader-index",
      "version": 1,
      "schema": {"image": "binary", "label": "int64"},      # field -> type name
      "shards": [
        {"path": "shard-00000.arrow", "format": "arrow", "samples": 512,
         "bytes": 6291456, "checksum": "xxh3_128:9f...", ...format-specific keys...},
        ...
      ]
    }

Format-specific keys are kept in `ShardInfo.extra` (e.g. a tar shard's member-offset sidecar).

A large index may instead keep its shards in an Arrow table beside it (``shard_table`` in place
of ``shards``; `shardloader.format.index_table`, read by `shardloader.source.index.load_index`).

In memory an `Index` holds its shards as columns (numpy arrays and a few byte buffers; see
`shardloader.format.index_columns`), not one `ShardInfo` per shard: the writer's entries cost 70-90 bytes
per shard (10^6 shards: ~80 MB, against ~1.4 GB as ShardInfos), held by a few dozen objects
that forked workers share copy-on-write. `Index.shards` is a sequence that builds each
`ShardInfo` when asked for; `sample_offsets`, `shard_samples`, `shard_bytes`, `formats` and
`empty_shards()` answer for all shards without building any. Parsing validates each field in
one pass over all entries when every entry is plain (the common case), and falls back to the
entry-by-entry checks otherwise, so a damaged entry is named exactly as before.

Counts are bounded: a shard's ``samples``, and their sum over the shards, at most `MAX_SAMPLES`
(2**48, about 2.8e14: 50,000 times the largest public datasets); a larger count is damage, and
would overflow the int64 arithmetic on sample positions. A shard's ``bytes``: at most
`MAX_SHARD_BYTES` (2**62). A shard whose count is wrong but within the bound is found when it
is opened (its reader compares the count with the file's).
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, overload

import numpy as np

from shardloader.errors import DatasetIndexError, UnsafePathError
from shardloader.format.index_columns import ShardColumns, hex_digests
from shardloader.format.registry import FORMATS
from shardloader.io.checksum import parse_checksum
from shardloader.io.jsondata import parse_json
from shardloader.io.paths import safe_relative_path

INDEX_NAME = "index.json"
INDEX_FORMAT = "shardloader-index"
INDEX_VERSION = 1
_REQUIRED_SHARD_KEYS = ("path", "format", "samples", "bytes", "checksum")
#: The most samples a shard, or a whole dataset, may have (see the module doc).
MAX_SAMPLES = 2**48
#: The most bytes a shard file may have.
MAX_SHARD_BYTES = 2**62
_DAMAGED = "the index is damaged; rebuild it (`shardloader index` indexes tar and Parquet files in place)"


@dataclass(frozen=True)
class ShardInfo:
    """One shard's entry in the index."""

    path: str  # relative to the dataset root, validated
    format: str  # a name in `shardloader.format.registry.FORMATS`
    samples: int
    bytes: int
    checksum: str  # "algorithm:hexdigest"
    extra: Mapping[str, Any] = field(default_factory=dict)

    # A ShardInfo that an `Index` builds on demand gets its `checksum` and `extra` when they are
    # first read (most callers read only `path` and `samples`): until then its `_pending` is
    # (columns, shard id). Equality, repr, pickling and copies read them, so they all see the
    # full entry; a pickled ShardInfo never carries the index with it.
    def __getattr__(self, name: str) -> Any:
        pending = self.__dict__.get("_pending")
        if pending is None or name not in ("checksum", "extra"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        columns, shard = pending
        self.__dict__["checksum"] = columns.checksums.get(shard, shard)
        self.__dict__["extra"] = {} if columns.extra is None else columns.extra.get(shard, shard)
        del self.__dict__["_pending"]
        return self.__dict__[name]

    def __getstate__(self) -> dict[str, Any]:
        if "_pending" in self.__dict__:
            self.__getattr__("extra")
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def to_json(self) -> dict[str, Any]:
        out = {
            "path": self.path,
            "format": self.format,
            "samples": self.samples,
            "bytes": self.bytes,
            "checksum": self.checksum,
        }
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, entry: Any, *, where: str) -> ShardInfo:
        if not isinstance(entry, dict):
            raise DatasetIndexError(f"{where}: shard entry must be an object, got {type(entry).__name__}")
        missing = [k for k in _REQUIRED_SHARD_KEYS if k not in entry]
        if missing:
            raise DatasetIndexError(f"{where}: shard entry lacks {', '.join(missing)}")
        try:
            path = safe_relative_path(entry["path"], what=where)
        except UnsafePathError as e:
            raise UnsafePathError(f"{e} (in the index)") from None
        fmt = entry["format"]
        if not isinstance(fmt, str) or fmt not in FORMATS:
            raise DatasetIndexError(f"{where}: unknown shard format {fmt!r} (known: {', '.join(FORMATS)})")
        for key, bound, name in (("samples", MAX_SAMPLES, "MAX_SAMPLES"),
                                 ("bytes", MAX_SHARD_BYTES, "MAX_SHARD_BYTES")):
            value = entry[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DatasetIndexError(f"{where}: field {key!r} must be a non-negative integer, got {value!r}")
            if value > bound:
                raise DatasetIndexError(
                    f"{where}: field {key!r} is {value}, more than the {bound} any shard may hold "
                    f"(shardloader.format.index.{name}): {_DAMAGED}")
        if not isinstance(entry["checksum"], str):
            raise DatasetIndexError(f"{where}: field 'checksum' must be a string")
        try:
            parse_checksum(entry["checksum"])
        except ValueError as e:
            raise DatasetIndexError(f"{where}: {e}") from None
        extra = {k: v for k, v in entry.items() if k not in _REQUIRED_SHARD_KEYS}
        return cls(path, fmt, entry["samples"], entry["bytes"], entry["checksum"], extra)


# -- columns (see shardloader.format.index_columns) --------------------------------------------
_HEX_CHECKSUM = re.compile(r"([a-z0-9_]+):([0-9a-f]+)")
#: Relative paths that `safe_relative_path` accepts unchanged (plain names joined by "/", none
#: of them "." or ".."), one per line: all paths are checked in one match; an index with any
#: other path has each go through `safe_relative_path`.
_PLAIN_NAME = r"(?!\.\.?(?:/|\n|\Z))[A-Za-z0-9_.+,=@~-]+"
_PLAIN_PATH = rf"{_PLAIN_NAME}(?:/{_PLAIN_NAME})*"
_PLAIN_PATHS = re.compile(rf"{_PLAIN_PATH}(?:\n{_PLAIN_PATH})*")


def _shard_info(columns: ShardColumns, i: int) -> ShardInfo:
    """Shard i's entry (its checksum and extras are decoded when first read)."""
    info = object.__new__(ShardInfo)
    d = info.__dict__
    d["path"] = columns.paths.get(i, i)
    d["format"] = columns.format_names[columns.formats[i]]
    d["samples"] = int(columns.samples[i])
    d["bytes"] = int(columns.sizes[i])
    d["_pending"] = (columns, i)
    return info


class ShardList(Sequence[ShardInfo]):
    """The index's shards as a read-only sequence of `ShardInfo`, each built when asked for.

    Behaves like the tuple the index used to hold: `len`, indexing (negative too), slices
    (tuples), iteration, `in`, and equality with any sequence of the same ShardInfos.
    """

    __slots__ = ("_columns",)

    def __init__(self, columns: ShardColumns) -> None:
        self._columns = columns

    def __len__(self) -> int:
        return self._columns.count

    @overload
    def __getitem__(self, i: int) -> ShardInfo: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[ShardInfo, ...]: ...

    def __getitem__(self, i: int | slice) -> ShardInfo | tuple[ShardInfo, ...]:
        if isinstance(i, slice):
            return tuple(_shard_info(self._columns, k) for k in range(*i.indices(self._columns.count)))
        k = operator.index(i)
        n = self._columns.count
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(f"shard {i} is out of range for an index of {n} shards")
        return _shard_info(self._columns, k)

    def __iter__(self) -> Iterator[ShardInfo]:
        columns = self._columns
        return (_shard_info(columns, k) for k in range(columns.count))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Sequence[ShardInfo]) -> tuple[ShardInfo, ...]:
        return tuple(self) + tuple(other)

    def __radd__(self, other: Sequence[ShardInfo]) -> tuple[ShardInfo, ...]:
        return tuple(other) + tuple(self)

    def __repr__(self) -> str:
        return f"ShardList({len(self)} shards)"


def _fast_columns(shards_json: list[Any]) -> ShardColumns | None:
    """Columns straight from parsed entries when every entry is plainly valid (the checks of
    `ShardInfo.from_json`, one pass per field); None when any entry needs the entry-by-entry
    validation, which then names the first bad entry as it always did."""
    if set(map(type, shards_json)) - {dict}:
        return None
    try:
        paths, formats, samples, sizes, checksums = (list(map(operator.itemgetter(key), shards_json))
                                                     for key in _REQUIRED_SHARD_KEYS)
    except KeyError:
        return None
    if not shards_json:
        return ShardColumns([], [], [], [], [], [])
    if set(map(type, paths)) != {str}:
        return None
    joined = "\n".join(paths)  # one match for all paths; a path holding "\n" counts apart
    if joined.count("\n") != len(paths) - 1 or not _PLAIN_PATHS.fullmatch(joined):
        return None
    if set(map(type, formats)) != {str} or not set(formats) <= FORMATS.keys():
        return None
    for values, bound in ((samples, MAX_SAMPLES), (sizes, MAX_SHARD_BYTES)):
        if set(map(type, values)) != {int} or min(values) < 0 or max(values) > bound:
            return None
    if set(map(type, checksums)) != {str}:
        return None
    digests = hex_digests(checksums)
    algorithms = ({digests[0][:-1]} if digests is not None else
                  {m.group(1) if m else None for m in map(_HEX_CHECKSUM.fullmatch, checksums)})
    for algorithm in algorithms:
        try:
            parse_checksum(f"{algorithm}:00")
        except ValueError:
            return None
    return ShardColumns(paths, formats, samples, sizes, checksums, shards_json, frozenset(_REQUIRED_SHARD_KEYS))


def _columns_of(shards: Sequence[ShardInfo]) -> ShardColumns:
    return ShardColumns([s.path for s in shards], [s.format for s in shards], [s.samples for s in shards],
                         [s.bytes for s in shards], [s.checksum for s in shards],
                         [dict(s.extra) for s in shards])


class Index:
    """A validated dataset index. Immutable; cheap to pickle into worker processes.

    Held as columns (see `ShardColumns`): about a hundred bytes per shard, in a few numpy
    arrays and buffers that forked workers share. `shards` gives `ShardInfo`s on demand;
    `sample_offsets`, `shard_samples`, `shard_bytes`, `formats` and `empty_shards` answer
    for all shards at once without building any.
    """

    __slots__ = ("schema", "version", "_columns", "__dict__")

    def __init__(self, schema: Mapping[str, str], shards: Sequence[ShardInfo] = (),
                 version: int = INDEX_VERSION, *, _columns: ShardColumns | None = None) -> None:
        object.__setattr__(self, "schema", dict(schema))
        object.__setattr__(self, "version", version)
        object.__setattr__(self, "_columns", _columns if _columns is not None else _columns_of(tuple(shards)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Index is immutable (cannot set {name!r})")

    def __getstate__(self) -> dict[str, Any]:
        state = {"schema": self.schema, "version": self.version, "columns": self._columns}
        if "fingerprint" in self.__dict__:  # a spawned worker would otherwise recompute it
            state["fingerprint"] = self.__dict__["fingerprint"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "schema", state["schema"])
        object.__setattr__(self, "version", state["version"])
        object.__setattr__(self, "_columns", state["columns"])
        if "fingerprint" in state:
            self.__dict__["fingerprint"] = state["fingerprint"]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Index):
            return NotImplemented
        return self.schema == other.schema and self.version == other.version and self.shards == other.shards

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Index(schema={self.schema!r}, shards={self.num_shards}, version={self.version})"

    @property
    def shards(self) -> ShardList:
        """The shards in index order, as `ShardInfo`s built on demand."""
        return ShardList(self._columns)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_json(cls, data: Any, *, source: str = INDEX_NAME, shard_columns: ShardColumns | None = None) -> Index:
        """Validate a parsed `index.json`; `source` names the file in error messages.

        An index in the table form (``shard_table`` instead of ``shards``, see
        `shardloader.format.index_table`) needs its table's columns as `shard_columns`, read and
        validated by `index_table.read_table` (`shardloader.source.index.load_index` does both)."""
        if not isinstance(data, dict):
            raise DatasetIndexError(f"{source}: top level must be a JSON object")
        if data.get("format") != INDEX_FORMAT:
            raise DatasetIndexError(
                f"{source}: not a shardloader index (format field is {data.get('format')!r}, "
                f"expected {INDEX_FORMAT!r})"
            )
        version = data.get("version")
        if version != INDEX_VERSION:
            raise DatasetIndexError(
                f"{source}: index version {version!r} is not supported (this shardloader reads "
                f"version {INDEX_VERSION})"
            )
        schema = data.get("schema")
        if not isinstance(schema, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in schema.items()
        ):
            raise DatasetIndexError(f"{source}: 'schema' must map field names to type names")
        if "shard_table" in data and "shards" not in data:
            return cls._from_table(data, schema, source, shard_columns)
        shards_json = data.get("shards")
        if not isinstance(shards_json, list):
            raise DatasetIndexError(f"{source}: 'shards' must be a list")
        columns = _fast_columns(shards_json)
        paths: Sequence[str]
        if columns is None:  # entry by entry: the first bad entry is named
            shards = tuple(
                ShardInfo.from_json(entry, where=f"{source}: shards[{i}]")
                for i, entry in enumerate(shards_json)
            )
            paths = [s.path for s in shards]
            total = sum(s.samples for s in shards)
        else:
            shards = ()
            paths = [e["path"] for e in shards_json]
            total = int(columns.samples.sum(dtype=np.int64)) if columns.count else 0
        if len(set(paths)) != len(paths):
            seen: dict[str, int] = {}
            for i, path in enumerate(paths):
                if path in seen:
                    raise DatasetIndexError(
                        f"{source}: shards[{i}] repeats path {path!r} (also shards[{seen[path]}])"
                    )
                seen[path] = i
        if total > MAX_SAMPLES:
            raise DatasetIndexError(
                f"{source}: the shards' 'samples' fields add up to {total}, more than the "
                f"{MAX_SAMPLES} a dataset may hold (shardloader.format.index.MAX_SAMPLES): "
                f"{_DAMAGED}")
        index = cls(schema=dict(schema), version=version,
                    _columns=columns if columns is not None else _columns_of(shards))
        if columns is not None and data.keys() == {"format", "version", "schema", "shards"}:
            # The parsed document is the canonical one (paths already normal, no other keys):
            # its fingerprint costs one C-speed dump now instead of one ShardInfo per shard later.
            index.__dict__["fingerprint"] = _fingerprint_of(data)
        return index

    @classmethod
    def _from_table(cls, data: dict[str, Any], schema: dict[str, str], source: str,
                    columns: ShardColumns | None) -> Index:
        if columns is None:
            raise DatasetIndexError(f"{source}: the index keeps its shards in a table file "
                                    f"({data['shard_table']!r}); open it with "
                                    "shardloader.source.index.load_index")
        extra = data.keys() - {"format", "version", "schema", "shard_table"}
        if extra:
            raise DatasetIndexError(f"{source}: unexpected keys {sorted(extra)} beside 'shard_table'")
        index = cls(schema=dict(schema), version=data["version"], _columns=columns)
        # O(1): the document names the table by its checksum, so it stands for every shard.
        index.__dict__["fingerprint"] = _fingerprint_of(data)
        return index

    @classmethod
    def loads(cls, text: str | bytes, *, source: str = INDEX_NAME) -> Index:
        data = parse_json(text, what=source, error=DatasetIndexError)
        return cls.from_json(data, source=source)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": INDEX_FORMAT,
            "version": self.version,
            "schema": dict(self.schema),
            "shards": [s.to_json() for s in self.shards],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True, ensure_ascii=False) + "\n"

    # -- derived facts ------------------------------------------------------------------------
    @cached_property
    def fingerprint(self) -> str:
        """Hash of the canonical JSON: changes whenever any shard, count, checksum or field does."""
        return _fingerprint_of(self.to_json())

    @cached_property
    def sample_offsets(self) -> np.ndarray:
        """int64 array of length S+1: shard s holds global samples offsets[s] .. offsets[s+1]-1."""
        offsets = np.zeros(self._columns.count + 1, dtype=np.int64)
        np.cumsum(self._columns.samples, dtype=np.int64, out=offsets[1:])
        offsets.flags.writeable = False
        return offsets

    @property
    def shard_samples(self) -> np.ndarray:
        """Each shard's sample count (read-only int64 array, one per shard)."""
        view = self._columns.samples.view()
        view.flags.writeable = False
        return view

    @property
    def shard_bytes(self) -> np.ndarray:
        """Each shard's file size in bytes (read-only int64 array, one per shard)."""
        view = self._columns.sizes.view()
        view.flags.writeable = False
        return view

    @property
    def formats(self) -> tuple[str, ...]:
        """The shard formats the index uses, each once, in order of first use."""
        # (np.bincount, not np.unique: that imports numpy.ma, which workers should not pay for)
        used = np.bincount(self._columns.formats, minlength=len(self._columns.format_names)) > 0
        return tuple(name for name, u in zip(self._columns.format_names, used) if u)

    def empty_shards(self) -> np.ndarray:
        """Ids of the shards the index lists with 0 samples."""
        return np.flatnonzero(self._columns.samples == 0)

    @property
    def nbytes(self) -> int:
        """Bytes held by the index's columns (what it costs per process, shared under fork)."""
        return self._columns.nbytes

    @property
    def num_samples(self) -> int:
        return int(self.sample_offsets[-1])

    @property
    def num_shards(self) -> int:
        return self._columns.count

    @property
    def total_bytes(self) -> int:
        return int(self._columns.sizes.sum(dtype=np.int64)) if self._columns.count else 0

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard id, row in shard) of global sample index `sample`."""
        n = self.num_samples
        if not 0 <= sample < n:
            raise IndexError(f"sample index {sample} is out of range for a dataset of {n} samples")
        # The last shard whose first sample is <= `sample`: empty shards sharing that offset
        # come before it, so they are skipped.
        shard = int(np.searchsorted(self.sample_offsets, sample, side="right")) - 1
        return shard, sample - int(self.sample_offsets[shard])

    def locate_many(self, samples: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised `locate`: arrays of shard ids and rows."""
        samples = np.asarray(samples, dtype=np.int64)
        if samples.size and (samples.min() < 0 or samples.max() >= self.num_samples):
            raise IndexError(f"sample indices out of range for a dataset of {self.num_samples} samples")
        shards = np.searchsorted(self.sample_offsets, samples, side="right") - 1
        return shards, samples - self.sample_offsets[shards]


def _fingerprint_of(document: Mapping[str, Any]) -> str:
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()
