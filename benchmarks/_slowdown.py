"""An S3 server that slows a crowd down the way S3 does: moto (tests/fixtures/servers.py) behind a
proxy that answers ``503 SlowDown`` above a request rate per prefix, in a process of its own.

S3 scales its request rate per key prefix (documented: at least 3,500 PUT/COPY/POST/DELETE and
5,500 GET/HEAD requests per second per prefix) and answers ``503 Slow Down`` above it, asking
clients to back off exponentially. `SlowDownProxy` keeps one token bucket per prefix (the key up
to its last ``/``): `rate` tokens a second, at most `burst` saved; a request that finds its bucket
empty gets S3's error document with status 503, without reaching moto. Every request is logged
with the node that sent it (the ``node/<i>`` the harness puts in each node's botocore user agent,
``user_agent_extra``), so the harness counts requests per object and node on the server's side,
not from what the clients say they did.

    with SlowDownServer({"ds": folder}, rate=200, burst=50) as server:
        server.url("ds"); server.proxy            # s3://bench/ds through the proxy's URL
        requests = server.stop()                  # the log: one dict per request

The server process uploads the folders, prints one JSON line with its endpoints, serves until
its standard input closes, then writes the log to the file it was given and exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from shardloader.runtime.child_process import die_with_parent

BUCKET = "bench"
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


def prefix_of(path: str) -> str:
    """The prefix S3 partitions on, for a proxied path ``/bucket/key?query``: bucket and key up
    to the key's last ``/``."""
    key = path.split("?", 1)[0]
    return key.rsplit("/", 1)[0] if "/" in key.strip("/") else key


class TokenBuckets:
    """One token bucket per prefix: `rate` requests a second, bursts of at most `burst`."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # prefix -> (tokens, at)

    def take(self, prefix: str, now: float) -> bool:
        """Whether a request to `prefix` arriving at `now` (monotonic seconds) is within the rate."""
        with self._lock:
            tokens, at = self._buckets.get(prefix, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            allowed = tokens >= 1.0
            self._buckets[prefix] = (tokens - 1.0 if allowed else tokens, now)
            return allowed


def _proxy_class() -> type:
    from tests.fixtures.servers import Fault, FaultProxy

    class SlowDownProxy(FaultProxy):
        """A `FaultProxy` whose plan is the token buckets, and whose 503s never reach moto."""

        def __init__(self, upstream: str, rate: float, burst: float) -> None:
            self.buckets = TokenBuckets(rate, burst)
            self.nodes: dict[int, str] = {}  # request number -> the node its user agent names
            super().__init__(upstream, self._plan)

        def _plan(self, number: int, method: str, path: str, headers: dict[str, str]) -> Any:
            agent = next((v for k, v in headers.items() if k.lower() == "user-agent"), "")
            self.nodes[number] = next((w[5:] for w in agent.split() if w.startswith("node/")), "")
            if self.buckets.take(prefix_of(path), time.monotonic()):
                return None
            return Fault("status", status=503, body=SLOW_DOWN)

        def _respond(self, h: Any, fault: Any, body: bytes) -> None:
            if fault is None:
                super()._respond(h, fault, body)
                return
            h.send_response(fault.status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(fault.body)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(fault.body)

    return SlowDownProxy


class SlowDownServer:
    """moto and a `SlowDownProxy` in front of it, in a child process, holding `layouts`."""

    def __init__(self, layouts: dict[str, str], *, rate: float, burst: float) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
        fd, self._log_path = tempfile.mkstemp(suffix=".json", prefix="slowdown-log-")
        os.close(fd)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._slowdown", str(os.getpid()), json.dumps(layouts),
             str(rate), str(burst), self._log_path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root, env=env)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait(60)
            raise RuntimeError(f"the S3 server process exited ({self._proc.returncode}) before it served")
        served = json.loads(line)
        self.endpoint, self.proxy = served["endpoint"], served["proxy"]

    @staticmethod
    def url(layout: str) -> str:
        return f"s3://{BUCKET}/{layout}"

    def stop(self) -> list[dict[str, Any]]:
        """Stop serving; every request the proxy answered, in arrival order."""
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(120)
        with open(self._log_path) as f:
            requests = json.load(f)
        os.unlink(self._log_path)
        return requests

    def __enter__(self) -> SlowDownServer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc.poll() is None:
            self.stop()


def _serve(parent: int, layouts: dict[str, str], rate: float, burst: float, log_path: str) -> None:
    die_with_parent(parent)
    from tests.fixtures.servers import S3Server

    server = S3Server().start()
    server.create_bucket(BUCKET)
    for name, folder in layouts.items():
        server.upload_dir(folder, BUCKET, name)
    proxy = _proxy_class()(server.endpoint, rate, burst)
    print(json.dumps({"endpoint": server.endpoint, "proxy": proxy.url}), flush=True)
    sys.stdin.read()  # until the parent closes the pipe (or dies)
    log = proxy.settled(60)
    proxy.stop()
    server.stop()
    with open(log_path, "w") as f:
        json.dump([{"number": e.number, "method": e.method, "path": e.path, "range": e.range,
                    "fault": e.fault, "started": e.started, "ended": e.ended, "sent": e.sent,
                    "node": proxy.nodes.get(e.number, "")} for e in log], f)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), json.loads(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
