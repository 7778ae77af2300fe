"""An S3 server for benchmarks: moto's (tests/fixtures/servers.py) on 127.0.0.1, on a free port,
in a process of its own so that serving does not compete for the measuring process's GIL.

    with S3Process({"arrow": images.arrow_dir, "mds": mds_dir}) as server:
        s3 = server.at           # an S3Endpoint: plain data, can go to another process
        s3.url("arrow")          # s3://bench/arrow
        s3.fsspec_options()      # for shardloader (its S3 client, or s3fs)
        s3.boto_options()        # for litdata's storage_options (boto3 / obstore)
        s3.env()                 # AWS_* and S3_ENDPOINT_URL, for mosaicml-streaming

    with S3Process({}, upload_caps=[100e6, 25e6]) as server:
        server.capped[25e6]      # an S3Endpoint whose uploads are capped at 25 MB/s

`upload_caps` puts one of the tests' `FaultProxy`s (tests/fixtures/servers.py) per cap in front
of the server, in the server's process, each pacing request bodies (`upload_bandwidth`) to
its cap in bytes/s: a slow link to the destination, for checkpoint uploads.

The server process uploads the given folders, prints one JSON line with its endpoint, and
serves until its standard input closes (`stop()`, or this process dying: the pipe closes with
it, and `die_with_parent` covers a SIGKILL).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from shardloader.runtime.child_process import die_with_parent

BUCKET = "bench"
KEY = SECRET = "testing"
REGION = "us-east-1"


@dataclass(frozen=True)
class S3Endpoint:
    """How to reach the server, in each client's terms."""

    endpoint: str

    def url(self, layout: str) -> str:
        return f"s3://{BUCKET}/{layout}"

    def fsspec_options(self) -> dict[str, Any]:
        return {"key": KEY, "secret": SECRET,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION}}

    def boto_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "aws_access_key_id": KEY,
                "aws_secret_access_key": SECRET, "region_name": REGION}

    def env(self) -> dict[str, str]:
        return {"S3_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": REGION}


class S3Process:
    """moto's S3 server in a child process, holding `layouts` (name -> local folder)."""

    def __init__(self, layouts: dict[str, str], timeout: float = 600.0, *,
                 upload_caps: list[float] = ()) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._s3", str(os.getpid()), json.dumps(layouts),
             json.dumps([float(c) for c in upload_caps])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root, env=env)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # after the uploads
        if not line:
            self._proc.wait(timeout)
            raise RuntimeError(f"the S3 server process exited ({self._proc.returncode}) "
                               "before it served")
        served = json.loads(line)
        self.at = S3Endpoint(served["endpoint"])
        self.capped = {float(cap): S3Endpoint(url) for cap, url in served["capped"]}

    def stop(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)

    def __enter__(self) -> S3Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _serve(parent: int, layouts: dict[str, str], upload_caps: list[float]) -> None:
    die_with_parent(parent)
    from tests.fixtures.servers import FaultProxy, S3Server

    _complete_uploads_on_disk()
    server = S3Server().start()
    server.create_bucket(BUCKET)
    for name, folder in layouts.items():
        server.upload_dir(folder, BUCKET, name)
    proxies = [(cap, FaultProxy(server.endpoint, upload_bandwidth=cap)) for cap in upload_caps]
    _collect_request_cycles()
    print(json.dumps({"endpoint": server.endpoint,
                      "capped": [(cap, proxy.url) for cap, proxy in proxies]}), flush=True)
    sys.stdin.read()  # until the parent closes the pipe (or dies)
    for cap, proxy in proxies:
        proxy.stop()
        _report_repeats(cap, proxy.log)
    server.stop()


def _collect_request_cycles(every: float = 0.25) -> None:
    """Run the cyclic garbage collector every `every` seconds in this (the server's) process.

    Why: each request moto serves leaves a reference cycle that holds the request's body, so a
    body is freed only when the collector next runs, and its runs are triggered by counts of
    objects, not bytes. An upload of large parts allocates few objects: uploading 64 MiB parts,
    the server's anonymous memory grew by 64 MiB per part (strace: one 64 MiB mapping per part
    never unmapped), and stayed flat with this (results.md, stop 35; what moto holds while it
    completes an upload is another matter: `_complete_uploads_on_disk`). `gc.freeze()` first
    moves what the server holds after start-up into the permanent generation, so each run looks
    only at what came since (25 us idle, against 150 ms for a full collection of moto's ~110k
    objects)."""
    gc.freeze()

    def collect() -> None:
        while True:
            time.sleep(every)
            gc.collect()

    threading.Thread(target=collect, name="s3-request-cycles", daemon=True).start()


class _Joined:
    """A completed multipart upload's bytes in a file of their own: what
    `_complete_uploads_on_disk` hands moto's new key instead of the joined bytes."""

    def __init__(self, file: Any, size: int) -> None:
        self.file, self.size = file, size


