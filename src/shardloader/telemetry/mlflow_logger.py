"""`MLflowLogger`: per-batch telemetry to MLflow, off the training thread, never blocking it.

The training thread only appends the record to a bounded queue (`on_batch` costs about a
microsecond). A daemon thread packs the queued records into plain tuples once per
`flush_interval` (or sooner when the queue is half full) and hands them to the delivery side,
which turns them into metrics (the training step is the MLflow step, the delivery time the
timestamp) and sends them with `MlflowClient.log_batch`, up to 1,000 metrics per call.

By default the delivery side is a small writer process (`process=True`): MLflow spends 20-70
microseconds of CPU per metric (protobuf and JSON for a server, SQLAlchemy for a local store),
which in the training process would hold the GIL for ~1 ms per batch of 11 metrics. With
`process=False` it runs in the background thread instead.

A tracking server that is down or hangs never stalls or crashes training:
- when the queue is full, new records are dropped and counted (`dropped`);
- before talking to an HTTP server the delivery side checks with a quick TCP connect that
  something listens, so a dead server does not put it into MLflow's retry loop (by default
  `MLFLOW_HTTP_REQUEST_MAX_RETRIES=7` with exponential backoff, i.e. minutes, and
  `MLFLOW_HTTP_REQUEST_TIMEOUT=120` s per attempt; lower those environment variables to
  shorten how long a server that accepts connections but never answers can hold a delivery);
- metrics that could not be sent stay in a bounded buffer and are retried with backoff (up to
  30 s apart); the oldest are dropped and counted (`metrics_dropped`) when it overflows;
- `close()` returns within `close_timeout` seconds whatever the server does (a writer process
  still busy then is killed).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import shardloader
from shardloader.telemetry._mlflow_delivery import (
    Delivery,
    experiment_id_for,
    server_reachable,
)
from shardloader.telemetry.background import BackgroundSink
from shardloader.telemetry.records import LOGGABLE_FIELDS, BatchRecord
from shardloader.telemetry.sinks import JsonlLogger

log = logging.getLogger(__name__)

#: Metric fields logged per batch unless `fields=` says otherwise: fetch_seconds and what the
#: report needs to name its cause. Each metric costs the store 20-70 us of CPU, so the cache
#: counters, padding and epoch are opt-in (`fields=LOGGABLE_FIELDS` logs everything).
DEFAULT_FIELDS: tuple[str, ...] = (
    "fetch_seconds", "read_seconds", "transform_seconds", "download_wait_seconds",
    "queue_depth", "samples",
)
__all__ = ["DEFAULT_FIELDS", "LOGGABLE_FIELDS", "MLflowLogger", "current_rank",
           "server_reachable"]


def current_rank() -> int:
    """This process's rank: torch.distributed's when initialised, else $RANK, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return int(os.environ.get("RANK", "0"))


