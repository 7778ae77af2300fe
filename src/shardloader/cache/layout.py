"""Where things live in a node cache directory, and the names of cached files.

    <root>/data/<d[:2]>/<algorithm>-<digest>.<format>   whole, verified shards (content-addressed)
    <root>/data/<d[:2]>/<name><suffix>                  companion files of a shard (tar offsets)
    <root>/data/<d[:2]>/<algorithm>-<digest>.<kind>     range sidecars (`sidecars.py`), named by
                                                        their own checksum; kind: ranges, offsets
    <root>/tmp/<name>.<pid>.<token>.part               downloads in progress (never read)
    <root>/locks/<name>.lock                            per-shard download lock (flock)
    <root>/locks/<name>.spent                           bytes of a shard read by range on the
                                                        node while it is not whole (`range_spend.py`)
    <root>/locks/bookkeeping.lock                       guards sizes, reservations, eviction
    <root>/locks/pressure                               its mtime: a reader is waiting for room
    <root>/index/ledger.sqlite3                         the ledger (sqlite, `ledger.py`)

File names are built only from the checksum (algorithm from a fixed list, digest checked to be
lowercase hex) and the shard format or sidecar kind (from fixed lists): nothing taken from the
index is used as a path without validation. Shards and sidecars are both *entries* of the cache
(a file under `data/`, a ledger entry, a download lock): counted in its limit, evicted, pruned
and verified alike.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

from shardloader.cache.locks import make_private_dir
from shardloader.errors import ShardError
from shardloader.format.index import ShardInfo
from shardloader.format.ranges import RANGES_KEY
from shardloader.format.registry import FORMATS
from shardloader.io.checksum import parse_checksum

ALGORITHMS = ("xxh3_128", "blake2b")
#: Files kept next to a shard: the formats' companion sidecars (a tar's offsets).
COMPANION_SUFFIXES = tuple(f.companion.suffix for f in FORMATS.values() if f.companion is not None)
#: Sidecars a read by range needs, cached as entries of their own (see `sidecars.py`): the range
#: table of every format, and the formats' companions (a tar's offsets), by their index key.
SIDECAR_KINDS = tuple(dict.fromkeys(
    [RANGES_KEY] + [f.companion.key for f in FORMATS.values() if f.companion is not None]))
assert not set(SIDECAR_KINDS) & set(FORMATS), "a sidecar kind must not be a format's name"
_NAME = re.compile(
    r"^(?P<algorithm>" + "|".join(ALGORITHMS) + r")-(?P<digest>[0-9a-f]{16,128})"
    r"\.(?P<format>" + "|".join([*FORMATS, *SIDECAR_KINDS]) + r")$"
)
_TEMP = re.compile(r"^(?P<name>[^/]+)\.(?P<pid>\d+)\.(?P<token>[0-9a-f]+)\.part$")


def cache_name(info: ShardInfo) -> str:
    """The content-addressed file name of shard `info`, from validated parts only."""
    try:
        algorithm, digest = parse_checksum(info.checksum)
    except ValueError as e:
        raise ShardError(f"{info.path}: {e}") from None
    name = f"{algorithm}-{digest}.{info.format}"
    if not _NAME.match(name):
        raise ShardError(
            f"{info.path}: checksum {info.checksum!r} cannot name a cache file (the digest must "
            f"be 16-128 lowercase hex digits, the algorithm one of {', '.join(ALGORITHMS)})"
        )
    return name


def sidecar_name(checksum: str, kind: str) -> str:
    """The content-addressed file name of a sidecar of `kind` (one of `SIDECAR_KINDS`) whose
    index entry gives `checksum`; ValueError when that cannot name a cache file."""
    if kind not in SIDECAR_KINDS:
        raise ValueError(f"sidecar kind {kind!r} is not one of {', '.join(SIDECAR_KINDS)}")
    algorithm, digest = parse_checksum(checksum)
    name = f"{algorithm}-{digest}.{kind}"
    if not _NAME.match(name):
        raise ValueError(
            f"checksum {checksum!r} cannot name a cache file (the digest must be 16-128 "
            f"lowercase hex digits, the algorithm one of {', '.join(ALGORITHMS)})"
        )
    return name


def is_sidecar(name: str) -> bool:
    """True for the cache name of a sidecar entry (see `sidecar_name`), False for a shard's."""
    match = _NAME.match(name)
    return match is not None and match["format"] in SIDECAR_KINDS


