"""What is transient, how long to wait before trying again, and a retry loop for single calls.

Only this module decides what is transient: timeouts, connection resets, 5xx, 429, a short or
empty body. The rules look through an exception's cause chain for an HTTP status (aiohttp's
`ClientResponseError.status`, botocore's `ClientError` response, which s3fs keeps as
`__cause__` of the `OSError` it raises) before falling back to the type. Permanent errors
(404, 403, other 4xx) are never retried, nor a file system's refusal (`is_refusal`: disk full,
quota exceeded, read-only), which no wait fixes.

The backoff is exponential with jitter and bounded twice, in attempts and in total seconds
(`RetryPolicy`). An answer that asks the client to slow down (`is_throttle`: S3's ``503
SlowDown``, HTTP 429) spends no attempt: it is the server pacing its clients, not a failure of
the object, and S3 answers it for as long as a prefix is being partitioned for a higher rate
(minutes). Its backoff grows as any retry's, and the deadline bounds it. Measured with 64
nodes behind a proxy that throttles one prefix to 20 GET/s (`benchmarks/many_nodes.py`):
prefetches and sidecar reads gave up after 10 slow-downs in ~30 s, while the data was there. `shardloader.io.transfer` applies it to byte ranges (keeping what already
arrived); `retrying` applies it to one call made as a whole (a listing, a size, a put).

Stalls. A server that stops answering costs a read timeout per attempt, and one read of a
shard can go through several retry loops in turn (its range sidecar, then the whole shard; the
prefetcher's download, then the reader's own): each with its full budget, that made a stalled
read give up only after 134-194 s with a 5 s read timeout. So `STALLS` keeps, per endpoint
(scheme and host, or bucket) and process, since when its requests have been timing out with no
answer in between, and every loop gives up, naming its URL, once that stall would outlast
`RetryPolicy.stall_limit(read timeout)` = attempts x read timeout + the backoff between them
(at most `deadline`): the bound for any read of a stalled server, whichever loops it goes
through. Any answer (data, or an HTTP status) ends the stall; a worker forked during one
inherits its clock.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from shardloader.errors import FetchError

TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
#: The error codes by which S3 (and AWS's other services) ask a client to slow down.
THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                            "TooManyRequestsException", "RequestThrottled", "RequestThrottledException"})
_PERMANENT_TYPES: tuple[type[BaseException], ...] = (
    FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
)
#: What an OSError without an HTTP status says when the file system refuses the operation
#: itself (disk full, quota exceeded, read-only, file too large).
REFUSED_ERRNOS = frozenset(
    getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EROFS", "EFBIG") if hasattr(errno, name)
)
T = TypeVar("T")


class FetchCancelled(Exception):
    """The download was stopped on request (prefetcher shutdown); nothing was committed."""


class ShortRead(OSError):
    """A range came back with fewer (or other) bytes than requested."""


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try before giving up on one object.

    `attempts` bounds the rounds that end with at least one failed range (a round that makes no
    progress and one that makes some both count); `deadline` bounds the seconds spent on one
    object in total, backoff included; `checksum_attempts` bounds whole downloads whose bytes
    do not match the index. The backoff before retry k (0-based) is drawn uniformly from
    [d/2, d] with d = min(max_delay, base_delay * 2**k): exponential, with jitter so that many
    processes that failed together do not retry together.
    """

    attempts: int = 10
    base_delay: float = 0.2
    max_delay: float = 10.0
    deadline: float = 600.0
    checksum_attempts: int = 3

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.checksum_attempts < 1:
            raise ValueError("RetryPolicy: attempts and checksum_attempts must be at least 1")
        if self.base_delay < 0 or self.max_delay < 0 or self.deadline <= 0:
            raise ValueError("RetryPolicy: delays must be >= 0 and the deadline > 0")

    def backoff(self, retry: int, rng: random.Random) -> float:
        ceiling = self._ceiling(retry)
        return rng.uniform(ceiling / 2, ceiling)

    def _ceiling(self, retry: int) -> float:
        return min(self.max_delay, self.base_delay * (2.0 ** min(retry, 60)))

    def stall_limit(self, read_timeout: float) -> float:
        """Seconds after which every read of a server that stopped answering gives up:
        `attempts` requests that each wait `read_timeout`, plus the longest backoff between
        them, at most `deadline` (defaults, 5 s read timeout: 50 + 42.6 = 92.6 s)."""
        backoff = sum(self._ceiling(k) for k in range(self.attempts - 1))
        return min(self.deadline, self.attempts * read_timeout + backoff)


