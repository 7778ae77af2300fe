"""Checksums of streams and descriptors equal the checksum of the bytes, whatever the chunking."""

from __future__ import annotations

import io
import os

import pytest

from shardloader.io import checksum
from shardloader.io.checksum import checksum_bytes, checksum_fd, checksum_file, checksum_stream

_CHUNK = checksum._CHUNK


class _ReadOnly:
    """A stream with `read` only (no `readinto`), as some file-likes are."""

    def __init__(self, data: bytes) -> None:
        self._buffer = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._buffer.read(n)


@pytest.mark.parametrize("size", [0, 1, _CHUNK - 1, _CHUNK, _CHUNK + 1, 3 * _CHUNK + 5])
@pytest.mark.parametrize("algorithm", ["xxh3_128", "blake2b"])
def test_every_way_of_reading_gives_the_checksum_of_the_bytes(tmp_path, size, algorithm):
    data = os.urandom(size)
    want = checksum_bytes(data, algorithm)
    path = tmp_path / "blob"
    path.write_bytes(data)
    with open(path, "rb") as f:
        assert checksum_stream(f, algorithm) == (want, size)
    with open(path, "rb", buffering=0) as f:
        assert checksum_stream(f, algorithm) == (want, size)
    assert checksum_stream(_ReadOnly(data), algorithm) == (want, size)
    assert checksum_stream(io.BytesIO(data), algorithm) == (want, size)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.lseek(fd, size // 2, os.SEEK_SET)
        assert checksum_fd(fd, algorithm) == (want, size)  # from the start, whatever the offset
        assert os.lseek(fd, 0, os.SEEK_CUR) == size // 2  # and the offset is left alone
    finally:
        os.close(fd)
    if algorithm == "xxh3_128":
        assert checksum_file(str(path)) == (want, size)


def test_stream_checksum_covers_only_what_is_left(tmp_path):
    data = os.urandom(_CHUNK + 100)
    with io.BytesIO(data) as f:
        f.seek(100)
        assert checksum_stream(f) == (checksum_bytes(data[100:]), _CHUNK)
