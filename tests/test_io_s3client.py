"""The S3 read path (shardloader.io.s3client, botocore's client): which storage options it
serves, and against moto's real server (directly and behind the fault proxy) that it returns
exact bytes, fails as the retry rules of shardloader.io.retry expect, and starts afresh in a
forked child. Credentials from every source, with refresh, are tests/test_io_s3_credentials.py."""

from __future__ import annotations

import os
import random
import sys
import threading
import tracemalloc
from http.server import ThreadingHTTPServer

import pytest

from shardloader.errors import FetchError
from shardloader.io.checksum import checksum_bytes
from shardloader.io.clients import filesystem
from shardloader.io.retry import RetryPolicy, ShortRead
from shardloader.io.s3client import S3Reader, s3_options
from shardloader.io.transfer import download, read_bytes
from tests.fixtures.servers import Fault, _RangeHandler, always, first, seeded
from tests.proctree import answer_from_fork

FAST = RetryPolicy(attempts=8, base_delay=0.005, max_delay=0.02, deadline=30)
MIB = 1 << 20
PAYLOAD = random.Random(11).randbytes(200_000)
EXPLICIT = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9",
                                                          "region_name": "eu-west-1"}}


# -- which options it serves, and how they reach botocore ---------------------------------------
def test_options_map_onto_botocores_client_and_request():
    o = s3_options({**EXPLICIT, "token": "t", "requester_pays": True,
                    "config_kwargs": {"read_timeout": 7, "max_pool_connections": 5},
                    "s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256"}}, environ={})
    assert o is not None and o.profile is None and not o.anon
    assert o.client == {"endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-1",
                        "aws_access_key_id": "k", "aws_secret_access_key": "s",
                        "aws_session_token": "t"}
    assert o.config == {"read_timeout": 7, "max_pool_connections": 5,
                        "retries": {"total_max_attempts": 1, "mode": "adaptive"}}  # see below
    assert o.request == {"SSECustomerAlgorithm": "AES256", "RequestPayer": "requester"}


@pytest.mark.parametrize("options", [
    {}, {"profile": "training"}, {"anon": True}, {"client_kwargs": {"verify": False}},
    {"key": "k"}, {"skip_instance_cache": True, "use_listings_cache": False},
])
def test_every_credential_source_and_client_option_takes_this_path(options):
    """No option that only says where credentials come from (nothing: botocore's chain; a
    profile; anonymous), nor a client setting, sends a user to s3fs."""
    o = s3_options(options, environ={"AWS_PROFILE": "p", "HTTPS_PROXY": "http://proxy:3128"})
    assert o is not None
    assert o.profile == options.get("profile") and o.anon == bool(options.get("anon"))


@pytest.mark.parametrize("options, environ", [
    ({"session": object()}, {}),
    ({**EXPLICIT}, {"SHARDLOADER_S3_CLIENT": "fsspec"}),
])
def test_s3fs_serves_only_what_botocore_cannot_be_given(options, environ):
    assert s3_options(options, environ=environ) is None


# -- against moto ------------------------------------------------------------------------------
@pytest.fixture
def obj(s3_server, s3_bucket):
    s3_server.put(s3_bucket, "dir/blob.bin", PAYLOAD)
    return f"s3://{s3_bucket}/dir/blob.bin"


def test_reads_exact_bytes_and_ranges(obj, s3_server):
    fs, path = filesystem(obj, s3_server.storage_options())
    assert isinstance(fs, S3Reader)
    assert fs.cat_file(path) == PAYLOAD
    starts = [0, 5, 199_990, 1000, 77_777]
    ends = [10, 5, 200_000, 61_000, 77_778]
    assert fs.cat_ranges([path] * 5, starts, ends) == [PAYLOAD[a:b] for a, b in zip(starts, ends)]


def test_missing_objects_and_refusals_fail_as_fetch_expects(obj, s3_server, fault_proxy, tmp_path):
    opts = s3_server.storage_options()
    with pytest.raises(FileNotFoundError, match="blob-none.bin: HTTP 404"):
        read_bytes(obj.replace("blob.bin", "blob-none.bin"), opts, policy=FAST)
    proxy = fault_proxy(s3_server.endpoint, always(Fault("status", status=403), match=lambda *a: True))
    with pytest.raises(FetchError, match="access denied"):
        read_bytes(obj, s3_server.storage_options(proxy.url), policy=FAST)


