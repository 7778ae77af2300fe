"""The parts of `shardloader.io.s3client` that are not botocore's: reading a GET's body whole or
streamed into a file (`copy_body_into`), and the daemon threads that run concurrent GETs."""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from shardloader.io.retry import ShortRead


def read_body(answer: dict[str, Any]) -> bytes:
    """The whole body of botocore's GetObject `answer` (a short body raises botocore's
    IncompleteReadError, which `shardloader.io.retry` counts as transient)."""
    return answer["Body"].read()


def copy_body_into(answer: dict[str, Any], fd: int, start: int, end: int, file_offset: int,
                   buffer_size: int) -> int:
    """Write the body of a GET of bytes [start, end) into `fd` from `file_offset` on, at most
    `buffer_size` bytes at a time; returns the bytes written (end - start). A 206 must carry
    exactly the range; a 200 is the whole object (the server ignored Range), whose bytes before
    `start` are skipped and after `end` left unread."""
    if buffer_size < 1:
        raise ValueError("read_range_into: buffer_size must be at least 1")
    want = end - start
    status = answer.get("ResponseMetadata", {}).get("HTTPStatusCode")
    length = answer.get("ContentLength")
    if status == 206 and length is not None and length != want:
        raise ShortRead(f"range {start}-{end - 1} returned {length} bytes instead of {want}")
    body = answer["Body"]
    skip = start if status == 200 else 0
    # One anonymous-mmap buffer, unmapped when its last view goes: read whole or in bytes
    # chunks, the bodies' churn raised glibc's mmap threshold and per-thread arenas kept
    # 6-14 MiB each after a remote epoch; an mmap moves no malloc threshold.
    view = memoryview(mmap.mmap(-1, min(buffer_size, want + skip)))
    while skip:  # the server ignored Range: discard what precedes `start`
        skip -= _receive(body, view[:min(skip, len(view))], start, end, 0)
    written = 0
    while written < want:
        data = view[:_receive(body, view[:min(want - written, len(view))], start, end, written)]
        while data:
            n = os.pwrite(fd, data, file_offset + written)  # the disk's OSError, as is
            if n <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            data = data[n:]
            written += n
    return written


def _receive(body: Any, into: memoryview, start: int, end: int, written: int) -> int:
    from botocore.exceptions import IncompleteReadError

    try:
        n = body.readinto(into)
    except IncompleteReadError:  # botocore's own check of Content-Length: the same short body
        n = 0
    if not n:
        raise ShortRead(f"range {start}-{end - 1} returned {written} bytes instead of "
                        f"{end - start} (the connection closed mid-body)")
    return n


def outcome(call: Callable[[], Any]) -> Any:
    """`call()`'s result, or the exception it raised (returned in place of a range's bytes)."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - returned in place of the range
        return e


class DaemonThreads:
    """Runs calls in up to `size` daemon threads, started as needed. Not a ThreadPoolExecutor:
    its threads are joined without limit at interpreter exit, so one request stuck on a silent
    server would hold up the exit (requests are bounded by the read timeout, still too long)."""

    def __init__(self, size: int, name: str) -> None:
        self.size, self.name = max(1, size), name
        self._queue: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]]] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def submit(self, call: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            self._queue.put((future, call))
            if self._queue.qsize() > self._idle and self._threads < self.size:
                self._threads += 1
                threading.Thread(target=self._run, name=f"{self.name}-{self._threads}", daemon=True).start()
        return future

    def _run(self) -> None:
        while True:
            self._run_next()

    def _run_next(self) -> None:
        """Wait for the next call and run it. A method of its own so that nothing of a call
        outlives it: were the future a local of `_run`'s loop, each idle thread would keep its
        last future, and the future its result (a response body, up to a download chunk of
        8 MiB) until the thread's next call."""
        with self._lock:
            self._idle += 1
        future, call = self._queue.get()
        with self._lock:
            self._idle -= 1
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(call())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(e)
