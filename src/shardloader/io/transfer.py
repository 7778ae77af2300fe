"""Reading remote objects by byte range, with retries that are bounded in total.

`download` writes one object into a local file. The object is read as byte ranges
(`chunk_size` each, `parallel` at a time through fsspec's `cat_ranges`, which runs them
concurrently on async filesystems such as s3fs and http). With the botocore S3 reader
(`shardloader.io.s3client.S3Reader`) each range is instead streamed into the file as it arrives
(`read_ranges_into`, on the client's threads), 256 KiB at a time: read whole, `parallel`
8 MiB bodies per download were alive at once in the training process, and their churn left
glibc's per-thread arenas holding ~100 MiB after a remote epoch. Ranges that fail with a transient
error (see `shardloader.io.retry`) are fetched again after an exponential backoff with jitter;
ranges already written are kept, so a reset near the end of a large shard does not restart it.
When every range is in, the file is hashed and compared with the index checksum; a mismatch
downloads the whole object again, up to `checksum_attempts` times. Permanent errors (404, 403,
other 4xx, checksum mismatch after the retries, retries or deadline exhausted) raise
`FetchError` naming the URL and the cause.

`read_ranges` reads any ranges of any objects the same way (the caller verifies them), and
`read_bytes` a whole small object (`index.json`). The clients come from
`shardloader.io.clients`.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardloader.errors import FetchError
from shardloader.io.checksum import checksum_fd, parse_checksum
from shardloader.io.clients import filesystem
from shardloader.io.files import write_at
from shardloader.io.retry import (
    STALLS,
    FetchCancelled,
    RetryPolicy,
    ShortRead,
    answered,
    describe,
    endpoint_of,
    http_status,
    is_throttle,
    is_timeout,
    is_transient,
    pause,
    permanent_reason,
    retrying,
    slowed_down,
)
from shardloader.io.s3client import S3Reader


@dataclass
class FetchStats:
    """What one download cost: bytes received (retried ranges included), seconds, retries."""

    bytes_received: int = 0
    seconds: float = 0.0
    retries: int = 0
    checksum_failures: int = 0


def download(
    fs: Any,
    path: str,
    url: str,
    fd: int,
    *,
    size: int,
    checksum: str,
    policy: RetryPolicy,
    chunk_size: int = 8 << 20,
    parallel: int = 4,
    cancel: threading.Event | None = None,
    rng: random.Random | None = None,
    on_retry: Callable[[BaseException, float], None] | None = None,
) -> FetchStats:
    """Write remote object `path` (on fsspec filesystem `fs`; `url` names it in errors) into
    the open, empty file `fd`, and check it has `size` bytes hashing to `checksum`.

    Returns the costs. Raises FetchError when the object cannot be fetched whole and correct,
    FetchCancelled when `cancel` is set. The file's content is undefined after an error.
    """
    algorithm, _ = parse_checksum(checksum)
    rng = rng or random.Random()
    stats = FetchStats()
    start = time.monotonic()
    deadline = start + policy.deadline
    failures = throttled = 0  # a throttle (`is_throttle`) spends no attempt; the deadline bounds it

    def wait_before_retry(exc: BaseException) -> None:
        nonlocal failures, throttled
        if is_throttle(exc):
            throttled += 1
        else:
            failures += 1
        stats.retries += 1
        if failures >= policy.attempts:
            raise FetchError(
                f"{url}: giving up after {failures} failed attempts{slowed_down(throttled)}; "
                f"last error: {describe(exc)}") from exc
        delay = policy.backoff(failures + throttled - 1, rng)
        if time.monotonic() + delay > deadline:
            raise FetchError(
                f"{url}: giving up after {time.monotonic() - start:.1f} s (deadline "
                f"{policy.deadline:g} s, {failures} failed attempts{slowed_down(throttled)}); "
                f"last error: {describe(exc)}") from exc
        STALLS.check([url], policy, delay)
        if on_retry is not None:
            on_retry(exc, delay)
        pause(delay, url, cancel)

    for whole in range(policy.checksum_attempts):
        os.ftruncate(fd, 0)
        pending = [(lo, min(lo + chunk_size, size)) for lo in range(0, size, chunk_size)]
        while pending:
            if cancel is not None and cancel.is_set():
                raise FetchCancelled(url)
            STALLS.check([url], policy)
            batch, pending = pending[:parallel], pending[parallel:]
            started = time.monotonic()
            if isinstance(fs, S3Reader):  # streamed into the file: no body is held whole
                results: list[Any] = fs.read_ranges_into(path, batch, fd)
            else:
                results = _cat_ranges(fs, path, batch)
            _record_round([(url, r) for r in results], started)
            failed: list[tuple[int, int]] = []
            first_error: BaseException | None = None
            for (lo, hi), result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):
                    error: BaseException | None = result
                elif isinstance(result, int):  # written by read_ranges_into, exactly hi - lo
                    error = None
                    stats.bytes_received += result
                else:
                    data, error = _check_range(result, lo, hi, size)
                    if error is None:
                        write_at(fd, data, lo)  # all of it, or the disk's OSError
                        stats.bytes_received += len(data)
                if error is not None:
                    if not is_transient(error):
                        raise FetchError(f"{url}: {_range_failure(error, lo, hi, size)}") from error
                    failed.append((lo, hi))
                    first_error = first_error or error
            if failed:
                pending = failed + pending
                assert first_error is not None
                wait_before_retry(first_error)
        actual, _ = checksum_fd(fd, algorithm)
        if actual == checksum:
            stats.seconds = time.monotonic() - start
            return stats
        stats.checksum_failures += 1
        if whole + 1 < policy.checksum_attempts:
            wait_before_retry(
                ShortRead(f"downloaded bytes hash to {actual}, the index records {checksum}")
            )
    raise FetchError(
        f"{url}: checksum mismatch after {policy.checksum_attempts} downloads: the remote object "
        f"hashes to {actual} but the index records {checksum} (the object or the index is wrong)"
    )


def _cat_ranges(fs: Any, path: str | list[str], ranges: list[tuple[int, int]]) -> list[Any]:
    paths = path if isinstance(path, list) else [path] * len(ranges)
    try:
        results = fs.cat_ranges(
            paths, [lo for lo, _ in ranges], [hi for _, hi in ranges],
            on_error="return",
        )
    except Exception as e:  # a failure of the whole call counts against every range
        return [e] * len(ranges)
    if len(results) != len(ranges):
        return [ShortRead(f"asked for {len(ranges)} ranges, got {len(results)} results")] * len(ranges)
    return list(results)


def _record_round(results: list[tuple[str, Any]], started: float) -> None:
    """Tell `STALLS` how a round of range requests begun at `started` went, per endpoint: any
    answer from it ends its stall, else a timeout extends it."""
    rounds: dict[str | None, tuple[str, bool, bool]] = {}
    for url, result in results:
        error = result if isinstance(result, BaseException) else None
        first, got, late = rounds.get(endpoint_of(url), (url, False, False))
        rounds[endpoint_of(url)] = (first, got or answered(error),
                                    late or (error is not None and is_timeout(error)))
    for url, got, late in rounds.values():
        STALLS.record(url, started, answered=got, timed_out=late)


def _check_range(data: Any, lo: int, hi: int, size: int) -> tuple[bytes, BaseException | None]:
    """The bytes of range [lo, hi) in `data`, or the error to record for it."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return b"", TypeError(f"filesystem returned {type(data).__name__} for a byte range")
    want = hi - lo
    if len(data) == want:
        return bytes(data), None
    if len(data) == size and size > want:  # the server ignored the Range header
        return bytes(data[lo:hi]), None
    return b"", ShortRead(f"range {lo}-{hi - 1} returned {len(data)} bytes instead of {want}")


