"""benchmarks/_s3.py: the benchmarks' S3 server (moto in a process of its own) completes a
multipart upload from its parts' files, with moto's checks and ETag, and answers a repeated
completion of one upload with the object the first one made."""

from __future__ import annotations

import hashlib
import os
import threading

import boto3
import pytest
from botocore.exceptions import ClientError

from benchmarks._s3 import BUCKET, S3Process, _once_per_upload

MiB = 1 << 20


@pytest.fixture(scope="module")
def server():
    with S3Process({}) as process:
        yield process


@pytest.fixture
def client(server):
    return boto3.client("s3", **server.at.boto_options())


def _upload_parts(client, key: str, parts: list[bytes]) -> tuple[str, list[dict]]:
    upload = client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
    done = [{"PartNumber": i + 1, "ETag": client.upload_part(Bucket=BUCKET, Key=key, UploadId=upload,
                                                             PartNumber=i + 1, Body=body)["ETag"]}
            for i, body in enumerate(parts)]
    return upload, done


def _multipart_etag(parts: list[bytes]) -> str:
    """S3's ETag of a multipart object: the MD5 of the parts' MD5s, then '-' and their count."""
    digests = b"".join(hashlib.md5(p).digest() for p in parts)
    return f'"{hashlib.md5(digests).hexdigest()}-{len(parts)}"'


def test_a_completed_upload_holds_the_parts_bytes_in_order_with_s3s_etag(client):
    parts = [os.urandom(5 * MiB), os.urandom(6 * MiB), os.urandom(MiB + 7)]
    upload, done = _upload_parts(client, "whole.bin", parts)
    etag = client.complete_multipart_upload(Bucket=BUCKET, Key="whole.bin", UploadId=upload,
                                            MultipartUpload={"Parts": done})["ETag"]
    assert etag == _multipart_etag(parts)
    assert client.get_object(Bucket=BUCKET, Key="whole.bin")["Body"].read() == b"".join(parts)
    tail = client.get_object(Bucket=BUCKET, Key="whole.bin", Range=f"bytes={11 * MiB - 3}-")["Body"].read()
    assert tail == b"".join(parts)[11 * MiB - 3:]


def test_two_completions_of_one_upload_sent_together_both_get_the_one_object(client):
    parts = [os.urandom(1 << 20) * 40, os.urandom(3 * MiB)]  # a large part: the copy takes a while
    upload, done = _upload_parts(client, "twice.bin", parts)
    answers: list[object] = [None, None]
    go = threading.Barrier(2)

    def complete(i: int) -> None:
        go.wait()
        try:
            answers[i] = client.complete_multipart_upload(
                Bucket=BUCKET, Key="twice.bin", UploadId=upload, MultipartUpload={"Parts": done})["ETag"]
        except ClientError as e:
            answers[i] = e

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert answers == [_multipart_etag(parts)] * 2
    assert client.get_object(Bucket=BUCKET, Key="twice.bin")["Body"].read() == b"".join(parts)


def test_a_part_with_a_wrong_etag_or_too_small_before_the_last_is_refused(client):
    upload, done = _upload_parts(client, "bad.bin", [os.urandom(5 * MiB), os.urandom(MiB)])
    wrong = [dict(done[0], ETag='"' + "0" * 32 + '"'), done[1]]
    with pytest.raises(ClientError, match="InvalidPart"):
        client.complete_multipart_upload(Bucket=BUCKET, Key="bad.bin", UploadId=upload,
                                         MultipartUpload={"Parts": wrong})
    upload, done = _upload_parts(client, "small.bin", [os.urandom(MiB), os.urandom(MiB)])
    with pytest.raises(ClientError, match="EntityTooSmall"):
        client.complete_multipart_upload(Bucket=BUCKET, Key="small.bin", UploadId=upload,
                                         MultipartUpload={"Parts": done})


class _Key:
    """Stands for moto's object (a weak reference can hold it, as it holds a FakeKey)."""


def test_a_repeat_that_comes_while_the_first_completes_gets_its_object_without_completing_again():
    # The end-to-end test above cannot make two requests overlap on demand; this one can.
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []
    key = _Key()

    def complete_upload(backend, bucket, upload, body):
        calls.append(upload)
        entered.set()
        assert release.wait(30)
        return key

    complete = _once_per_upload(complete_upload)
    got: list[object] = [None, None]
    first = threading.Thread(target=lambda: got.__setitem__(0, complete(None, BUCKET, "u1", [])))
    first.start()
    assert entered.wait(30)  # the first is inside its completion
    second = threading.Thread(target=lambda: got.__setitem__(1, complete(None, BUCKET, "u1", [])))
    second.start()
    release.set()
    first.join(30)
    second.join(30)
    assert got == [key, key] and calls == ["u1"]


def test_a_failed_completion_leaves_the_next_request_to_complete_the_upload():
    calls: list[str] = []
    key = _Key()

    def complete_upload(backend, bucket, upload, body):
        calls.append(upload)
        if len(calls) == 1:
            raise RuntimeError("the first attempt failed")
        return key

    complete = _once_per_upload(complete_upload)
    with pytest.raises(RuntimeError, match="first attempt"):
        complete(None, BUCKET, "u2", [])
    assert complete(None, BUCKET, "u2", []) is key
    assert calls == ["u2", "u2"]