class MLflowLogger(BackgroundSink):
    """Logs every batch record (thinned by `every_n_steps`) as MLflow metrics.

    Where it logs: `run_id` if given; else the active MLflow run (when `tracking_uri` is not
    given or is the current one); else it starts a run in `experiment` (the active run of this
    thread when `tracking_uri` is None, so your own `mlflow.log_*` calls land in it too) and
    ends it on `close()`. The default store is MLflow's default (local, no server). If the
    server does not answer at start, the run is created when it does.

    Ranks: with `all_ranks=False` only rank 0 logs (elsewhere this is a no-op). With
    `all_ranks=True` every rank logs into the same run with keys suffixed `/rank{r}`; when
    torch.distributed is initialised and no run is given, rank 0 creates the run and broadcasts
    its id (a collective: every rank constructs its logger at the same point).

    `fields` are the `BatchRecord` fields logged per batch (metric key = `prefix + field`).
    `jsonl_path` also writes every record to a JSON-lines file (see `JsonlLogger`).
    Counters: `dropped` (records refused, queue full), `metrics_logged`, `metrics_dropped`
    (buffer overflow or rejected by the server), `batch_calls` (log_batch calls).
    """

    def __init__(
        self,
        run_id: str | None = None,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        every_n_steps: int = 1,
        max_queue: int = 10_000,
        all_ranks: bool = False,
        jsonl_path: str | os.PathLike[str] | None = None,
        *,
        fields: Sequence[str] = DEFAULT_FIELDS,
        prefix: str = "",
        process: bool = True,
        flush_interval: float = 1.0,
        close_timeout: float = 10.0,
        probe_timeout: float = 2.0,
        rank: int | None = None,
        group: Any = None,
    ) -> None:
        super().__init__(max_queue=max_queue, flush_interval=flush_interval,
                         close_timeout=close_timeout, name="shardloader-mlflow")
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, got {every_n_steps}")
        unknown = [f for f in fields if f not in LOGGABLE_FIELDS]
        if unknown:
            raise ValueError(
                f"fields {unknown} are not loggable BatchRecord fields ({', '.join(LOGGABLE_FIELDS)})"
            )
        import mlflow

        self.every_n_steps = every_n_steps
        self.fields = tuple(fields)
        self.prefix = prefix
        self.rank = current_rank() if rank is None else rank
        self.all_ranks = all_ranks
        self.active = all_ranks or self.rank == 0
        self.suffix = f"/rank{self.rank}" if all_ranks else ""
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        self.experiment = experiment
        self.probe_timeout = probe_timeout
        self.process = process
        self.run_id: str | None = run_id
        self._owns_run = False  # created here with the client: the delivery side ends it
        self._started_fluent_run = False  # mlflow.start_run on this thread: close() ends it
        self._state: dict[str, Any] = {"metrics_logged": 0, "metrics_dropped": 0,
                                       "metrics_pending": 0, "batch_calls": 0, "healthy": True}
        self._transport: Any = None
        self._flush_deadline = 0.0
        self._close_deadline = 0.0
        self._flush_ok = True
        self._jsonl = JsonlLogger(jsonl_path, max_queue=max_queue) if jsonl_path and self.active else None
        if self.active or _broadcast_needed(all_ranks, run_id):
            self._resolve_run(tracking_uri, group)
        if self.active:
            self._start()

    # -- counters -----------------------------------------------------------------------------
    @property
    def metrics_logged(self) -> int:
        return self._state["metrics_logged"]

    @property
    def metrics_dropped(self) -> int:
        return self._state["metrics_dropped"]

    @property
    def batch_calls(self) -> int:
        return self._state["batch_calls"]

    def counters(self) -> dict[str, int]:
        """Telemetry health: records dropped, metrics logged, dropped and still pending (as of
        the last flush/close or delivery report), log_batch calls."""
        return {"records_dropped": self.dropped, "metrics_logged": self.metrics_logged,
                "metrics_dropped": self.metrics_dropped,
                "metrics_pending": self._state["metrics_pending"], "batch_calls": self.batch_calls}

    # -- run resolution (constructor, training thread) ----------------------------------------
    def _resolve_run(self, tracking_uri: str | None, group: Any) -> None:
        import mlflow

        if self.run_id is None:
            active = mlflow.active_run()
            if active is not None and (tracking_uri is None or tracking_uri == mlflow.get_tracking_uri()):
                self.run_id = active.info.run_id
        if _broadcast_needed(self.all_ranks, self.run_id):
            import torch.distributed as dist

            box: list[Any] = [None]
            if dist.get_rank() == 0:
                self._create_run_now(fluent=False)
                box = [self.run_id]
            dist.broadcast_object_list(box, src=0, group=group)
            self.run_id = box[0]
            if self.run_id is None:
                log.warning("MLflowLogger: rank 0 could not create an MLflow run; not logging")
                self.active = False
            return
        if self.run_id is None and not self._create_run_now(fluent=tracking_uri is None):
            log.warning(
                "MLflowLogger: tracking server %s is not reachable; the run will be created "
                "when it answers, and metrics are buffered (bounded) until then",
                self.tracking_uri,
            )

    def _create_run_now(self, *, fluent: bool) -> bool:
        """Create (or start) the run if the server answers; False if it does not."""
        if not server_reachable(self.tracking_uri, self.probe_timeout):
            return False
        import mlflow
        from mlflow import MlflowClient

        tags = {"shardloader.telemetry": "1"}
        if fluent:
            experiment_id = (experiment_id_for(MlflowClient(self.tracking_uri), self.experiment)
                             if self.experiment is not None else None)
            run = mlflow.start_run(experiment_id=experiment_id, tags=tags)
            self._started_fluent_run = True
        else:
            client = MlflowClient(self.tracking_uri)
            run = client.create_run(experiment_id_for(client, self.experiment), tags=tags)
            self._owns_run = True
        self.run_id = run.info.run_id
        return True

    # -- producer side (training thread) ------------------------------------------------------
    def on_batch(self, record: BatchRecord) -> None:
        if not self.active:
            return
        if self._jsonl is not None:
            self._jsonl.on_batch(record)
        if self.every_n_steps > 1 and record.step % self.every_n_steps:
            return
        self._put(record)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if not self.active:
            return
        if self._jsonl is not None:
            self._jsonl.log_metrics(metrics, step)
        self._put(("m", dict(metrics), int(step), int(time.time() * 1000)))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait (at most `timeout` s) until everything so far is in MLflow; False if not."""
        if not self.active:
            return True
        timeout = self.close_timeout if timeout is None else timeout
        self._flush_deadline = time.monotonic() + timeout
        self._flush_ok = False
        ok = super().flush(timeout)
        if self._jsonl is not None:
            self._jsonl.flush(max(0.0, self._flush_deadline - time.monotonic()))
        return ok and self._flush_ok and self._state["metrics_pending"] == 0

    def close(self, timeout: float | None = None) -> None:
        """Deliver what is queued and stop, within about `timeout` (default close_timeout) s."""
        if self._closed:
            return
        timeout = self.close_timeout if timeout is None else timeout
        self._close_deadline = time.monotonic() + timeout
        super().close(timeout)
        if self._transport is not None and self._thread.is_alive():
            self._transport.kill()  # the thread is stuck talking to it: end it
        if self._jsonl is not None:
            self._jsonl.close(max(0.1, self._close_deadline - time.monotonic()))
        if self._started_fluent_run and self._state.get("healthy") and not self._thread.is_alive():
            import mlflow

            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.run_id:
                mlflow.end_run()

    # -- consumer side (background thread) ----------------------------------------------------
    def _handle(self, items: list[Any]) -> None:
        fields = self.fields
        rows: list[tuple[Any, ...]] = []
        for item in items:
            if isinstance(item, BatchRecord):
                rows.append(("b", item.step, int(item.time * 1000),
                             tuple(getattr(item, name) for name in fields)))
            else:
                rows.append(item)
        self._call("send", rows)

    def _idle(self) -> None:
        if self._transport is not None:
            self._call("tick")

    def _at_flush(self) -> None:
        if self._transport is None:  # nothing was ever sent: nothing to flush
            self._flush_ok = True
        elif time.monotonic() < self._flush_deadline:
            self._flush_ok = self._call("flush", self._flush_deadline)

    def _on_stop(self) -> None:
        if self._transport is None:
            if not self._owns_run:
                return
            self._transport = _ThreadTransport(self._delivery_config())  # just to end the run
        self._call("close", self._close_deadline)

    def _call(self, method: str, *args: Any) -> bool:
        """Run a transport method, switching to in-thread delivery if the writer process died."""
        if self._transport is None:
            self._transport = self._make_transport()
        try:
            state = getattr(self._transport, method)(*args)
        except OSError as exc:
            if not isinstance(self._transport, _ProcessTransport) or self._closed:
                raise
            log.warning("MLflowLogger: the writer process is gone (%r); delivering from this "
                        "process from now on (metrics it held are lost)", exc)
            self._transport = _ThreadTransport(self._delivery_config())
            state = getattr(self._transport, method)(*args)
        if state is None:
            return False
        self._state.update(state)
        if state.get("run_id") and self.run_id is None:
            self.run_id = state["run_id"]
        return True

    def _delivery_config(self) -> dict[str, Any]:
        return {
            "tracking_uri": self.tracking_uri, "run_id": self.run_id,
            "experiment": self.experiment,
            "keys": tuple(self.prefix + f + self.suffix for f in self.fields),
            "suffix": self.suffix, "max_pending": self.max_queue * max(1, len(self.fields)),
            "probe_timeout": self.probe_timeout, "owns_run": self._owns_run,
        }

    def _make_transport(self) -> Any:
        config = self._delivery_config()
        if self.process:
            try:
                return _ProcessTransport(config, self.flush_interval, self.close_timeout)
            except OSError as exc:
                log.warning("MLflowLogger: could not start the writer process (%r); "
                            "delivering from this process", exc)
        return _ThreadTransport(config)


class _ThreadTransport:
    """Delivery in the logger's own background thread."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.delivery = Delivery(**config)

    def send(self, rows: list[tuple[Any, ...]]) -> dict[str, Any]:
        self.delivery.add(rows)
        self.delivery.deliver()
        return self.delivery.state()

    def tick(self) -> dict[str, Any]:
        self.delivery.deliver()
        return self.delivery.state()

    def flush(self, deadline: float) -> dict[str, Any]:
        self.delivery.deliver(force=True)
        return self.delivery.state()

    def close(self, deadline: float) -> dict[str, Any]:
        self.delivery.stopping = True
        self.delivery.deliver(force=True)
        self.delivery.finish()
        return self.delivery.state()

    def kill(self) -> None:
        return None


