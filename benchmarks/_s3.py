"""An S3 server for benchmarks: moto's (tests/fixtures/servers.py) on 127.0.0.1, on a free port,
in a process of its own so that serving does not compete for the measuring process's GIL.

    with S3Process({"arrow": images.arrow_dir, "mds": mds_dir}) as server:
        s3 = server.at           # an S3Endpoint: plain data, can go to another process
        s3.url("arrow")          # s3://bench/arrow
        s3.fsspec_options()      # for shardloader (its S3 client, or s3fs)
        s3.boto_options()        # for litdata's storage_options (boto3 / obstore)
        s3.env()                 # AWS_* and S3_ENDPOINT_URL, for mosaicml-streaming

The server process uploads the given folders, prints one JSON line with its endpoint, and
serves until its standard input closes (`stop()`, or this process dying: the pipe closes with
it, and `die_with_parent` covers a SIGKILL).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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

    def __init__(self, layouts: dict[str, str], timeout: float = 600.0) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._s3", str(os.getpid()), json.dumps(layouts)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root, env=env)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # after the uploads
        if not line:
            self._proc.wait(timeout)
            raise RuntimeError(f"the S3 server process exited ({self._proc.returncode}) "
                               "before it served")
        self.at = S3Endpoint(json.loads(line)["endpoint"])

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


def _serve(parent: int, layouts: dict[str, str]) -> None:
    die_with_parent(parent)
    from tests.fixtures.servers import S3Server

    server = S3Server().start()
    server.create_bucket(BUCKET)
    for name, folder in layouts.items():
        server.upload_dir(folder, BUCKET, name)
    print(json.dumps({"endpoint": server.endpoint}), flush=True)
    sys.stdin.read()  # until the parent closes the pipe (or dies)
    server.stop()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), json.loads(sys.argv[2]))