def _complete_uploads_on_disk() -> None:
    """Make moto complete a multipart upload by copying its parts' files into one file, which
    becomes the new object's, instead of joining them in memory (in this, the benchmarks'
    server process only).

    Why: moto keeps each part (and each object over 5 MiB) in a temporary file, but completes
    an upload in memory: it reads every part back into one buffer, copies that buffer into a
    second for the default full-object checksum, and makes bytes of the first for the new key.
    A 1 GiB upload peaked at 4.5 GB of anonymous memory in the server (results.md, stop 35),
    so a 4 GiB checkpoint could not be measured beside its own state on a 24 GiB machine.
    Here the parts are checked as moto checks them (each named part exists with its ETag, all
    but the last at least the minimum size, at least one), the ETag is moto's (the MD5 of the
    parts' MD5s, "-" and their count), and the bytes go part by part, 16 MiB at a time, from
    file to file. A checksum the client asked for per part (COMPOSITE) is built from one part
    at a time; a full-object checksum the client asked for takes moto's own path. Where the
    client asked for none, the object gets none (moto would add a CRC64NVME of its own)."""
    from moto.s3 import models
    from moto.s3.exceptions import EntityTooSmall, InvalidPart, MalformedXML
    from moto.settings import S3_UPLOAD_PART_MIN_SIZE

    joined_complete = models.FakeMultipart.complete
    value = models.FakeKey.value

    def complete(self: Any, body: Any) -> tuple[Any, str, Any]:
        algorithm = self.metadata.get("x-amz-checksum-algorithm")
        checksums = (models.MultipartChecksumBuilder(algorithm, self.metadata.get("x-amz-checksum-type"))
                     if algorithm else None)
        if checksums is not None and checksums.checksum_type != "COMPOSITE":
            return joined_complete(self, body)
        parts: list[Any] = []
        md5s = bytearray()
        for number, etag in body:
            part = self.parts.get(number)
            digest = part.etag.replace('"', "") if part is not None else None
            if digest is None or digest != etag.replace('"', ""):
                raise InvalidPart()
            if parts and parts[-1].contentsize < S3_UPLOAD_PART_MIN_SIZE:
                raise EntityTooSmall()
            md5s.extend(bytes.fromhex(digest))
            parts.append(part)
        if not parts:
            raise MalformedXML
        joined = tempfile.TemporaryFile()
        for part in parts:  # before moto deletes the upload, which closes the parts' files
            if checksums is not None:
                checksums.addPart(part.value)
            with part.lock:
                part._value_buffer.seek(0)
                shutil.copyfileobj(part._value_buffer, joined, 16 << 20)
        etag = f"{hashlib.md5(bytes(md5s)).hexdigest()}-{len(parts)}"
        size = sum(part.contentsize for part in parts)
        return _Joined(joined, size), etag, checksums.build() if checksums is not None else None

    def set_value(self: Any, new_value: Any) -> None:
        if not isinstance(new_value, _Joined):
            value.fset(self, new_value)
            return
        self._value_buffer.close()
        self._value_buffer = new_value.file
        self.contentsize = new_value.size

    models.FakeMultipart.complete = complete
    models.FakeKey.value = property(value.fget, set_value)
    models.S3Backend.complete_multipart_upload = _once_per_upload(models.S3Backend.complete_multipart_upload)


def _once_per_upload(complete_upload: Any) -> Any:
    """`S3Backend.complete_multipart_upload`, answering a repeated request for one upload as S3
    does: with the object its first request made, after that request finished.

    Why: a client whose completion request times out sends it again (at 2 GiB in stop 35, one
    was sent twice and answered with a KeyError). moto answers a repeat that comes after the
    first has finished (the object's upload id matches), but one that comes while the first
    is still completing runs the completion again, and fails (a KeyError, a 500) when the
    first removes the upload. Here each upload's requests take turns, and a later one gets the
    first one's object. (Weak references: an object a later save replaced is not kept alive
    by this.)"""
    guard = threading.Lock()
    turns: dict[str, threading.Lock] = {}
    made: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

    def complete_once(self: Any, bucket_name: str, multipart_id: str, body: Any) -> Any:
        with guard:
            turn = turns.setdefault(multipart_id, threading.Lock())
        try:
            with turn:
                key = made.get(multipart_id)
                if key is None:
                    key = complete_upload(self, bucket_name, multipart_id, body)
                    if key is not None:
                        made[multipart_id] = key
            return key
        finally:
            with guard:
                turns.pop(multipart_id, None)

    return complete_once


def _report_repeats(cap: float, log: list) -> None:
    """Say on stderr which multipart completions a client sent more than once through the
    proxy (a retry after a lost or slow answer: the server answers it with the first one's
    object, `_once_per_upload`), and the slowest request: evidence for a benchmark's reader."""
    completes: dict[str, list] = {}
    for entry in log:
        if entry.method == "POST" and "uploadId=" in entry.path:
            completes.setdefault(entry.path.split("?")[0], []).append(entry)
    for key, entries in completes.items():
        if len(entries) > 1:
            took = ", ".join(f"{e.ended - e.started:.1f}s" for e in entries)
            print(f"[s3 proxy {cap / 1e6:.0f} MB/s] CompleteMultipartUpload of {key} sent "
                  f"{len(entries)} times (each took {took})", file=sys.stderr)
    if log:
        slow = max(log, key=lambda e: e.ended - e.started)
        print(f"[s3 proxy {cap / 1e6:.0f} MB/s] {len(log)} requests; slowest {slow.method} "
              f"{slow.path.split('?')[0]} {slow.ended - slow.started:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), json.loads(sys.argv[2]),
           json.loads(sys.argv[3]) if len(sys.argv) > 3 else [])
