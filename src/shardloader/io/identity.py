"""Which file a shard reader holds, and whether it changed since it was verified (I12).

Datasets get rewritten while runs read them: a new file renamed over the old path, or the old
file truncated and rewritten in place. A check by path ("this process verified shard-00001")
cannot see either. A `FileIdentity` (device, inode, size, mtime in ns) can: a rename gives
another inode, an in-place rewrite another size or mtime. Sources remember the identity they
verified and verify again when the file at the path has another one; readers remember the
identity of the file they opened and check it (one `fstat`, about a microsecond) before and
after touching its bytes.

That check matters most for memory-mapped shards. Reading a page of a mapping beyond the end
of a file that shrank kills the process with SIGBUS, which Python cannot catch: no traceback,
no file named. Checking the size first turns a shard truncated between two reads into a
`ShardChangedError` naming the file. A truncation that lands during one read's page accesses
(microseconds) can still fault: the kernel gives no way to refuse it from Python.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from shardloader.errors import ShardChangedError


@dataclass(frozen=True)
class FileIdentity:
    """What tells one version of a file from another without reading it."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def change_to(self, other: FileIdentity) -> str:
        """How `other` differs from this identity, in words."""
        if (other.device, other.inode) != (self.device, self.inode):
            return "it was replaced by another file"
        if other.size < self.size:
            return f"it shrank from {self.size} to {other.size} bytes"
        if other.size > self.size:
            return f"it grew from {self.size} to {other.size} bytes"
        return "it was modified in place"


def path_identity(path: str) -> FileIdentity:
    """The identity of the file at `path` now (follows symlinks); FileNotFoundError if none."""
    return FileIdentity.of(os.stat(path))


class FileGuard:
    """The identity of one open file descriptor, checked for change on demand.

    `expect` (the identity a source verified) is compared on construction, so a file replaced
    between verification and opening is caught before any byte of it is parsed.
    """

    def __init__(self, path: str, fd: int, expect: FileIdentity | None = None) -> None:
        self.path = path
        self.fd = fd
        self.identity = FileIdentity.of(os.fstat(fd))
        self._size, self._mtime_ns = self.identity.size, self.identity.mtime_ns  # hot path
        if expect is not None and self.identity != expect:
            raise ShardChangedError(
                f"{path}: shard changed after it was verified ({expect.change_to(self.identity)})"
            )

    def check(self) -> None:
        """Raise ShardChangedError naming the file unless it still has its identity at open.

        The descriptor pins the inode, so only an in-place change (size, mtime) can show here;
        a file renamed over the path leaves this reader's (verified) file intact.
        """
        st = os.fstat(self.fd)
        if st.st_size != self._size or st.st_mtime_ns != self._mtime_ns:
            now = FileIdentity.of(st)
            raise ShardChangedError(
                f"{self.path}: shard changed while open ({self.identity.change_to(now)})"
            )

    def check_path(self) -> None:
        """Raise ShardChangedError unless the path still names the open file, unchanged (for
        readers that read part of the file by path while opening it)."""
        self.check()
        try:
            now = path_identity(self.path)
        except FileNotFoundError:
            raise ShardChangedError(f"{self.path}: shard was removed while being opened") from None
        if now != self.identity:
            raise ShardChangedError(
                f"{self.path}: shard changed while being opened ({self.identity.change_to(now)})"
            )
