"""Memory-mapped shard files: opening one read-only, and giving back the pages a read touched.

The Arrow and Parquet readers map their shard (Arrow through pyarrow's `memory_map` or a
Python `mmap`, Parquet through pyarrow's). Every map is checked by a `FileGuard` (see
`shardloader.io.identity`), so a shard truncated under its reader is a ShardError naming it,
not SIGBUS on a page past the new end of the file.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Any

from shardloader.errors import ShardError
from shardloader.format.protocol import ShardEntry
from shardloader.io.identity import FileGuard, FileIdentity


def memory_map_shard(path: str, info: ShardEntry,
                     expect: FileIdentity | None = None) -> tuple[Any, FileGuard]:
    """A read-only pyarrow memory map of a shard file and the guard of the mapped file, or a
    ShardError naming the file (ShardChangedError when it is not the file `expect` describes)."""
    import pyarrow as pa

    try:
        mapped = pa.memory_map(path, "r")
    except FileNotFoundError:
        raise ShardError(f"{path}: shard file is missing (listed as {info.path!r})") from None
    except OSError as e:
        raise ShardError(f"{path}: cannot open shard ({e})") from None
    try:  # the map's own descriptor: its identity is that of the mapped inode, whatever the path
        return mapped, FileGuard(path, mapped.fileno(), expect)
    except BaseException:
        mapped.close()
        raise


class MappedPages:
    """Lets go of the pages of a read-only shard mapping that this process has touched.

    Each page of a memory-mapped shard that a read touches stays in the process's resident set
    until the mapping is closed: over an epoch a worker's RSS and PSS grow by the shard bytes it
    has read (about 200 MiB per worker for 20k JPEGs of 15 KB), though every page is read once
    per epoch and lives on in the page cache anyway. `drop()` (after each read) unmaps them from
    this process with madvise(MADV_DONTNEED): the bytes stay in the page cache and the next
    touch maps them again (a minor fault). Measured on benchmarks.memory: worker PSS from 329 to
    under 150 MiB; the data read is unchanged (the mapping is read-only and file-backed, so
    nothing is discarded, only this process's page-table entries).

    Only the whole mapping of a pyarrow memory map is advised, only while it is open (an
    address range unmapped and reused by other memory must never be advised), and nothing is
    done where the address or libc's madvise is not available.
    """

    def __init__(self, mapped: Any) -> None:
        self._mapped = mapped
        self._address = self._size = 0  # of the whole mapping, when known
        try:
            size = mapped.size()
            if size <= 0:
                return
            position = mapped.tell()
            mapped.seek(0)
            view = mapped.read_buffer(size)  # zero-copy: its address is the mapping's start
            mapped.seek(position)
        except (OSError, ValueError, AttributeError):
            return
        if view.address % mmap.PAGESIZE == 0 and view.size == size:
            self._address, self._size = view.address, size

    @property
    def address(self) -> int:
        """Where the mapping starts (0 when unknown)."""
        return self._address

    @property
    def size(self) -> int:
        return self._size

    def drop(self) -> None:
        if madvise is not None and self._address and not self._mapped.closed:
            madvise(self._address, self._size, MADV_DONTNEED)


class MmapPages:
    """`MappedPages` for a Python `mmap`: after a read, the touched pages of the read-only
    shard mapping leave this process's resident set (they stay in the page cache)."""

    def __init__(self, mapped: mmap.mmap) -> None:
        self._mapped = mapped

    def drop(self) -> None:
        if not self._mapped.closed and hasattr(self._mapped, "madvise"):
            self._mapped.madvise(mmap.MADV_DONTNEED)


def close_mmap(mapped: mmap.mmap) -> None:
    """Close a map, or leave it to be unmapped with the last view of it (numpy views of its
    buffers; the records read are copies, so only a caller's own reference can hold one)."""
    try:
        mapped.close()
    except BufferError:
        pass


#: madvise(2) advice (Linux): drop this process's page-table entries for a range (the bytes stay
#: in the page cache, or in the shared-memory object of a shared mapping).
MADV_DONTNEED = 4


def _load_madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


#: libc's madvise(address, length, advice) -> int, or None where it is not available: for this
#: module's maps and the loader's shared-memory batch slots (`loader.workers.slots`).
madvise = _load_madvise()