def test_transient_faults_are_retried_to_the_exact_bytes(obj, s3_server, fault_proxy, tmp_path):
    proxy = fault_proxy(s3_server.endpoint, seeded(0.3, 5, [
        Fault("status", status=503), Fault("reset"), Fault("truncate"), Fault("status", status=500),
    ]))
    fs, path = filesystem(obj, s3_server.storage_options(proxy.url))
    assert isinstance(fs, S3Reader)
    stats, data = _download(fs, tmp_path, PAYLOAD, chunk=16 << 10, path=path)
    proxy.settled()
    assert data == PAYLOAD
    assert proxy.faults() and stats.retries >= 1


def _read_in_child(obj: str, options: dict, conn) -> None:
    fs, path = filesystem(obj, options)
    conn.send((os.getpid(), id(fs), fs.cat_ranges([path, path], [0, 100], [50, 300])))


def test_a_forked_child_reads_with_a_client_of_its_own(obj, s3_server):
    opts = s3_server.storage_options()
    fs, path = filesystem(obj, opts)
    assert fs.cat_ranges([path, path], [0, 1], [2, 3]) == [PAYLOAD[:2], PAYLOAD[1:3]]  # threads, pool
    child_pid, (pid, client, data) = answer_from_fork(_read_in_child, obj, opts)
    assert pid == child_pid and client != id(fs)
    assert data == [PAYLOAD[:50], PAYLOAD[100:300]]
    assert fs.cat_file(path) == PAYLOAD  # the parent's client still works


def test_a_kept_alive_connection_the_server_closed_is_replaced_at_once(file_server):
    # The server closes each connection after its answer without saying so (as a server
    # closing an idle kept-alive connection does): the next GET goes out on a new connection
    # at once, with no error and no second request.
    serve, seen = file_server
    reader = serve(PAYLOAD, drop_after_answer=True)
    (server,) = serve.servers
    for lo, hi in ((10, 20), (None, None), (5, 6)):
        assert reader.cat_file("s3://bucket/blob.bin", lo, hi) == PAYLOAD[lo:hi]
        assert server.closed.acquire(timeout=10)  # the server closed it, the client kept it
    assert seen == ["bytes=10-19", None, "bytes=5-5"]


# -- ranges streamed into the file (read_range_into) -------------------------------------------
class _FileHandler(_RangeHandler):
    """The range file server, sending in 64 KiB steps (so that its own allocations stay far
    below a download chunk in this process's tracemalloc), optionally ignoring Range headers
    (200 with the whole file, as some servers do) or ending the body after `cut` bytes with a
    clean close (a short body, not a reset)."""

    ignore_range = False
    cut: int | None = None
    drop_after_answer = False

    def send_head(self):
        if self.ignore_range:
            del self.headers["Range"]
        return super().send_head()

    def copyfile(self, source, outputfile) -> None:
        remaining = self._remaining if self.cut is None else min(self.cut, self._remaining)
        while remaining > 0:
            chunk = source.read(min(64 << 10, remaining))
            outputfile.write(chunk)
            remaining -= len(chunk)
        if self.cut is not None or self.drop_after_answer:
            self.close_connection = True


class _QuietServer(ThreadingHTTPServer):
    """A client that gives up on a cut or slow response resets its connection on purpose: that
    is no server error to print (socketserver prints a traceback for it). Others still print."""

    closed = threading.Semaphore(0)  # released each time the server has closed a connection

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def shutdown_request(self, request) -> None:
        super().shutdown_request(request)
        self.closed.release()


@pytest.fixture
def file_server(tmp_path):
    """(serve(payload, **handler settings) -> S3Reader of s3://bucket/blob.bin, requests)."""
    servers, seen = [], []
    servers_by_reader: list[_QuietServer] = []

    def serve(payload: bytes, **settings) -> S3Reader:
        (tmp_path / "bucket").mkdir(exist_ok=True)
        (tmp_path / "bucket" / "blob.bin").write_bytes(payload)

        class Handler(_FileHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(tmp_path), **kwargs)

            def send_head(self):
                seen.append(self.headers.get("Range"))
                return super().send_head()

        for key, value in settings.items():
            setattr(Handler, key, value)
        server = _QuietServer(("127.0.0.1", 0), Handler)
        server.closed = threading.Semaphore(0)
        servers_by_reader.append(server)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
        servers.append(server)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        return S3Reader(s3_options({"anon": True, "endpoint_url": url}, environ={}))

    serve.servers = servers_by_reader  # type: ignore[attr-defined]
    yield serve, seen
    for server in servers:
        server.shutdown()
        server.server_close()


def _download(fs, tmp_path, payload, *, chunk, parallel=4, checksum=None, path="bucket/blob.bin"):
    """`download` of object `path` (of `payload`'s size and checksum) into tmp_path/out: its
    stats and the file's bytes."""
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        stats = download(fs, path, f"s3://{path}", fd, size=len(payload),
                         checksum=checksum or checksum_bytes(payload), policy=FAST,
                         chunk_size=chunk, parallel=parallel)
    finally:
        os.close(fd)
    return stats, (tmp_path / "out").read_bytes()