def cause_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what caused it (`__cause__`, else `__context__`), and so on, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def http_status(exc: BaseException) -> int | None:
    """The HTTP status behind `exc`, looking through its cause chain; None when there is none."""
    for current in cause_chain(exc):
        status = getattr(current, "status", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(code, int):
                return code
    return None


def is_throttle(exc: BaseException) -> bool:
    """True when `exc` is the server asking to slow down: HTTP 429, or an error code of
    THROTTLE_CODES (S3's ``503 SlowDown``; a 503 without that code is a failure like a 500)."""
    if http_status(exc) == 429:
        return True
    for current in cause_chain(exc):
        code = getattr(current, "__dict__", {}).get("code")  # an attribute (S3HTTPError's), not
        # a property: aiohttp's errors have a deprecated `code`, their status
        response = getattr(current, "response", None)
        if code is None and isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
        if isinstance(code, str) and code in THROTTLE_CODES:
            return True
    return False


def is_refusal(exc: BaseException | None) -> bool:
    """True when `exc` is a file system's refusal (REFUSED_ERRNOS), not a network's failure."""
    return isinstance(exc, OSError) and exc.errno in REFUSED_ERRNOS and http_status(exc) is None


def is_transient(exc: BaseException) -> bool:
    """True when retrying `exc` may succeed (timeouts, resets, 5xx, 429, short bodies)."""
    if isinstance(exc, FetchCancelled):
        return False
    status = http_status(exc)
    if status is not None:
        return status in TRANSIENT_STATUS
    if isinstance(exc, _PERMANENT_TYPES) or is_refusal(exc):
        return False
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        return True
    return _is_network_library_error(exc)


def _is_network_library_error(exc: BaseException) -> bool:
    """aiohttp client errors and botocore's connection/read errors, without hard imports."""
    try:
        import aiohttp

        if isinstance(exc, aiohttp.ClientError):
            return True
    except ImportError:  # pragma: no cover - aiohttp is a dependency
        pass
    try:
        from botocore import exceptions as bexc

        network = (
            bexc.ConnectionError, bexc.HTTPClientError, bexc.IncompleteReadError,
            bexc.ResponseStreamingError,
        )
        if isinstance(exc, network):
            return True
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        pass
    import asyncio

    return isinstance(exc, asyncio.TimeoutError) or type(exc).__name__ == "FSTimeoutError"


def is_timeout(exc: BaseException) -> bool:
    """True when `exc` (or one in its cause chain) says a request got no answer in time."""
    return any(isinstance(current, TimeoutError) or any(
        cls.__name__ in _TIMEOUT_NAMES for cls in type(current).__mro__) for current in cause_chain(exc))


# Timeouts of asyncio (before 3.11), aiohttp, fsspec, botocore and urllib3 that are not
# TimeoutError on every Python: matched by the names of their classes and bases.
_TIMEOUT_NAMES = frozenset({"TimeoutError", "ServerTimeoutError", "FSTimeoutError", "ReadTimeoutError",
                            "ConnectTimeoutError", "ReadTimeout", "ConnectTimeout"})


def endpoint_of(url: str) -> str | None:
    """What a stall is kept per: scheme://host[:port] (for s3://, the bucket); None locally."""
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme or parts.scheme == "file" or not parts.netloc:
        return None
    return f"{parts.scheme}://{parts.netloc}"


class StallClock:
    """Per endpoint of this process: when its current run of timed-out requests began, when
    the last one ended, and the longest one took (about the read timeout)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, tuple[float, float, float, int]] = {}  # since, last, took, count

    def check(self, urls: Iterable[str], policy: RetryPolicy, delay: float = 0.0) -> None:
        """Raise FetchError naming the URL if its endpoint has been stalled for so long that one
        more request (after a pause of `delay`) would end past `policy.stall_limit`; a stall
        that nobody has retried for longer than a request plus the longest backoff is over (a
        later read starts anew)."""
        now = time.monotonic()
        for url in urls:
            endpoint = endpoint_of(url)
            with self._lock:
                run = self._runs.get(endpoint) if endpoint else None
                if run is None:
                    continue
                since, last, took, count = run
                if now - last > took + policy.max_delay:
                    del self._runs[endpoint]  # type: ignore[arg-type]
                    continue
            limit = policy.stall_limit(took)
            if now - since + delay + took > limit:
                raise FetchError(
                    f"{url}: giving up: {endpoint} has not answered for {now - since:.1f} s "
                    f"({count} requests in a row timed out, each after {took:.1f} s), and one more "
                    f"would pass the {limit:.1f} s bound for a stalled server ({policy.attempts} "
                    "attempts x the read timeout + backoff: the RetryPolicy, and the read "
                    "timeout of the storage options)")

    def record(self, url: str, started: float, *, answered: bool, timed_out: bool) -> None:
        """After a round of requests to `url`'s endpoint begun at `started`: any answer ends a
        stall; a timeout with no answer starts or extends one."""
        endpoint = endpoint_of(url)
        if endpoint is None or not (answered or timed_out):
            return
        now = time.monotonic()
        with self._lock:
            if answered:
                self._runs.pop(endpoint, None)
                return
            since, _, took, count = self._runs.get(endpoint, (started, now, 0.0, 0))
            self._runs[endpoint] = (min(since, started), now, max(took, now - started), count + 1)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork


#: This process's stall clocks (see the module docstring).
STALLS = StallClock()
os.register_at_fork(after_in_child=STALLS._after_fork)


def answered(error: BaseException | None) -> bool:
    """Whether a request that ended in `error` (None: success) got an answer from the server."""
    return error is None or http_status(error) is not None


def describe(exc: BaseException) -> str:
    status = http_status(exc)
    text = f"{type(exc).__name__}: {exc}".strip()
    return f"HTTP {status} ({text})" if status is not None else text


def permanent_reason(error: BaseException) -> str:
    """Why a permanent error is one, for a message that names the URL before it."""
    status = http_status(error)
    if isinstance(error, FileNotFoundError) or status == 404:
        return f"not found ({describe(error)})"
    if isinstance(error, PermissionError) or status in (401, 403):
        return f"access denied ({describe(error)})"
    return f"permanent error: {describe(error)}"


def slowed_down(throttled: int) -> str:
    """For a give-up message: how many answers asked to slow down (spending no attempt)."""
    return f" and {throttled} answers to slow down" if throttled else ""


def pause(delay: float, url: str, cancel: threading.Event | None) -> None:
    """Wait `delay` seconds before a retry; FetchCancelled as soon as `cancel` is set."""
    if cancel is not None:
        if cancel.wait(delay):
            raise FetchCancelled(url)
    elif delay > 0:
        time.sleep(delay)


def retrying(
    call: Callable[[], T],
    url: str,
    *,
    policy: RetryPolicy | None = None,
    rng: random.Random | None = None,
    passthrough: tuple[type[BaseException], ...] = (FileNotFoundError,),
) -> T:
    """What `call()` returns, calling it again after transient errors with `policy`'s backoff.

    Only for calls that are safe to repeat whole (reads, listings, whole-object puts). Errors
    of the `passthrough` types are raised unchanged (callers give a missing object their own
    message); other permanent errors and exhausted retries raise FetchError naming `url`.
    """
    policy = policy or RetryPolicy()
    rng = rng or random.Random()
    start = time.monotonic()
    failures = throttled = 0
    while True:
        STALLS.check([url], policy)
        started = time.monotonic()
        try:
            value = call()
            STALLS.record(url, started, answered=True, timed_out=False)
            return value
        except passthrough:
            STALLS.record(url, started, answered=True, timed_out=False)  # e.g. a 404: an answer
            raise
        except Exception as e:
            STALLS.record(url, started, answered=answered(e), timed_out=is_timeout(e))
            if not is_transient(e):
                raise FetchError(f"{url}: {permanent_reason(e)}") from e
            if is_throttle(e):
                throttled += 1
            else:
                failures += 1
            delay = policy.backoff(failures + throttled - 1, rng)
            if failures >= policy.attempts or time.monotonic() + delay - start > policy.deadline:
                raise FetchError(
                    f"{url}: giving up after {failures} failed attempts{slowed_down(throttled)}; "
                    f"last error: {describe(e)}") from e
            STALLS.check([url], policy, delay)
            pause(delay, url, None)