def _range_failure(error: BaseException, lo: int, hi: int, size: int) -> str:
    """Why the permanent `error` on range [lo, hi) of an object of `size` bytes is one."""
    if http_status(error) == 416:
        return (
            f"range {lo}-{hi - 1} is outside the remote object, which is shorter than the "
            f"{size} bytes the index records ({describe(error)})"
        )
    return permanent_reason(error)


@dataclass(frozen=True)
class RangeRequest:
    """Bytes [lo, hi) of remote object `path` (`url` names it in errors; `size` is the object's
    size by the index, to recognise a server that ignored the Range header)."""

    path: str
    url: str
    lo: int
    hi: int
    size: int


def read_ranges(
    fs: Any,
    requests: list[RangeRequest],
    *,
    policy: RetryPolicy,
    rng: random.Random | None = None,
    cancel: threading.Event | None = None,
) -> tuple[list[bytes], FetchStats]:
    """The bytes of every request (any objects), fetched concurrently in one `cat_ranges` call
    per round, with the same transient-error rules, backoff and bounds as `download`.

    Raises FetchError naming the URL on a permanent error or when retries run out. The caller
    verifies what came back (ranges carry no checksum of their own here)."""
    rng = rng or random.Random()
    stats = FetchStats()
    start = time.monotonic()
    out: list[bytes | None] = [None] * len(requests)
    pending = list(range(len(requests)))
    failures = throttled = 0  # a throttle (`is_throttle`) spends no attempt; the deadline bounds it
    while pending:
        if cancel is not None and cancel.is_set():
            raise FetchCancelled(requests[pending[0]].url)
        STALLS.check({requests[i].url: None for i in pending}, policy)
        started = time.monotonic()
        results = _cat_ranges(fs, [requests[i].path for i in pending],
                              [(requests[i].lo, requests[i].hi) for i in pending])
        _record_round([(requests[i].url, r) for i, r in zip(pending, results, strict=True)], started)
        failed: list[int] = []
        first_error: BaseException | None = None
        for i, result in zip(pending, results, strict=True):
            r = requests[i]
            if isinstance(result, BaseException):
                error: BaseException | None = result
            else:
                data, error = _check_range(result, r.lo, r.hi, r.size)
                if error is None:
                    out[i] = data
                    stats.bytes_received += len(data)
            if error is not None:
                if not is_transient(error):
                    raise FetchError(f"{r.url}: {_range_failure(error, r.lo, r.hi, r.size)}") from error
                failed.append(i)
                first_error = first_error or error
        pending = failed
        if pending:
            assert first_error is not None
            if is_throttle(first_error):
                throttled += 1
            else:
                failures += 1
            stats.retries += 1
            url = requests[pending[0]].url
            delay = policy.backoff(failures + throttled - 1, rng)
            if failures >= policy.attempts or time.monotonic() + delay - start > policy.deadline:
                raise FetchError(
                    f"{url}: giving up on a byte-range read after {failures} failed attempts"
                    f"{slowed_down(throttled)}; last error: {describe(first_error)}"
                ) from first_error
            STALLS.check({requests[i].url: None for i in pending}, policy, delay)
            pause(delay, url, cancel)
    stats.seconds = time.monotonic() - start
    return [b for b in out if b is not None], stats


def read_bytes(
    url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    policy: RetryPolicy | None = None,
    rng: random.Random | None = None,
) -> bytes:
    """The whole content of a small remote object (e.g. `index.json`), with the same retries.

    FileNotFoundError passes through unchanged (callers give it their own message); other
    permanent errors and exhausted retries raise FetchError.
    """
    fs, path = filesystem(url, storage_options)
    return retrying(lambda: fs.cat_file(path), url, policy=policy, rng=rng)
