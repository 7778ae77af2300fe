"""Retries outside the read path: `shardloader.io.retry.retrying` and the helpers of
`shardloader.io.objects`, and the tools built on them over a real S3 server (moto) behind the
fault proxy: `index` and `verify` retry transient errors as the shard cache does and name the
URL of a permanent one; listings see what was written since, also through the one client per
process and options that `shardloader.io.clients` hands to everyone (checkpoint storage too)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from shardloader.checkpoint import Checkpointer
from shardloader.cli.main import main
from shardloader.errors import FetchError
from shardloader.ingest.indexer import index_dataset, list_shard_files
from shardloader.ingest.verify import verify_dataset
from shardloader.io.clients import filesystem
from shardloader.io.objects import object_exists, put_bytes, put_file
from shardloader.io.retry import RetryPolicy, retrying
from shardloader.io.s3client import S3Reader
from shardloader.source.index import load_index
from tests.fixtures.servers import Fault, always, first

FAST = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.002)
ANY_REQUEST = lambda method, path, headers: True  # noqa: E731


class Flaky:
    """A call that fails with the given errors first, then returns "done"; counts its calls."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


def _status_error(status: int) -> OSError:
    error = OSError(f"HTTP {status}")
    error.status = status  # type: ignore[attr-defined]
    return error


# -- the retry loop ----------------------------------------------------------------------------
def test_transient_errors_are_retried_until_the_call_succeeds():
    call = Flaky(_status_error(503), ConnectionResetError("reset"), TimeoutError("slow"))
    assert retrying(call, "s3://b/k", policy=FAST) == "done"
    assert call.calls == 4


def test_permanent_errors_name_the_url_and_are_not_retried():
    call = Flaky(_status_error(403))
    with pytest.raises(FetchError, match=r"^s3://b/k: access denied \(HTTP 403"):
        retrying(call, "s3://b/k", policy=FAST)
    assert call.calls == 1
    missing = Flaky(FileNotFoundError("b/k"))
    with pytest.raises(FileNotFoundError):  # unchanged: callers say what is missing
        retrying(missing, "s3://b/k", policy=FAST)
    assert missing.calls == 1


def test_retries_are_bounded_by_the_policy():
    call = Flaky(*[_status_error(500)] * 10)
    with pytest.raises(FetchError, match=r"s3://b/k: giving up after 4 failed attempts; last error: HTTP 500"):
        retrying(call, "s3://b/k", policy=FAST)
    assert call.calls == 4


def test_exists_raises_what_it_cannot_answer():
    class Denied:
        def invalidate_cache(self, path=None):
            pass

        def info(self, path):
            raise PermissionError("Forbidden")

    with pytest.raises(FetchError, match="s3://b/k: access denied"):
        object_exists(Denied(), "b/k", "s3://b/k", policy=FAST)


# -- one client per process and options --------------------------------------------------------
def test_full_interface_clients_are_fsspecs_and_shared(s3_server, s3_bucket):
    url, opts = f"s3://{s3_bucket}/ds", s3_server.storage_options()
    full, path = filesystem(url, opts, full_interface=True)
    assert not isinstance(full, S3Reader) and hasattr(full, "ls") and path == f"{s3_bucket}/ds"
    assert filesystem(url, dict(opts), full_interface=True)[0] is full
    reader, _ = filesystem(url, opts)
    assert isinstance(reader, S3Reader) and filesystem(url, opts)[0] is reader


def test_a_listing_sees_objects_written_since_the_last_one(s3_server, s3_bucket):
    s3_server.put(s3_bucket, "ds/a.tar", b"a")
    url, opts = f"s3://{s3_bucket}/ds", s3_server.storage_options()
    assert list_shard_files(url, opts) == ["a.tar"]
    fs, path = filesystem(url, opts, full_interface=True)
    fs.ls(path)  # fsspec's listing cache of the shared client now holds the folder
    s3_server.put(s3_bucket, "ds/b.parquet", b"b")  # written by someone else
    assert list_shard_files(url, opts) == ["a.tar", "b.parquet"]


def test_checkpoint_storage_lists_what_another_checkpointer_wrote(s3_server, s3_bucket, tmp_path):
    url, opts = f"s3://{s3_bucket}/run", s3_server.storage_options()
    with Checkpointer(url, staging_dir=tmp_path / "r", storage_options=opts) as reader, \
            Checkpointer(url, keep=1, staging_dir=tmp_path / "w", storage_options=opts) as writer:
        assert reader.steps() == []
        writer.save(1, x=torch.ones(3)).wait()
        assert reader.steps() == [1] and reader.latest() == 1
        writer.save(2, x=torch.ones(3)).wait()  # keep=1: step 1 is deleted
        assert reader.steps() == [2] and reader.latest() == 2


# -- index and verify over s3:// through the fault proxy ---------------------------------------
@pytest.fixture
def tars_on_s3(tar_dataset, s3_url, tmp_path):
    """The tar fixture's shards alone (no index, no sidecars) in a fresh bucket."""
    only_tars = tmp_path / "tars"
    only_tars.mkdir()
    for name in sorted(os.listdir(tar_dataset.path)):
        if name.endswith(".tar"):
            shutil.copy(os.path.join(tar_dataset.path, name), only_tars / name)
    return s3_url(only_tars)


