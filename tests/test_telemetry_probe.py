"""The tracking-server probe: an HTTP answer of any status is "answering"; a refused connection
and a server that accepts and never answers are told apart, within the timeout."""

from __future__ import annotations

import time

from shardloader.telemetry.mlflow.probe import is_http, is_local_store, probe


def test_any_http_answer_counts(tmp_path, http_server):
    server = http_server(tmp_path)  # serves files: /health is a 404, still an answer
    assert probe(server.url, timeout=5) is None


def test_refused_and_silent_are_named_within_the_timeout(dead_tracking_uri,
                                                         hanging_tracking_server):
    assert probe(dead_tracking_uri, timeout=5) == "connection refused"
    start = time.monotonic()
    assert probe(hanging_tracking_server.url, timeout=0.5) == "no answer within 0.5 s"
    assert time.monotonic() - start < 3
    assert hanging_tracking_server.request_received.wait(30)  # set by the server's reader thread


def test_stores_that_are_not_http_are_not_probed(tmp_path):
    for uri in (str(tmp_path), f"file://{tmp_path}", f"sqlite:///{tmp_path}/m.db"):
        assert probe(uri, timeout=0.1) is None and not is_http(uri)
        assert is_local_store(uri)
    assert not is_local_store("databricks") and not is_local_store("postgresql://h/db")
    assert not is_local_store("http://127.0.0.1:5000") and is_http("https://x")
