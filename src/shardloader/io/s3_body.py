"""Reading the body of an S3 GET for `shardloader.io.s3client`: whole, or streamed straight
into a file through one small buffer (`RangeCopy`, for whole-shard downloads: see
`S3Reader.read_range_into`)."""

from __future__ import annotations

import errno
import http.client
import mmap
import os
from collections.abc import Callable

from shardloader.io.retry import ShortRead

#: Reads a 200/206 response's body: (what `_request` returns as the body, whether the body was
#: read to its end, so that the connection can be kept alive).
BodyReader = Callable[[http.client.HTTPResponse, int], tuple[bytes, bool]]


def read_whole(response: http.client.HTTPResponse, status: int) -> tuple[bytes, bool]:
    return response.read(), True


class LocalWriteError(Exception):
    """An error writing the local file while copying a body (carried past the network-error
    handling of `S3Reader._request`, which would otherwise take it for a broken connection)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class RangeCopy:
    """Copies the body of a GET of bytes [start, end) into `fd` at `file_offset`, through one
    anonymous-mmap buffer of `buffer_size` bytes (see `S3Reader.read_range_into`). A 206 must
    carry exactly the range; a 200 is the whole object (the server ignored Range), whose bytes
    before `start` are skipped and after `end` left unread. `written` counts the bytes written."""

    def __init__(self, fd: int, start: int, end: int, file_offset: int, buffer_size: int) -> None:
        if buffer_size < 1:
            raise ValueError("read_range_into: buffer_size must be at least 1")
        self.fd, self.start, self.end, self.offset = fd, start, end, file_offset
        self.buffer_size = buffer_size
        self.written = 0

    def __call__(self, response: http.client.HTTPResponse, status: int) -> tuple[bytes, bool]:
        want = self.end - self.start
        skip = self.start if status == 200 else 0
        length = response.length  # what is left of the body; None when not known (chunked)
        if status == 206 and length is not None and length != want:
            raise ShortRead(f"range {self.start}-{self.end - 1} returned {length} bytes instead of {want}")
        # Unmapped when the last reference goes (this call's end, or an error's traceback,
        # which may hold views of it: an explicit close would then fail).
        view = memoryview(mmap.mmap(-1, min(self.buffer_size, want + skip)))
        while skip:  # the server ignored Range: discard what precedes `start`
            skip -= self._receive(response, view[:min(skip, len(view))], want)
        while self.written < want:
            n = self._receive(response, view[:min(want - self.written, len(view))], want)
            self._write(view[:n])
        return b"", response.isclosed()

    def _receive(self, response: http.client.HTTPResponse, into: memoryview, want: int) -> int:
        n = response.readinto(into)
        if not n:  # http.client returns 0, not an error, when the connection ends early
            raise ShortRead(f"range {self.start}-{self.end - 1} returned {self.written} bytes "
                            f"instead of {want} (the connection closed mid-body)")
        return n

    def _write(self, data: memoryview) -> None:
        while data:
            try:
                n = os.pwrite(self.fd, data, self.offset + self.written)
            except OSError as e:
                raise LocalWriteError(e) from e
            if n <= 0:
                raise LocalWriteError(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
            data = data[n:]
            self.written += n