class _ProcessTransport:
    """Delivery in a writer process (`python -m shardloader.telemetry._mlflow_writer`)."""

    def __init__(self, config: dict[str, Any], flush_interval: float,
                 orphan_seconds: float) -> None:
        from multiprocessing.connection import Connection

        mine, theirs = socket.socketpair()
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(shardloader.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH", "")) if p
        )
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "shardloader.telemetry._mlflow_writer",
                 str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, env=env, close_fds=True,
            )
        finally:
            theirs.close()
        self.conn = Connection(mine.detach())
        self.seq = 0
        self.conn.send({"delivery": config, "flush_interval": flush_interval,
                        "orphan_seconds": orphan_seconds})

    def _replies(self) -> list[tuple[Any, ...]]:
        out = []
        while self.conn.poll(0):
            out.append(self.conn.recv())
        return out

    def _latest_state(self, replies: list[tuple[Any, ...]]) -> dict[str, Any] | None:
        states = [r[-1] for r in replies if isinstance(r[-1], dict)]
        return states[-1] if states else None

    def send(self, rows: list[tuple[Any, ...]]) -> dict[str, Any] | None:
        self.conn.send(("rows", rows))
        return self._latest_state(self._replies())

    def tick(self) -> dict[str, Any] | None:
        if self.process.poll() is not None:
            raise OSError(f"writer process exited with status {self.process.returncode}")
        return self._latest_state(self._replies())

    def _wait_for(self, kind: str, seq: int | None, deadline: float) -> dict[str, Any] | None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.poll(left):
                return None
            reply = self.conn.recv()
            if reply[0] == kind and (seq is None or reply[1] == seq):
                return reply[-1]

    def flush(self, deadline: float) -> dict[str, Any] | None:
        self.seq += 1
        self.conn.send(("flush", self.seq))
        return self._wait_for("ack", self.seq, deadline)

    def close(self, deadline: float) -> dict[str, Any] | None:
        try:
            self.conn.send(("close",))
            state = self._wait_for("closed", None, deadline)
        except OSError:
            state = None
        try:
            self.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("MLflowLogger: the writer process did not finish in time; killing it")
        self.kill()
        self.conn.close()
        return state

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _broadcast_needed(all_ranks: bool, run_id: str | None) -> bool:
    if not all_ranks or run_id is not None:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
