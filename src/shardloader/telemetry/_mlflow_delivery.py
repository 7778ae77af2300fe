"""Delivery of metric rows to MLflow: buffering, batching, health checks and backoff.

`Delivery` is what actually talks to MLflow. It runs either in the logger's background thread
(`MLflowLogger(process=False)`) or in a small writer process (the default), started with
`python -m shardloader.telemetry._mlflow_writer` and fed through a socket pair, so that
MLflow's own per-metric work (protobuf/JSON for a server, SQLAlchemy for a local store:
20-70 microseconds of CPU per metric) never holds the training process's GIL.

Rows (what the logger sends), plain tuples so they pickle cheaply:
    ("b", step, timestamp_ms, (value, ...))  - one batch record, values in `keys` order
    ("m", {name: value}, step, timestamp_ms) - free-form metrics (name gets the rank suffix)
Messages to the writer process: ("rows", [row, ...]), ("flush", n), ("close",).
Replies: ("ack", n, state) to a flush, ("closed", state) to a close.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger("shardloader.telemetry.mlflow")

#: MLflow accepts at most this many metrics per log_batch call.
MAX_METRICS_PER_CALL = 1000
# Errors that will not go away by retrying: drop the chunk instead of retrying it forever.
_PERMANENT_ERROR_CODES = frozenset({
    "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "BAD_REQUEST",
    "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_LIMIT_EXCEEDED",
})
_MAX_BACKOFF = 30.0


def server_reachable(tracking_uri: str, timeout: float = 2.0) -> bool:
    """For http(s) tracking URIs: does anything accept a TCP connection? Other stores: True."""
    parsed = urlparse(tracking_uri)
    if parsed.scheme not in ("http", "https"):
        return True
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "localhost", port), timeout=timeout):
            return True
    except OSError:
        return False


def experiment_id_for(client: Any, experiment: str | None) -> str:
    """The id of experiment `experiment` (created if new), else $MLFLOW_EXPERIMENT_ID or "0"."""
    if experiment is not None:
        found = client.get_experiment_by_name(experiment)
        if found is not None:
            return found.experiment_id
        return client.create_experiment(experiment)
    return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")  # "0": every store's Default


class Delivery:
    """Buffers metric rows and sends them with `log_batch`, never raising.

    A server that is down costs one refused TCP connect per attempt (no MLflow retry loop);
    failed attempts back off up to 30 s; the buffer holds at most `max_pending` metrics and
    drops the oldest beyond that (counted). `run_id` None means the run is created (in
    `experiment`) the first time the server answers; `owns_run` marks a run this side created
    and terminates on `finish()`.
    """

    def __init__(self, *, tracking_uri: str, run_id: str | None, experiment: str | None,
                 keys: tuple[str, ...], suffix: str, max_pending: int, probe_timeout: float,
                 owns_run: bool) -> None:
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id
        self.experiment = experiment
        self.keys = keys
        self.suffix = suffix
        self.max_pending = max_pending
        self.probe_timeout = probe_timeout
        self.owns_run = owns_run
        self.pending: deque[Any] = deque()
        self.healthy = True
        self.stopping = False
        self._backoff = 0.0
        self._next_attempt = 0.0
        self._last_warning = 0.0
        self.metrics_logged = 0
        self.metrics_dropped = 0
        self.batch_calls = 0

    def state(self) -> dict[str, Any]:
        return {"metrics_logged": self.metrics_logged, "metrics_dropped": self.metrics_dropped,
                "metrics_pending": len(self.pending), "batch_calls": self.batch_calls,
                "run_id": self.run_id, "healthy": self.healthy}

    def add(self, rows: Iterable[tuple[Any, ...]]) -> None:
        from mlflow.entities import Metric

        pending = self.pending
        keys = self.keys
        for row in rows:
            if row[0] == "b":
                _, step, ts, values = row
                for key, value in zip(keys, values, strict=True):
                    pending.append(Metric(key, float(value), ts, step))
            else:
                _, metrics, step, ts = row
                for name, value in metrics.items():
                    value = float(value)
                    if math.isfinite(value):
                        pending.append(Metric(f"{name}{self.suffix}", value, ts, step))
        overflow = len(pending) - self.max_pending
        if overflow > 0:
            for _ in range(overflow):
                pending.popleft()
            self.metrics_dropped += overflow
            self._warn(f"MLflow telemetry buffer full: dropped {overflow} metric(s), oldest first")

    def deliver(self, force: bool = False) -> None:
        """Send what is buffered, unless backing off (`force` retries now)."""
        if not self.pending:
            return
        if not force and time.monotonic() < self._next_attempt:
            return
        if not server_reachable(self.tracking_uri, self.probe_timeout):
            self._failed(f"tracking server {self.tracking_uri} is not reachable")
            return
        if self.run_id is None:
            try:
                experiment_id = experiment_id_for(self.client, self.experiment)
                run = self.client.create_run(experiment_id, tags={"shardloader.telemetry": "1"})
            except Exception as exc:  # noqa: BLE001
                self._failed(f"could not create an MLflow run: {exc!r}")
                return
            self.run_id = run.info.run_id
            self.owns_run = True
        pending = self.pending
        while pending:
            chunk = [pending[i] for i in range(min(MAX_METRICS_PER_CALL, len(pending)))]
            try:
                self.client.log_batch(self.run_id, metrics=chunk)
            except Exception as exc:  # noqa: BLE001 - the server's problem, not training's
                if getattr(exc, "error_code", None) in _PERMANENT_ERROR_CODES:
                    for _ in chunk:
                        pending.popleft()
                    self.metrics_dropped += len(chunk)
                    self._warn(f"MLflow rejected {len(chunk)} metric(s): {exc}")
                    continue
                self._failed(f"log_batch failed: {exc!r}")
                return
            for _ in chunk:
                pending.popleft()
            self.metrics_logged += len(chunk)
            self.batch_calls += 1
        if not self.healthy:
            log.warning("MLflow tracking server %s answers again", self.tracking_uri)
        self.healthy = True
        self._backoff = 0.0
        self._next_attempt = 0.0

    def finish(self) -> None:
        """Mark a run this side created as finished (only if the server answers)."""
        if self.owns_run and self.healthy and self.run_id is not None:
            if not server_reachable(self.tracking_uri, self.probe_timeout):
                return
            try:
                self.client.set_terminated(self.run_id)
            except Exception as exc:  # noqa: BLE001
                log.warning("could not mark MLflow run %s finished: %r", self.run_id, exc)
            self.owns_run = False

    def _failed(self, why: str) -> None:
        self.healthy = False
        self._backoff = min(_MAX_BACKOFF, max(1.0, self._backoff * 2))
        self._next_attempt = time.monotonic() + self._backoff
        self._warn(f"MLflow telemetry: {why}; {len(self.pending)} metric(s) buffered, will retry")

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning > 30.0:
            self._last_warning = now
            log.warning(message)


# -- the writer process ---------------------------------------------------------------------
def serve(conn: Any, delivery: Delivery, flush_interval: float, orphan_seconds: float) -> None:
    while True:
        try:
            ready = conn.poll(flush_interval)
            message = conn.recv() if ready else None
        except (EOFError, OSError):  # the training process is gone: last try, then exit
            signal.alarm(max(1, math.ceil(orphan_seconds)))  # SIGALRM ends a hung last try
            delivery.stopping = True
            delivery.deliver(force=True)
            delivery.finish()
            return
        if message is not None:
            kind = message[0]
            if kind == "rows":
                delivery.add(message[1])
            elif kind == "flush":
                delivery.deliver(force=True)
                conn.send(("ack", message[1], delivery.state()))
                continue
            elif kind == "close":
                delivery.stopping = True
                delivery.deliver(force=True)
                delivery.finish()
                conn.send(("closed", delivery.state()))
                return
        delivery.deliver()
