"""A small S3 client for the read path: signed GETs (whole objects and byte ranges) over pooled
keep-alive connections, with nothing to import but the standard library.

Why not s3fs here. A cold first batch in a fresh process paid, before its first byte:
`import s3fs` (aiobotocore, aiohttp, botocore: 0.19-0.27 s measured on the 2-core benchmark
machine) and building the client plus its first request (botocore loads S3's service model,
resolves endpoints and credentials: 0.10 s), then in every forked worker a client of its own
again (13 ms with the inherited session). This module imports in 0 ms on top of what the
package already loads, answers its first request in ~5 ms, and costs ~0.5 ms of client CPU per
request, the same as obstore (Rust, what litdata uses) measured on the same loopback server
(64 concurrent 15 kB range reads: 27-38 ms CPU vs 27-31 ms). obstore was not taken: besides
being a new binary dependency, its client used in a child forked after the parent used it
hangs (obstore 0.12.1, measured), and our workers are forked.

Scope. Only reads (`cat_file`, `cat_ranges`, and `read_ranges_into`, which streams ranges
straight into a file: the calls `shardloader.io.transfer` makes), and
only when everything that decides how to reach the bucket is explicit and simple:
`s3_reader` returns None (the caller then uses s3fs, exactly as before) unless the storage
options use nothing but ``key``/``secret``/``token``/``anon``/``endpoint_url``,
``client_kwargs`` {``endpoint_url``, ``region_name``} and ``config_kwargs``
{``connect_timeout``, ``read_timeout``, ``retries``, ``max_pool_connections``}, the
credentials are in the options or in ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``
(botocore's first provider, so the same ones botocore would use; ``AWS_CA_BUNDLE`` is honoured
as botocore does), no AWS profile or config file could change endpoint, region or addressing, no
HTTP proxy is set in the environment, and either an endpoint or a region is known.
``SHARDLOADER_S3_CLIENT=fsspec`` turns it off. Retries are not done here: a failed request is
an exception (with `.status` for HTTP errors, FileNotFoundError for 404, PermissionError for
401/403) that `shardloader.io.transfer` classifies and retries with its own backoff, as it does
for s3fs (whose botocore retries the test and benchmark options turn off too).

Fork. A client belongs to the process that made it: a forked child gets a new one (its own
connections and threads) from `shardloader.io.clients.filesystem`, keyed by pid.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import hmac
import http.client
import os
import queue
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shardloader.io.retry import ShortRead
from shardloader.io.s3_body import BodyReader, LocalWriteError, RangeCopy, read_whole

DISABLE_ENV = "SHARDLOADER_S3_CLIENT"
_OPTION_KEYS = frozenset({"key", "secret", "token", "anon", "endpoint_url", "client_kwargs",
                          "config_kwargs"})
_CLIENT_KEYS = frozenset({"endpoint_url", "region_name"})
_CONFIG_KEYS = frozenset({"connect_timeout", "read_timeout", "retries", "max_pool_connections"})
#: Environment that could make botocore reach S3 differently from what is decided here.
_AWS_CONFIG_ENV = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CONFIG_FILE", "AWS_ENDPOINT_URL",
                   "AWS_ENDPOINT_URL_S3", "AWS_S3_ADDRESSING_STYLE",
                   "AWS_USE_FIPS_ENDPOINT", "AWS_USE_DUALSTACK_ENDPOINT",
                   # botocore goes through the proxies these name; this client connects directly
                   "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
#: The SHA-256 of an empty body: a GET's payload hash, as botocore signs it.
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class S3HTTPError(OSError):
    """An S3 answer other than 200/206 (`status`, the URL and S3's error code in the text)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class S3ConnectionError(ConnectionError):
    """The connection failed or broke mid-answer (reset, truncated body, protocol error)."""


@dataclass(frozen=True)
class S3Settings:
    """How to reach the bucket: endpoint (scheme://host[:port]), path- or host-style, region,
    credentials (None: anonymous), timeouts and pool size."""

    endpoint: str | None
    region: str
    key: str | None
    secret: str | None
    token: str | None
    connect_timeout: float
    read_timeout: float
    pool: int
    ca_bundle: str | None = None  # AWS_CA_BUNDLE, as botocore: the CAs that verify https


def s3_settings(storage_options: dict[str, Any], environ: Any = os.environ,
                config_file: str | None = None) -> S3Settings | None:
    """The settings for `storage_options`, or None when this client should not be used (see the
    module docstring); pure apart from reading `environ` and whether `config_file` exists."""
    if environ.get(DISABLE_ENV, "").lower() in ("fsspec", "s3fs", "off", "0"):
        return None
    options = dict(storage_options)
    client = dict(options.get("client_kwargs") or {})
    config = dict(options.get("config_kwargs") or {})
    if set(options) - _OPTION_KEYS or set(client) - _CLIENT_KEYS or set(config) - _CONFIG_KEYS:
        return None
    if any(environ.get(name) for name in _AWS_CONFIG_ENV):
        return None
    config_file = config_file or os.path.join(os.path.expanduser("~"), ".aws", "config")
    if os.path.exists(config_file):
        return None
    anon = bool(options.get("anon", False))
    key, secret, token = options.get("key"), options.get("secret"), options.get("token")
    if not anon and not (key and secret):
        if key or secret or token:
            return None  # partial credentials: let botocore say what is wrong
        key, secret = environ.get("AWS_ACCESS_KEY_ID"), environ.get("AWS_SECRET_ACCESS_KEY")
        token = environ.get("AWS_SESSION_TOKEN") or environ.get("AWS_SECURITY_TOKEN")
        if not (key and secret):
            return None  # credentials from a file, SSO, instance metadata...: botocore's chain
    endpoint = client.get("endpoint_url") or options.get("endpoint_url")
    region = client.get("region_name") or environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")
    if not endpoint and not region:
        return None  # s3fs finds the bucket's region itself
    if endpoint:
        parts = urllib.parse.urlsplit(str(endpoint))
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path.strip("/"):
            return None
        endpoint = f"{parts.scheme}://{parts.netloc}"
    return S3Settings(
        endpoint=endpoint, region=str(region or "us-east-1"),
        key=None if anon else str(key), secret=None if anon else str(secret),
        token=None if anon or not token else str(token),
        connect_timeout=float(config.get("connect_timeout", 60)),
        read_timeout=float(config.get("read_timeout", 60)),
        pool=max(1, int(config.get("max_pool_connections", 10))),
        ca_bundle=environ.get("AWS_CA_BUNDLE") or None,
    )


# -- signing (AWS Signature Version 4, for S3 GETs) --------------------------------------------
def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def signed_headers(method: str, host: str, path: str, region: str, key: str, secret: str,
                   token: str | None, headers: dict[str, str], now: datetime.datetime) -> dict[str, str]:
    """`headers` plus the SigV4 ones for a request without a body (`path` already encoded; no
    query string). Pure: a function of its arguments only."""
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    day = stamp[:8]
    out = {k.lower(): v for k, v in headers.items()}
    out.update({"host": host, "x-amz-date": stamp, "x-amz-content-sha256": _EMPTY_SHA256})
    if token:
        out["x-amz-security-token"] = token
    names = sorted(out)
    canonical = "\n".join([method, path, "", "".join(f"{n}:{out[n].strip()}\n" for n in names),
                           ";".join(names), _EMPTY_SHA256])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    signing_key = _hmac(_hmac(_hmac(_hmac(("AWS4" + secret).encode(), day), region), "s3"), "aws4_request")
    signature = hmac.new(signing_key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["authorization"] = (f"AWS4-HMAC-SHA256 Credential={key}/{scope}, "
                            f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return out


# -- threads -----------------------------------------------------------------------------------
class _DaemonThreads:
    """Runs calls in up to `size` daemon threads, started as needed. Not a ThreadPoolExecutor:
    its threads are joined without limit at interpreter exit, so one request stuck on a silent
    server would hold up the exit (requests are bounded by the read timeout, still too long)."""

    def __init__(self, size: int, name: str) -> None:
        self.size, self.name = size, name
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
        8 MiB) until the thread's next call: with up to `size` (64) threads per client, 176 MiB
        of bodies stayed alive in the training process after a remote epoch of 20k images."""
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


# -- the client --------------------------------------------------------------------------------
class S3Reader:
    """GETs of objects given as ``bucket/key`` paths (fsspec's convention for s3 URLs), with the
    part of fsspec's filesystem interface that `shardloader.io.transfer` uses."""

    protocol = "s3"

    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings
        self._pid = os.getpid()
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._threads = _DaemonThreads(settings.pool, "shardloader-s3")
        self._region = settings.region
        self._ssl: ssl.SSLContext | None = None

    # fsspec's interface (the parts used) ------------------------------------------------------
    @staticmethod
    def _strip_protocol(url: str) -> str:
        for prefix in ("s3://", "s3a://"):
            if url.startswith(prefix):
                url = url[len(prefix):]
        return url.rstrip("/")

    def cat_file(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes (or [start, end)); raises as the module docstring says."""
        return self._get(self._strip_protocol(path), start, end)

    def cat_ranges(self, paths: Sequence[str], starts: Sequence[int], ends: Sequence[int],
                   on_error: str = "return", **_: Any) -> list[Any]:
        """Bytes [start, end) of each path, requested concurrently; with `on_error="return"`
        a failed range's exception takes its place in the list."""
        if not (len(paths) == len(starts) == len(ends)):
            raise ValueError("cat_ranges: paths, starts and ends differ in length")
        if len(paths) == 1:
            calls = [self._result(paths[0], starts[0], ends[0])]
        else:
            futures = [self._threads.submit(lambda p=p, s=s, e=e: self._get(self._strip_protocol(p), s, e))
                       for p, s, e in zip(paths, starts, ends)]
            calls = [_outcome(f) for f in futures]
        if on_error != "return":
            for outcome in calls:
                if isinstance(outcome, BaseException):
                    raise outcome
        return calls

    def _result(self, path: str, start: int, end: int) -> Any:
        try:
            return self._get(self._strip_protocol(path), start, end)
        except Exception as e:  # noqa: BLE001 - returned, as cat_ranges does
            return e

    def read_ranges_into(self, path: str, ranges: Sequence[tuple[int, int]], fd: int,
                         buffer_size: int = 1 << 20) -> list[int | BaseException]:
        """Bytes [start, end) of object `path` for each range, written at offset `start` of
        file `fd`, the ranges requested concurrently on this client's threads; in place of
        each range, the bytes written (always end - start) or the exception it failed with
        (as `cat_ranges(on_error="return")`). See `read_range_into`."""
        calls = [lambda lo=lo, hi=hi: self.read_range_into(path, lo, hi, fd, lo, buffer_size)
                 for lo, hi in ranges]
        if len(calls) == 1:
            return [_called(calls[0])]
        return [_outcome(f) for f in [self._threads.submit(call) for call in calls]]

    def read_range_into(self, path: str, start: int, end: int, fd: int, file_offset: int,
                        buffer_size: int = 1 << 20) -> int:
        """Copy bytes [start, end) of object `path` into file `fd` from `file_offset` on, as the
        response arrives, through one buffer of `buffer_size` bytes; returns the bytes written
        (end - start).

        Why: read whole (`cat_ranges`), a download's 8 MiB ranges were as many 8 MiB bodies in
        the training process at once, and freeing them raised glibc's mmap threshold so that
        later bodies came from per-thread arenas that kept 6-14 MiB each (~100 MiB more anonymous
        memory after a remote epoch). The buffer is an anonymous mmap, given back to the system
        when the call ends, so it moves no malloc threshold either.

        Raises as `cat_file` does (FileNotFoundError, PermissionError, S3HTTPError,
        S3ConnectionError, TimeoutError); a body that ends early is a ShortRead, as the range
        check of `shardloader.io.transfer` reports one, and an error writing `fd` is raised
        unchanged. A server that ignores the Range header (200 with the whole object) works:
        the bytes before `start` are skipped. After an error the file's bytes in the range are
        undefined."""
        if end <= start:
            return 0
        headers = {"range": f"bytes={start}-{end - 1}"}
        copy = RangeCopy(fd, start, end, file_offset, buffer_size)
        status, reason, body = self._fetch(path, headers, copy)
        if status in (200, 206):
            return copy.written
        self._raise_for(path, status, reason, body)
        raise AssertionError("unreachable")

    # requests ---------------------------------------------------------------------------------
    def _where(self, path: str) -> tuple[str, str, str]:
        """(scheme, host, encoded request path) of object ``bucket/key``."""
        bucket, _, key = path.partition("/")
        if not bucket or not key:
            raise FileNotFoundError(f"s3://{path}: not an object path (bucket/key)")
        quoted = urllib.parse.quote(key, safe="/~")
        endpoint = self.settings.endpoint
        if endpoint:  # path style: what S3-compatible servers (MinIO, Ceph, moto) all accept
            scheme, host = endpoint.split("://", 1)
            return scheme, host, f"/{bucket}/{quoted}"
        if "." in bucket:  # a dotted name breaks the TLS wildcard of the virtual host
            return "https", f"s3.{self._region}.amazonaws.com", f"/{bucket}/{quoted}"
        return "https", f"{bucket}.s3.{self._region}.amazonaws.com", f"/{quoted}"

    def _get(self, path: str, start: int | None, end: int | None) -> bytes:
        if start is not None and end is not None and end <= start:
            return b""
        headers = {}
        if start is not None or end is not None:
            lo = start or 0
            headers["range"] = f"bytes={lo}-" + ("" if end is None else str(end - 1))
        status, reason, body = self._fetch(path, headers, read_whole)
        if status in (200, 206):
            return body
        self._raise_for(path, status, reason, body)
        raise AssertionError("unreachable")

    def _fetch(self, path: str, headers: dict[str, str], read: BodyReader) -> tuple[int, str, bytes]:
        """(status, reason, body) of a signed GET of `path`, its body read by `read` (for 200
        and 206; an error's body is read whole), after following a region redirect."""
        for _ in range(2):  # a second time only after a region redirect
            scheme, host, target = self._where(path)
            if self.settings.key is not None:
                sent = signed_headers("GET", host, target, self._region, self.settings.key,
                                      self.settings.secret or "", self.settings.token, headers,
                                      datetime.datetime.now(datetime.timezone.utc))
            else:
                sent = {**headers, "host": host}
            status, reason, answer, body = self._request(scheme, host, target, sent, read)
            if status in (200, 206):
                return status, reason, body
            region = answer.get("x-amz-bucket-region")
            if status in (301, 307, 400) and region and region != self._region and not self.settings.endpoint:
                self._region = region  # the bucket lives elsewhere: sign for its region
                continue
            break
        return status, reason, body

    @staticmethod
    def _raise_for(path: str, status: int, reason: str, body: bytes) -> None:
        """Raise the exception for an answer other than 200/206 to a GET of `path`."""
        url = f"s3://{path}"
        code = _error_code(body)
        message = f"{url}: HTTP {status} {reason}" + (f" ({code})" if code else "")
        if status == 404:
            raise FileNotFoundError(message)
        if status in (401, 403):
            error = PermissionError(message)
            error.status = status  # type: ignore[attr-defined]
            raise error
        raise S3HTTPError(status, message)

    def _request(self, scheme: str, host: str, target: str, headers: dict[str, str],
                 read: BodyReader) -> tuple[int, str, dict[str, str], bytes]:
        """(status, reason, lowercased headers, body) of one GET on a pooled connection. A
        kept-alive connection the server had closed is replaced at once, unless `read` has
        already written part of the body somewhere (then the error is the caller's)."""
        for attempt in range(2):
            conn, reused = self._connection(scheme, host)
            try:
                conn.request("GET", target, headers=headers)
                response = conn.getresponse()
                status, reason = response.status, response.reason
                answer = {k.lower(): v for k, v in response.getheaders()}
                if status in (200, 206):
                    body, whole = read(response, status)
                else:
                    body, whole = response.read(), True
            except LocalWriteError as e:
                conn.close()
                raise e.error from None  # the disk's error, as is (ENOSPC: a refusal)
            except ShortRead:
                conn.close()
                raise
            except (http.client.HTTPException, OSError) as e:
                conn.close()
                stale = reused and isinstance(e, (http.client.RemoteDisconnected, BrokenPipeError,
                                                  ConnectionResetError))
                if stale and not attempt and not (isinstance(read, RangeCopy) and read.written):
                    continue  # the server closed an idle kept-alive connection: a new one, at once
                if isinstance(e, TimeoutError):
                    raise
                raise S3ConnectionError(f"{scheme}://{host}{target}: {type(e).__name__}: {e}") from e
            if response.will_close or not whole:
                conn.close()
            else:
                self._give_back(scheme, host, conn)
            return status, reason, answer, body
        raise AssertionError("unreachable")

    def _connection(self, scheme: str, host: str) -> tuple[http.client.HTTPConnection, bool]:
        """A kept-alive connection to `host` (True) or a new one (False)."""
        if self._pid != os.getpid():  # never a parent's socket or thread in a forked child
            raise RuntimeError("S3Reader used in a forked child; make one per process")
        with self._lock:
            idle = self._idle.get(f"{scheme}://{host}")
            if idle:
                return idle.pop(), True
        s = self.settings
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context(cafile=s.ca_bundle)
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, timeout=s.connect_timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(host, timeout=s.connect_timeout)
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(s.read_timeout)
        return conn, False

    def _give_back(self, scheme: str, host: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(f"{scheme}://{host}", [])
            if len(idle) < self.settings.pool:
                idle.append(conn)
                return
        conn.close()

    def __repr__(self) -> str:
        return f"S3Reader(endpoint={self.settings.endpoint!r}, region={self._region!r})"


def _called(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - returned in place of the range
        return e


def _outcome(future: concurrent.futures.Future[Any]) -> Any:
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001 - returned in place of the range
        return e


def _error_code(body: bytes) -> str:
    """S3's error code from an XML error body (``<Code>NoSuchKey</Code>``), else ''."""
    start = body.find(b"<Code>")
    end = body.find(b"</Code>", start)
    if start < 0 or end < 0:
        return ""
    return body[start + 6:end].decode("utf-8", "replace")[:80]


def s3_reader(url: str, storage_options: dict[str, Any]) -> S3Reader | None:
    """This module's client for `url` (s3:// or s3a://) and `storage_options`, or None when
    s3fs must be used (see the module docstring)."""
    if not url.startswith(("s3://", "s3a://")):
        return None
    settings = s3_settings(storage_options)
    return S3Reader(settings) if settings is not None else None
