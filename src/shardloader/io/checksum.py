"""Content checksums for shards and checkpoint files.

xxh3-128 is the default: it hashes at memory speed (several GB/s per core), so a process can
re-verify a cached shard on first open for milliseconds per shard. blake2b is accepted for
indexes written by tools that prefer a cryptographic hash.
"""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO

import xxhash

DEFAULT_ALGORITHM = "xxh3_128"
_CHUNK = 1 << 20  # as fast as 4 MiB here, and a quarter of the memory


def new_hasher(algorithm: str = DEFAULT_ALGORITHM):
    """A hasher object with `update` and `hexdigest` for `algorithm`."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "blake2b":
        return hashlib.blake2b(digest_size=32)
    raise ValueError(f"unknown checksum algorithm {algorithm!r} (known: xxh3_128, blake2b)")


def format_checksum(algorithm: str, hexdigest: str) -> str:
    return f"{algorithm}:{hexdigest}"


def parse_checksum(checksum: str) -> tuple[str, str]:
    """Split 'algorithm:hex' into its parts, rejecting anything else."""
    algorithm, sep, digest = checksum.partition(":")
    if not sep or not digest:
        raise ValueError(f"checksum {checksum!r} is not of the form 'algorithm:hexdigest'")
    new_hasher(algorithm)  # validates the algorithm name
    try:
        int(digest, 16)
    except ValueError:
        raise ValueError(f"checksum {checksum!r} has a digest that is not hexadecimal") from None
    return algorithm, digest


def checksum_bytes(data: bytes | memoryview, algorithm: str = DEFAULT_ALGORITHM) -> str:
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return format_checksum(algorithm, hasher.hexdigest())


def checksum_stream(stream: BinaryIO, algorithm: str = DEFAULT_ALGORITHM) -> tuple[str, int]:
    """Checksum and byte count of everything left in `stream`.

    Read into one reused buffer where the stream supports `readinto`: a fresh `bytes` per
    chunk costs page faults on every chunk, and verifying a local shard became 2.4x slower
    (8 shards of 15 MB: 42 ms against 17 ms, xxh3 on this machine) — on the path of every
    worker's first batch."""
    hasher = new_hasher(algorithm)
    size = 0
    readinto = getattr(stream, "readinto", None)
    if readinto is None:
        while chunk := stream.read(_CHUNK):
            hasher.update(chunk)
            size += len(chunk)
    else:
        buffer = memoryview(bytearray(_CHUNK))
        while n := readinto(buffer):
            hasher.update(buffer[:n])
            size += n
    return format_checksum(algorithm, hasher.hexdigest()), size


def checksum_fd(fd: int, algorithm: str = DEFAULT_ALGORITHM) -> tuple[str, int]:
    """Checksum and byte count of everything in open file `fd`, read with `preadv` into one
    reused buffer (see `checksum_stream`; the file offset is left alone, so a descriptor
    shared with a reader or writer is safe to hash)."""
    hasher = new_hasher(algorithm)
    buffer = memoryview(bytearray(_CHUNK))
    offset = 0
    while n := os.preadv(fd, [buffer], offset):
        hasher.update(buffer[:n])
        offset += n
    return format_checksum(algorithm, hasher.hexdigest()), offset


def checksum_file(path: str, algorithm: str = DEFAULT_ALGORITHM) -> tuple[str, int]:
    """Checksum and size of a local file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return checksum_fd(fd, algorithm)
    finally:
        os.close(fd)