def parse_cache_name(name: str) -> tuple[str, str] | None:
    """(checksum, format or sidecar kind) for a valid cache file name, else None."""
    match = _NAME.match(name)
    if match is None:
        return None
    return f"{match['algorithm']}:{match['digest']}", match["format"]


def temp_owner(entry: str) -> str | None:
    """The cache name a temp file `entry` in tmp/ belongs to, or None if it is not one of ours."""
    match = _TEMP.match(entry)
    if match is None or parse_cache_name(match["name"]) is None:
        return None
    return match["name"]


@dataclass(frozen=True)
class CacheLayout:
    """The directories of a cache at `root` (created owner-only) and the paths inside them."""

    root: str

    @classmethod
    def create(cls, root: str | os.PathLike[str]) -> CacheLayout:
        layout = cls(os.path.abspath(os.fspath(root)))
        for d in (layout.root, layout.data_dir, layout.tmp_dir, layout.lock_dir, layout.index_dir):
            make_private_dir(d)
        return layout

    @property
    def data_dir(self) -> str:
        return os.path.join(self.root, "data")

    @property
    def tmp_dir(self) -> str:
        return os.path.join(self.root, "tmp")

    @property
    def lock_dir(self) -> str:
        return os.path.join(self.root, "locks")

    @property
    def index_dir(self) -> str:
        return os.path.join(self.root, "index")

    @property
    def bookkeeping_lock(self) -> str:
        return os.path.join(self.lock_dir, "bookkeeping.lock")

    @property
    def pressure_file(self) -> str:
        return os.path.join(self.lock_dir, "pressure")

    def path_of(self, name: str) -> str:
        digest = name.split("-", 1)[1]
        return os.path.join(self.data_dir, digest[:2], name)

    def lock_of(self, name: str) -> str:
        return os.path.join(self.lock_dir, name + ".lock")

    def spent_of(self, name: str) -> str:
        return os.path.join(self.lock_dir, name + ".spent")

    def new_temp(self, name: str) -> str:
        return os.path.join(self.tmp_dir, f"{name}.{os.getpid()}.{secrets.token_hex(6)}.part")

    def temps_of(self, name: str) -> Iterator[str]:
        for entry in os.listdir(self.tmp_dir):
            if temp_owner(entry) == name:
                yield os.path.join(self.tmp_dir, entry)

    def data_files(self) -> Iterator[tuple[str, str]]:
        """(name, path) of every well-named entry under data/: shards and sidecars."""
        for sub in sorted(os.listdir(self.data_dir)):
            subdir = os.path.join(self.data_dir, sub)
            if not os.path.isdir(subdir) or os.path.islink(subdir):
                continue
            for name in sorted(os.listdir(subdir)):
                if parse_cache_name(name) is not None and name.split("-", 1)[1][:2] == sub:
                    yield name, os.path.join(subdir, name)

    def companion_files(self) -> Iterator[tuple[str, str]]:
        """(shard name, path) of every companion file under data/, whether its shard exists."""
        for sub in sorted(os.listdir(self.data_dir)):
            subdir = os.path.join(self.data_dir, sub)
            if not os.path.isdir(subdir) or os.path.islink(subdir):
                continue
            for entry in sorted(os.listdir(subdir)):
                for suffix in COMPANION_SUFFIXES:
                    main = entry[: -len(suffix)]
                    if entry.endswith(suffix) and parse_cache_name(main) is not None:
                        yield main, os.path.join(subdir, entry)
