"""Failures during a background save, through real parts: the error is raised at the next call
into the checkpointer with its original cause, and nothing half-written is ever listed."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from shardloader.checkpoint import Checkpointer
from shardloader.errors import CheckpointError, FetchError
from shardloader.io.retry import RetryPolicy
from tests.fixtures.checkpoint import FullFileSystem
from tests.fixtures.servers import Fault

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_destination_that_became_unwritable(tmp_path):
    root = tmp_path / "root"
    ck = Checkpointer(root, staging_dir=tmp_path / "staging")
    ck.save(1, blob={"x": torch.ones(10)}).wait()
    os.rename(root, tmp_path / "root.away")
    root.write_text("not a directory any more")  # e.g. a mount point gone bad
    try:
        ck.save(2, blob={"x": torch.ones(10)})
        with pytest.raises(CheckpointError, match=r"step 2 .*failed during upload") as excinfo:
            ck.wait()
        assert isinstance(excinfo.value.__cause__, OSError)
    finally:
        root.unlink()
        os.rename(tmp_path / "root.away", root)
    assert ck.steps() == [1] and ck.latest() == 1
    assert [n for n in os.listdir(root) if n.startswith("step-")] == [ck._store.list_ids()[0]]
    ck.close()


def test_missing_bucket_is_an_unwritable_destination(s3_server, tmp_path):
    ck = Checkpointer("s3://no-such-bucket-here/run", staging_dir=tmp_path,
                      storage_options=s3_server.storage_options())
    ck.save(1, blob={"x": torch.ones(10)})
    with pytest.raises(CheckpointError, match=r"no-such-bucket-here.*failed during upload") as excinfo:
        ck.close()
    assert excinfo.value.__cause__ is not None
    assert os.listdir(ck._staging) == []  # staged files are cleaned up


def test_disk_full_at_the_destination(tmp_path):
    FullFileSystem.budget[0] = 1 << 62
    root = f"fullfs://{tmp_path}/root"
    ck = Checkpointer(root, staging_dir=tmp_path / "staging")
    try:
        ck.save(1, blob={"x": torch.ones(10)}).wait()
        FullFileSystem.budget[0] = 50_000  # the second checkpoint is 400 KB
        ck.save(2, blob={"x": torch.randn(100_000)})
        with pytest.raises(CheckpointError, match="failed during upload") as excinfo:
            ck.save(3, blob={"x": torch.ones(10)})
        assert excinfo.value.__cause__.errno == errno.ENOSPC
        assert ck.steps() == [1] and ck.latest() == 1
        assert sorted(os.listdir(tmp_path / "root")) == [ck._store.list_ids()[0]]
        FullFileSystem.budget[0] = 1 << 62
        ck.save(3, blob={"x": torch.ones(10)}).wait()
        assert ck.steps() == [1, 3]
    finally:
        FullFileSystem.budget[0] = 1 << 62
        ck.close()


def _unshare_tmpfs_works(tmp_path) -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {tmp_path}"],
        capture_output=True, timeout=30,
    )
    return probe.returncode == 0


def test_real_disk_full_in_the_staging_writer(tmp_path):
    """The staging dir is a 1 MiB tmpfs (in a private mount namespace: no root needed, nothing
    left mounted); the writer hits the kernel's ENOSPC while streaming a 4 MiB state."""
    staging = tmp_path / "staging"
    staging.mkdir()
    if not _unshare_tmpfs_works(staging):
        pytest.skip("unprivileged mount namespaces are not available here")
    root = tmp_path / "root"
    script = (f"mount -t tmpfs -o size=1m tmpfs {staging} && exec {sys.executable} "
              f"-m tests.fixtures.checkpoint disk-full {root} {staging}")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["save_returned"]
    assert report["raised"] and "step 2" in report["raised"] and "during write" in report["raised"]
    assert report["cause_errno"] == errno.ENOSPC
    assert report["steps"] == [1] and report["latest"] == 1
    assert report["staging_left"] == []
    assert report["steps_after"] == [1, 4]


@pytest.mark.parametrize("failing_file", ["state.json", "manifest.json"])
def test_s3_destination_failing_mid_upload(s3_server, s3_bucket, fault_proxy, tmp_path, failing_file):
    """PUTs of one file of the second checkpoint die with a TCP reset, every time: the first
    file of that checkpoint is already uploaded (and the failing object may even have reached
    the server). The PUT is retried, then the save fails naming the object."""
    armed = {"on": False}

    def plan(number, method, path, headers):
        if armed["on"] and method == "PUT" and path.split("?")[0].endswith("/" + failing_file):
            return Fault("reset")
        return None

    proxy = fault_proxy(s3_server.endpoint, plan=plan)
    options = s3_server.storage_options(endpoint=proxy.url, timeout=10)
    url = f"s3://{s3_bucket}/run"
    ck = Checkpointer(url, staging_dir=tmp_path, storage_options=options, keep=None,
                      retry=RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.01))
    first = ck.save(1, blob={"x": torch.ones(1000)})
    first.wait()
    armed["on"] = True
    ck.save(2, blob={"x": torch.randn(50_000)})
    with pytest.raises(CheckpointError, match=r"step 2 .*failed during (upload|commit)") as excinfo:
        ck.wait()
    assert isinstance(excinfo.value.__cause__, FetchError)
    assert f"/{failing_file}: giving up after 3 failed attempts" in str(excinfo.value)
    assert any(entry.fault == "reset" for entry in proxy.settled())
    assert ck.steps() == [1] and ck.latest() == 1
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket).get("Contents", [])
            if not o["Key"].startswith("run/.job/")]  # the job's records (telemetry/job)
    assert keys and all(k.startswith(f"run/{first.id}/") for k in keys), keys
    armed["on"] = False
    ck.save(3, blob={"x": torch.ones(10)}).wait()
    assert ck.steps() == [1, 3]
    ck.close()
    with Checkpointer(url, staging_dir=tmp_path, storage_options=s3_server.storage_options()) as fresh:
        assert fresh.steps() == [1, 3]
