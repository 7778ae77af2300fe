"""`LocalSource`: the shards of a local dataset directory, read in place and verified.

A source turns a shard's index entry into a local file path that is whole and verified (the
contract: `shardloader.source.protocol`). The local source reads in place (never copies, never
deletes); the remote source (`shardloader.source.remote`) downloads into the node's shard cache. Each process verifies a shard's
checksum the first time it opens it (invariant I6), so a file damaged after an earlier
verification is caught. The local source remembers the identity (inode, size, mtime, change
time) of each file it verified and verifies again whenever the file at the path has another
identity (I12): a shard rewritten during a run, even in place with its mtime put back, is
checked against the index before its reader is reopened (see `shardloader.io.identity`).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from shardloader.errors import ChecksumMismatch, ShardChangedError, ShardError
from shardloader.format.index import ShardInfo
from shardloader.io.checksum import checksum_stream, parse_checksum
from shardloader.io.identity import FileIdentity, path_identity
from shardloader.io.paths import resolve_inside_root, strip_file_scheme
from shardloader.source.protocol import ShardSource


def _missing(path: str, info: ShardInfo) -> ShardError:
    return ShardError(f"{path}: shard file is missing (listed in the index as {info.path!r})")


def _check_size(path: str, size: int, info: ShardInfo) -> None:
    if size != info.bytes:
        raise ShardError(
            f"{path}: shard is {size} bytes but the index records {info.bytes} "
            f"({'truncated' if size < info.bytes else 'larger than expected'})"
        )


def verify_local_file(path: str, info: ShardInfo) -> FileIdentity:
    """The identity of the file at `path`, after checking that it has the size and checksum of
    `info`; otherwise a ShardError naming `path` (ShardChangedError if it changed meanwhile)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise _missing(path, info) from None
    with f:
        identity = FileIdentity.of(os.fstat(f.fileno()))
        _check_size(path, identity.size, info)
        algorithm, _ = parse_checksum(info.checksum)
        actual, _ = checksum_stream(f, algorithm)
        after = FileIdentity.of(os.fstat(f.fileno()))
    if after != identity:
        raise ShardChangedError(f"{path}: shard changed while being verified ({identity.change_to(after)})")
    if actual != info.checksum:
        raise ChecksumMismatch(f"{path}: checksum {actual} does not match the index ({info.checksum})")
    return identity


class LocalSource(ShardSource):
    """Shards read in place from a local directory, never copied.

    Each process verifies a file when it first opens it and again whenever the file at its
    path has another identity (inode, size, mtime, change time) than the one it verified: a
    file replaced by rename or rewritten in place during a run is checked against the index
    before it is read.
    With `verify=False` only the size is checked against the index.
    A shard whose path leads out of the root through a symbolic link (its own or a
    directory's) is refused with UnsafePathError, checked whenever the file is (re)verified;
    `allow_links_outside_root=True` reads it anyway. Links inside the root are fine.

    The rest of `ShardSource` keeps its null defaults: nothing to release, prefetch or read by
    range, and counters that stay zeros.
    """

    reads_in_place = True

    def __init__(self, root: str, *, verify: bool = True, allow_links_outside_root: bool = False) -> None:
        self.root = os.path.abspath(strip_file_scheme(root))
        self.verify = verify
        self.allow_links_outside_root = allow_links_outside_root
        self._verified: dict[str, FileIdentity] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def local_path(self, info: ShardInfo) -> str:
        path = os.path.join(self.root, info.path)
        if os.getpid() != self._pid:  # a forked worker verifies for itself
            self._verified = {}
            self._pid = os.getpid()
        try:
            now = path_identity(path)
        except FileNotFoundError:
            raise _missing(path, info) from None
        before = self._verified.get(info.path)
        if before == now:
            return path
        # a link retargeted since gives another identity: this check runs again then
        resolve_inside_root(self.root, info.path, what=f"shard {info.path!r}",
                            allow_outside=self.allow_links_outside_root)
        try:
            if self.verify:
                now = verify_local_file(path, info)
            else:
                _check_size(path, now.size, info)
        except ShardError as e:
            if before is None or isinstance(e, ShardChangedError):
                raise
            raise type(e)(f"{e}; the file changed during the run ({before.change_to(now)} "
                          "since this process verified it)") from None
        with self._lock:
            self._verified[info.path] = now
        return path

    def verified_identity(self, info: ShardInfo) -> FileIdentity | None:
        """The identity of the file `local_path` last verified for `info` in this process."""
        if os.getpid() != self._pid:
            return None
        return self._verified.get(info.path)

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "verify": self.verify,
                "allow_links_outside_root": self.allow_links_outside_root}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["root"], verify=state["verify"],
                      allow_links_outside_root=state.get("allow_links_outside_root", False))