# More consecutive faults than botocore and s3fs retry on their own (2 requests for a 503, 4
# for a reset with the test options; the botocore S3 reader of `index.json` none): the
# commands succeed only through shardloader's retries.
FAULTS = [pytest.param(Fault("status", status=503), 4, id="503"),
          pytest.param(Fault("reset"), 5, id="reset")]


@pytest.mark.parametrize("fault, count", FAULTS)
def test_index_and_verify_on_s3_retry_transient_faults(tar_dataset, tars_on_s3, s3_server,
                                                       fault_proxy, fault, count, capsys):
    for command in ("index", "verify"):
        proxy = fault_proxy(s3_server.endpoint, first(count, fault, match=ANY_REQUEST))
        options = json.dumps(s3_server.storage_options(proxy.url))
        assert main([command, tars_on_s3, "--quiet", "--storage-options", options]) == 0, capsys.readouterr().err
        assert len([e for e in proxy.settled() if e.fault]) == count
        if command == "index":
            written = load_index(tars_on_s3, s3_server.storage_options())
            assert written.to_json() == tar_dataset.index.to_json()  # same checksums and sidecars


def test_index_and_verify_on_s3_name_the_url_of_a_permanent_error(tars_on_s3, s3_server,
                                                                  fault_proxy, capsys):
    denied = fault_proxy(s3_server.endpoint, always(Fault("status", status=403), match=ANY_REQUEST))
    opts = s3_server.storage_options(denied.url)
    with pytest.raises(FetchError, match=rf"^{tars_on_s3}: access denied \(HTTP 403"):
        index_dataset(tars_on_s3, storage_options=opts)
    assert main(["index", tars_on_s3, "--quiet", "--storage-options", json.dumps(opts)]) == 1
    assert f"shardloader index: error: {tars_on_s3}: access denied" in capsys.readouterr().err

    index_dataset(tars_on_s3, storage_options=s3_server.storage_options())
    with pytest.raises(FetchError, match=rf"^{tars_on_s3}/index.json: access denied \(HTTP 403"):
        verify_dataset(tars_on_s3, opts)
    assert main(["verify", tars_on_s3, "--quiet", "--storage-options", json.dumps(opts)]) == 1
    assert f"shardloader verify: error: {tars_on_s3}/index.json: access denied" in capsys.readouterr().err

    # A shard that answers 404 to its reads (listed, then gone): the error names the shard.
    gone = fault_proxy(s3_server.endpoint, always(Fault("status", status=404)))  # ranged GETs
    opts = s3_server.storage_options(gone.url)
    with pytest.raises(FetchError, match=rf"^{tars_on_s3}/shard-00000.tar: not found"):
        index_dataset(tars_on_s3, storage_options=opts)
    with pytest.raises(FetchError, match=rf"^{tars_on_s3}/shard-00000.tar: not found"):
        verify_dataset(tars_on_s3, opts)


PUTS = lambda method, path, headers: method == "PUT"  # noqa: E731


def test_a_put_whose_upload_the_server_lost_is_put_again_whole(s3_server, s3_bucket, fault_proxy, tmp_path):
    """A put answered S3's NoSuchUpload (the server lost the upload the client was making, as
    moto does when a slow multipart completion is sent again) is retried whole, not taken for
    a missing object; the object is then there, whole. A missing local file, or any other
    "not found" of a put, is still a FileNotFoundError, at once."""
    lost = Fault("status", status=404, body=b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchUpload"
                                             b"</Code><Message>The specified upload does not exist.</Message></Error>")
    proxy = fault_proxy(s3_server.endpoint, first(2, lost, match=PUTS))
    url = f"s3://{s3_bucket}/put"
    fs, path = filesystem(url, s3_server.storage_options(proxy.url), full_interface=True)
    local = tmp_path / "state.bin"
    local.write_bytes(os.urandom(3000))
    policy = RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.02)
    put_file(fs, str(local), f"{path}/state.bin", f"{url}/state.bin", policy=policy)
    put_bytes(fs, b"manifest", f"{path}/manifest.json", f"{url}/manifest.json", policy=policy)
    assert fs.cat_file(f"{path}/state.bin") == local.read_bytes()
    assert fs.cat_file(f"{path}/manifest.json") == b"manifest"
    assert [entry.fault for entry in proxy.settled() if entry.method == "PUT"] == ["status", "status", None, None]
    with pytest.raises(FileNotFoundError):
        put_file(fs, str(tmp_path / "gone.bin"), f"{path}/gone.bin", f"{url}/gone.bin", policy=policy)
    # any other "not found" of a put (a missing bucket) is not retried: FileNotFoundError at once
    missing = fault_proxy(s3_server.endpoint, first(1, Fault("status", status=404), match=PUTS))
    fs, path = filesystem(url, s3_server.storage_options(missing.url), full_interface=True)
    with pytest.raises(FileNotFoundError):
        put_bytes(fs, b"x", f"{path}/other.json", f"{url}/other.json", policy=policy)
    assert [entry.fault for entry in missing.settled() if entry.method == "PUT"] == ["status"]
