"""Which file a shard reader holds, and whether it changed since it was verified (I12).

Datasets get rewritten while runs read them: a new file renamed over the old path, or the old
file truncated and rewritten in place. A check by path ("this process verified shard-00001")
cannot see either. A `FileIdentity` (device, inode, size, mtime and inode change time in ns)
can: a rename gives another inode, an in-place rewrite another size, mtime or change time.
Sources remember the identity they verified and verify again when the file at the path has
another one; readers remember the identity of the file they opened and check it (one `fstat`,
about a microsecond) before and after touching its bytes.

Why the change time (`st_ctime_ns`): a rewrite in place that keeps the size and puts the mtime
back (`os.utime`, `touch -r`, `rsync --inplace`, `cp --preserve` of a same-sized file) left all
of device, inode, size and mtime as they were, and the new bytes were served unverified. Users
can set the mtime but not the change time: the kernel sets it to now on every write, truncate,
`utime`, rename, chmod, chown or link count change, so any rewrite moves it. What moves it
without touching the bytes (a chmod, a hard link made or removed, a rename) costs one more
verification, never an error; the cache takes the identity of its own files after the rename
that installs them, so its own renames do not count. What is trusted, then: a file whose change
time did not move was not written since it was verified. Two limits, both the kernel's: a
filesystem with coarse timestamps (1 s on ext3, FAT) or a rewrite within one clock tick of the
previous change can leave the change time equal; and a privileged user can reset it by setting
the system clock. See docs/format.md, "Shards that change during a run".

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
    ctime_ns: int  # the inode's change time: moves on any write, and users cannot set it

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def change_to(self, other: FileIdentity) -> str:
        """How `other` differs from this identity, in words."""
        if (other.device, other.inode) != (self.device, self.inode):
            return "it was replaced by another file"
        if other.size < self.size:
            return f"it shrank from {self.size} to {other.size} bytes"
        if other.size > self.size:
            return f"it grew from {self.size} to {other.size} bytes"
        if other.mtime_ns != self.mtime_ns:
            return "it was modified in place"
        return ("its inode changed with its size and mtime kept (rewritten in place with its "
                "mtime put back, or its permissions or links changed)")


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
        st = os.fstat(fd)
        self.identity = FileIdentity.of(st)
        # hot path: the fields an in-place change can move (the descriptor pins the inode)
        self._size, self._mtime_ns, self._ctime_ns = st.st_size, st.st_mtime_ns, st.st_ctime_ns
        self._nlink = st.st_nlink
        if expect is not None and self.identity != expect:
            raise ShardChangedError(
                f"{path}: shard changed after it was verified ({expect.change_to(self.identity)})"
            )

    def check(self) -> None:
        """Raise ShardChangedError naming the file unless it still has its identity at open.

        The descriptor pins the inode, so only an in-place change (size, mtime, change time)
        can show here; a file renamed over the path leaves this reader's (verified) file intact.
        That rename unlinks the old file, which moves its change time too: when the link count
        changed, the change time is not compared (an in-place write then still shows as a new
        size or mtime, and the next open by path compares the whole identity).
        """
        st = os.fstat(self.fd)
        if st.st_size != self._size or st.st_mtime_ns != self._mtime_ns or (
                st.st_ctime_ns != self._ctime_ns and st.st_nlink == self._nlink):
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
