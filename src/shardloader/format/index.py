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

Counts are bounded: a shard's ``samples``, and their sum over the shards, at most `MAX_SAMPLES`
(2**48, about 2.8e14: 50,000 times the largest public datasets); a larger count is damage, and
would overflow the int64 arithmetic on sample positions. A shard's ``bytes``: at most
`MAX_SHARD_BYTES` (2**62). A shard whose count is wrong but within the bound is found when it
is opened (its reader compares the count with the file's).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from shardloader.errors import DatasetIndexError, UnsafePathError
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


@dataclass(frozen=True)
class Index:
    """A validated dataset index. Immutable; cheap to pickle into worker processes."""

    schema: Mapping[str, str]
    shards: tuple[ShardInfo, ...]
    version: int = INDEX_VERSION

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_json(cls, data: Any, *, source: str = INDEX_NAME) -> Index:
        """Validate a parsed `index.json`; `source` names the file in error messages."""
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
        shards_json = data.get("shards")
        if not isinstance(shards_json, list):
            raise DatasetIndexError(f"{source}: 'shards' must be a list")
        shards = tuple(
            ShardInfo.from_json(entry, where=f"{source}: shards[{i}]")
            for i, entry in enumerate(shards_json)
        )
        seen: dict[str, int] = {}
        for i, shard in enumerate(shards):
            if shard.path in seen:
                raise DatasetIndexError(
                    f"{source}: shards[{i}] repeats path {shard.path!r} (also shards[{seen[shard.path]}])"
                )
            seen[shard.path] = i
        total = sum(shard.samples for shard in shards)
        if total > MAX_SAMPLES:
            raise DatasetIndexError(
                f"{source}: the shards' 'samples' fields add up to {total}, more than the "
                f"{MAX_SAMPLES} a dataset may hold (shardloader.format.index.MAX_SAMPLES): "
                f"{_DAMAGED}")
        return cls(schema=dict(schema), shards=shards, version=version)

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
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()

    @cached_property
    def sample_offsets(self) -> np.ndarray:
        """int64 array of length S+1: shard s holds global samples offsets[s] .. offsets[s+1]-1."""
        counts = np.fromiter((s.samples for s in self.shards), dtype=np.int64, count=len(self.shards))
        return np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(counts, dtype=np.int64)])

    @property
    def num_samples(self) -> int:
        return int(self.sample_offsets[-1])

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard id, row in shard) of global sample index `sample`."""
        n = self.num_samples
        if not 0 <= sample < n:
            raise IndexError(f"sample index {sample} is out of range for a dataset of {n} samples")
        shard = bisect.bisect_right(self.sample_offsets, sample) - 1
        # Skip empty shards that share the same offset.
        while self.shards[shard].samples == 0:
            shard += 1
        return shard, sample - int(self.sample_offsets[shard])

    def locate_many(self, samples: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised `locate`: arrays of shard ids and rows."""
        samples = np.asarray(samples, dtype=np.int64)
        if samples.size and (samples.min() < 0 or samples.max() >= self.num_samples):
            raise IndexError(f"sample indices out of range for a dataset of {self.num_samples} samples")
        shards = np.searchsorted(self.sample_offsets, samples, side="right") - 1
        return shards, samples - self.sample_offsets[shards]
