"""After S3 answers `503 SlowDown`, a process's S3 client paces its requests (botocore's adaptive
retry mode, with botocore's own retries still off: shardloader.io.s3client), so that the many
concurrent reads of one process do not keep offering a throttled prefix more than it serves.

The proxy lets GETs through at 4 a second (a token bucket) and answers SlowDown above it; six
threads of one client GET an object as fast as they can for a few seconds, each waiting its own
backoff after a SlowDown. Without pacing (retry mode "standard", what the options set before),
most requests are SlowDowns; with the default, far fewer are, for about as many served."""

from __future__ import annotations

import threading
import time

from shardloader.errors import FetchError
from shardloader.io.retry import RetryPolicy, retrying
from shardloader.io.s3client import s3_reader
from tests.fixtures.servers import Fault

SLOW_DOWN = Fault("status", status=503, body=b"<Error><Code>SlowDown</Code>"
                  b"<Message>Please reduce your request rate.</Message></Error>")
RATE, BURST, SECONDS, THREADS = 4.0, 2.0, 4.0, 6


def _token_bucket():
    lock = threading.Lock()
    state = {"tokens": BURST, "at": time.monotonic()}

    def plan(number: int, method: str, path: str, headers: dict) -> Fault | None:
        with lock:
            now = time.monotonic()
            state["tokens"] = min(BURST, state["tokens"] + (now - state["at"]) * RATE)
            state["at"] = now
            if state["tokens"] >= 1:
                state["tokens"] -= 1
                return None
            return SLOW_DOWN

    return plan


def _offered(s3_server, bucket: str, fault_proxy, retries: dict | None) -> tuple[int, int]:
    """(served, throttled) GETs of one client's THREADS threads over SECONDS seconds."""
    proxy = fault_proxy(s3_server.endpoint, plan=_token_bucket())
    options = s3_server.storage_options(endpoint=proxy.url)
    del options["config_kwargs"]["retries"]
    if retries is not None:
        options["config_kwargs"]["retries"] = retries
    reader = s3_reader(f"s3://{bucket}/obj", options)
    assert reader is not None
    policy = RetryPolicy(attempts=1, base_delay=0.05, max_delay=0.4, deadline=SECONDS)
    end = time.monotonic() + SECONDS

    def loop() -> None:
        while time.monotonic() < end:
            try:
                retrying(lambda: reader.cat_file(f"{bucket}/obj"), f"s3://{bucket}/obj", policy=policy)
            except FetchError:
                pass  # the deadline: this thread's next read starts anew

    threads = [threading.Thread(target=loop) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log = proxy.settled()
    throttled = sum(1 for e in log if e.fault)
    return len(log) - throttled, throttled


def test_a_throttled_client_paces_its_requests(s3_server, s3_bucket, fault_proxy):
    s3_server.put(s3_bucket, "obj", b"x" * 1000)
    served_free, throttled_free = _offered(s3_server, s3_bucket, fault_proxy,
                                           {"total_max_attempts": 1, "mode": "standard"})
    served, throttled = _offered(s3_server, s3_bucket, fault_proxy, None)  # the default options
    assert throttled_free > 2 * served_free, (served_free, throttled_free)  # the bucket did throttle
    assert throttled < throttled_free / 2, (served, throttled, served_free, throttled_free)
    assert served >= served_free / 2, (served, served_free)  # paced, not starved