def test_a_download_streams_each_range_into_the_file(obj, s3_server, s3_bucket, tmp_path):
    # Through moto: exact bytes, odd range sizes, offsets, and a last short range.
    payload = random.Random(5).randbytes(3 * MIB + 12_345)
    s3_server.put(s3_bucket, "big.bin", payload)
    fs, path = filesystem(f"s3://{s3_bucket}/big.bin", s3_server.storage_options())
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        assert fs.read_range_into(path, 1000, 1000 + 2 * MIB + 7, fd, 5, buffer_size=300_001) == 2 * MIB + 7
        assert os.pread(fd, 2 * MIB + 20, 0)[5:] == payload[1000:1000 + 2 * MIB + 7]
        stats = download(fs, path, "s3://x", fd, size=len(payload), checksum=checksum_bytes(payload),
                         policy=FAST, chunk_size=MIB - 1, parallel=3)
    finally:
        os.close(fd)
    assert (tmp_path / "out").read_bytes() == payload
    assert stats.bytes_received == len(payload) and stats.retries == 0


def test_no_range_body_is_held_whole_in_memory(file_server, tmp_path):
    serve, seen = file_server
    payload = random.Random(3).randbytes(32 * MIB)
    fs = serve(payload)
    assert fs.cat_file("bucket/blob.bin", 0, 1) == payload[:1]  # botocore's models loaded
    seen.clear()
    tracemalloc.start()
    try:
        fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            tracemalloc.reset_peak()
            download(fs, "bucket/blob.bin", "s3://bucket/blob.bin", fd, size=len(payload),
                     checksum=checksum_bytes(payload), policy=FAST, chunk_size=8 * MIB, parallel=4)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            os.close(fd)
    finally:
        tracemalloc.stop()
    assert (tmp_path / "out").read_bytes() == payload
    assert len(seen) == 4 and all(seen)  # four concurrent 8 MiB ranges
    # Read whole, the four bodies alone were 32 MiB; streamed, a 1 MiB buffer per range (an
    # mmap, which tracemalloc does not even see) and the server's 64 KiB steps.
    assert peak < 2 * MIB + (512 << 10), f"peak {peak / MIB:.1f} MiB of Python allocations"


def test_a_short_body_is_a_short_read_and_transient(file_server, tmp_path):
    serve, seen = file_server
    fs = serve(PAYLOAD, cut=70_000)  # every body ends cleanly after 70 kB
    fd = os.open(tmp_path / "part", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with pytest.raises(ShortRead, match=r"range 0-199999 returned 70000 bytes instead of 200000"):
            fs.read_range_into("bucket/blob.bin", 0, 200_000, fd, 0)
    finally:
        os.close(fd)
    with pytest.raises(FetchError, match=r"giving up after 8 failed attempts; last error: ShortRead"):
        _download(fs, tmp_path, PAYLOAD, chunk=100_000)


def test_truncated_bodies_mid_range_are_retried_to_the_exact_bytes(obj, s3_server, fault_proxy, tmp_path):
    proxy = fault_proxy(s3_server.endpoint, first(2, Fault("truncate", fraction=0.5)))
    fs, path = filesystem(obj, s3_server.storage_options(proxy.url))
    stats, data = _download(fs, tmp_path, PAYLOAD, chunk=64 << 10, path=path)
    log = proxy.settled()
    assert data == PAYLOAD
    assert len(proxy.faults()) == 2 and stats.retries >= 1
    assert len(log) == 4 + 2  # ceil(200000 / 65536) ranges, the two truncated ones again
    assert stats.bytes_received == len(PAYLOAD)


def test_a_server_that_ignores_range_still_downloads_exactly(file_server, tmp_path):
    serve, seen = file_server
    fs = serve(PAYLOAD, ignore_range=True)
    stats, data = _download(fs, tmp_path, PAYLOAD, chunk=48 << 10, parallel=2)
    assert data == PAYLOAD and stats.retries == 0
    assert len(seen) == 5 and all(seen)  # ranges asked for, whole objects answered


def test_a_wrong_checksum_is_still_refused(file_server, tmp_path):
    serve, _ = file_server
    fs = serve(PAYLOAD)
    with pytest.raises(FetchError, match=r"checksum mismatch after 3 downloads"):
        _download(fs, tmp_path, PAYLOAD, chunk=64 << 10, checksum=checksum_bytes(PAYLOAD[::-1]))
