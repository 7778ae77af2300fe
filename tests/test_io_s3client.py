"""The standard-library S3 client of the read path (shardloader.io.s3client): when it is used,
that its signatures are botocore's, and against moto's real server (directly and behind the
fault proxy) that it returns exact bytes, fails as s3fs does for the retry rules of
shardloader.io.retry, and starts afresh in a forked child."""

from __future__ import annotations

import datetime
import os
import random

import pytest

from shardloader.errors import FetchError
from shardloader.io.checksum import checksum_bytes
from shardloader.io.clients import filesystem
from shardloader.io.retry import RetryPolicy
from shardloader.io.s3client import S3Reader, s3_settings, signed_headers
from shardloader.io.transfer import download, read_bytes
from tests.fixtures.servers import Fault, always, seeded
from tests.proctree import answer_from_fork

FAST = RetryPolicy(attempts=8, base_delay=0.005, max_delay=0.02, deadline=30)
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
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        stats = download(fs, path, obj, fd, size=len(PAYLOAD), checksum=checksum_bytes(PAYLOAD),
                         policy=FAST, chunk_size=16 << 10, parallel=4)
    finally:
        os.close(fd)
    proxy.settled()
    assert (tmp_path / "out").read_bytes() == PAYLOAD
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
