"""The standard-library S3 client of the read path (shardloader.io.s3client): when it is used,
that its signatures are botocore's, and against moto's real server (directly and behind the
fault proxy) that it returns exact bytes, fails as s3fs does for the retry rules of
shardloader.io.retry, and starts afresh in a forked child."""

from __future__ import annotations

import datetime
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
from shardloader.io.s3client import S3Reader, s3_settings, signed_headers
from shardloader.io.transfer import download, read_bytes
from tests.fixtures.servers import Fault, _RangeHandler, always, first, seeded
from tests.proctree import answer_from_fork

FAST = RetryPolicy(attempts=8, base_delay=0.005, max_delay=0.02, deadline=30)
MIB = 1 << 20
PAYLOAD = random.Random(11).randbytes(200_000)
EXPLICIT = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9",
                                                          "region_name": "eu-west-1"}}


# -- when it is used ---------------------------------------------------------------------------
def test_settings_from_explicit_options(tmp_path):
    s = s3_settings({**EXPLICIT, "config_kwargs": {"read_timeout": 7, "max_pool_connections": 5}},
                    environ={}, config_file=str(tmp_path / "none"))
    assert s is not None
    assert (s.endpoint, s.region, s.key, s.secret, s.token, s.read_timeout, s.pool) == (
        "http://127.0.0.1:9", "eu-west-1", "k", "s", None, 7.0, 5)


@pytest.mark.parametrize("options, environ, why", [
    ({**EXPLICIT, "requester_pays": True}, {}, "an option it does not know"),
    ({**EXPLICIT, "client_kwargs": {"endpoint_url": "http://h", "verify": False}}, {}, "a client option"),
    ({**EXPLICIT}, {"AWS_PROFILE": "p"}, "a profile could change the endpoint"),
    ({**EXPLICIT}, {"SHARDLOADER_S3_CLIENT": "fsspec"}, "turned off"),
    ({**EXPLICIT}, {"HTTPS_PROXY": "http://proxy:3128"}, "botocore would go through the proxy"),
    ({"key": "k"}, {}, "partial credentials"),
    ({"client_kwargs": {"region_name": "us-east-1"}}, {}, "no credentials: botocore's chain"),
    ({"key": "k", "secret": "s"}, {}, "no endpoint, no region: s3fs finds the region"),
])
def test_s3fs_is_used_when_this_client_could_differ(options, environ, why, tmp_path):
    assert s3_settings(options, environ=environ, config_file=str(tmp_path / "none")) is None, why


def test_settings_take_environment_credentials_and_refuse_a_config_file(tmp_path):
    env = {"AWS_ACCESS_KEY_ID": "ek", "AWS_SECRET_ACCESS_KEY": "es", "AWS_SESSION_TOKEN": "et",
           "AWS_DEFAULT_REGION": "ap-south-1"}
    s = s3_settings({}, environ=env, config_file=str(tmp_path / "none"))
    assert s is not None and (s.key, s.secret, s.token, s.region, s.endpoint) == ("ek", "es", "et", "ap-south-1", None)
    (tmp_path / "config").write_text("[default]\n")
    assert s3_settings({}, environ=env, config_file=str(tmp_path / "config")) is None
    assert s3_settings({"anon": True, "endpoint_url": "https://e.example"}, environ={},
                       config_file=str(tmp_path / "none")).key is None


@pytest.mark.parametrize("key, token, headers", [
    ("data/shard-00001.arrow", None, {"range": "bytes=100-199"}),
    ("a b/ü+x=y~z.bin", "session-token", {}),
])
def test_signatures_are_botocores(key, token, headers, monkeypatch):
    import botocore.auth
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    now = datetime.datetime(2026, 11, 30, 23, 59, 58, tzinfo=datetime.timezone.utc)
    reader = S3Reader(s3_settings({**EXPLICIT, "token": token} if token else EXPLICIT, environ={},
                                  config_file="/nonexistent"))
    _, host, target = reader._where(f"bucket/{key}")
    ours = signed_headers("GET", host, target, "eu-west-1", "k", "s", token, headers, now)
    request = AWSRequest(method="GET", url=f"http://{host}{target}", headers=dict(headers))
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: now.replace(tzinfo=None))
    signer = S3SigV4Auth(Credentials("k", "s", token), "s3", "eu-west-1")
    signer.add_auth(request)
    assert ours["authorization"] == request.headers["Authorization"]


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


def test_a_kept_alive_connection_the_server_closed_is_replaced_at_once(tmp_path, http_server):
    import socket

    (tmp_path / "bucket").mkdir()
    (tmp_path / "bucket" / "blob.bin").write_bytes(PAYLOAD)
    server = http_server(str(tmp_path))  # HTTP/1.1 keep-alive, ranges; S3 paths: /bucket/key
    reader = S3Reader(s3_settings({"anon": True, "endpoint_url": server.url}, environ={},
                                  config_file=str(tmp_path / "none")))
    assert reader.cat_file("s3://bucket/blob.bin", 10, 20) == PAYLOAD[10:20]
    (idle,) = reader._idle.values()
    assert len(idle) == 1  # kept for the next request
    idle[0].sock.shutdown(socket.SHUT_RDWR)  # as a server closing an idle connection does
    assert reader.cat_file("s3://bucket/blob.bin") == PAYLOAD  # no error, no retry round
    (idle,) = reader._idle.values()
    assert len(idle) == 1 and idle[0].sock is not None


# -- ranges streamed into the file (read_range_into) -------------------------------------------
class _FileHandler(_RangeHandler):
    """The range file server, sending in 64 KiB steps (so that its own allocations stay far
    below a download chunk in this process's tracemalloc), optionally ignoring Range headers
    (200 with the whole file, as some servers do) or ending the body after `cut` bytes with a
    clean close (a short body, not a reset)."""

    ignore_range = False
    cut: int | None = None

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
        if self.cut is not None:
            self.close_connection = True


class _QuietServer(ThreadingHTTPServer):
    """A client that gives up on a cut or slow response resets its connection on purpose: that
    is no server error to print (socketserver prints a traceback for it). Others still print."""

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture
def file_server(tmp_path):
    """(serve(payload, **handler settings) -> S3Reader of s3://bucket/blob.bin, requests)."""
    servers, seen = [], []

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
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
        servers.append(server)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        return S3Reader(s3_settings({"anon": True, "endpoint_url": url}, environ={},
                                    config_file=str(tmp_path / "none")))

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
