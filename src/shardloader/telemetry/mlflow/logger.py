"""`MLflowLogger`: per-batch telemetry to MLflow, off the training thread, never blocking it.

The training thread only appends the record to a bounded queue (`on_batch` costs about a
microsecond). One daemon thread of the training process takes the queued records once per
`flush_interval` (or sooner when the queue is half full) and hands them to its `Delivery`
(`delivery`), which turns them into metrics (the training step is the MLflow step, the
record's time the timestamp) and sends them with MLflow's own `MlflowClient.log_batch`, up to
1,000 metrics per call.

No network call runs on the training thread: the constructor returns at once whatever the
tracking server does, and the run is created (or found) by the background thread. `run_id` is
None until that thread knows it; `wait_run_id(timeout)` waits for it, at most `timeout`
seconds. (Only a run in a local store, started when neither `run_id` nor `tracking_uri` is
given, is started on the calling thread, so that it is the thread's active run.)

A tracking server that is down or hangs never stalls or crashes training:
- when the queue is full, new records are dropped and counted (`dropped`);
- before talking to an HTTP server the background thread sends one short probe
  (`probe_timeout`): a server that is down costs it that much, and MLflow's own request
  timeout and retries apply to the calls themselves (`MLFLOW_HTTP_REQUEST_TIMEOUT`,
  `MLFLOW_HTTP_REQUEST_MAX_RETRIES`: the process's environment is the user's, so they are left
  as the user set them); a server that answers the probe and then hangs holds the thread,
  never training or `close()`;
- metrics that could not be sent stay in a bounded buffer and are retried with backoff (up to
  30 s apart); the oldest are dropped and counted (`metrics_dropped`) when it overflows;
- `close()` returns within `close_timeout` seconds whatever the server does (a thread still
  stuck then is a daemon and is left behind), and warns with the number of metrics not
  delivered; a logger never closed is closed the same way at interpreter exit.
- a loader worker forked from the training process has no copy of the thread (fork copies
  only the calling thread) and forgets the logger: its `close()` does nothing, since the run
  belongs to the training process. A killed trainer's run, left RUNNING, is marked FAILED by
  the next logger that creates a run in the same experiment on the same machine (`owner`).

A job's attempts (`shardloader.telemetry.job`): once a `Checkpointer` has made this process's
attempt (usually after the logger was made), the background thread puts the run under the
job's parent run and, at close, logs the job's accounting there (see `jobruns`).

Until issue 37 the delivery ran by default in a separate writer process; the package's
docstring has the measurements that retired it.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from shardloader.runtime.distenv import process_group_active, rank_and_world
from shardloader.telemetry.background import BackgroundSink
from shardloader.telemetry.mlflow import jobruns
from shardloader.telemetry.mlflow.delivery import Delivery, experiment_id_for, server_reachable
from shardloader.telemetry.mlflow.owner import owner_tags
from shardloader.telemetry.mlflow.probe import is_local_store
from shardloader.telemetry.records import LOGGABLE_FIELDS, BatchRecord
from shardloader.telemetry.sinks import JsonlLogger

log = logging.getLogger(__name__)

#: Metric fields logged per batch unless `fields=` says otherwise: fetch_seconds and what the
#: report needs to name its cause. Each metric costs the store 20-70 us of CPU, so the cache
#: counters, padding and epoch are opt-in (`fields=LOGGABLE_FIELDS` logs everything).
DEFAULT_FIELDS: tuple[str, ...] = (
    "fetch_seconds", "read_seconds", "transform_seconds", "shard_wait_seconds",
    "queue_depth", "samples",
)
__all__ = ["DEFAULT_FIELDS", "LOGGABLE_FIELDS", "MLflowLogger", "current_rank",
           "server_reachable"]


def current_rank() -> int:
    """This process's rank: torch.distributed's when initialised, else $RANK, else 0."""
    return rank_and_world(env_fallback=True)[0]


class MLflowLogger(BackgroundSink):
    """Logs every batch record (thinned by `every_n_steps`) as MLflow metrics.

    Where it logs: `run_id` if given; else the active MLflow run (when `tracking_uri` is not
    given or is the current one); else a new run in `experiment`, created by the background
    thread (tagged with this process as its owner) and ended (FINISHED) on `close()`.
    Exception: with neither `run_id` nor `tracking_uri` and MLflow's tracking URI a local store
    (MLflow's default), the run is started here as this thread's active run, so your own
    `mlflow.log_*` calls land in it too. `run_id` is None until known; `wait_run_id(timeout)` waits for it.

    Ranks: with `all_ranks=False` only rank 0 logs (elsewhere this is a no-op). With
    `all_ranks=True` every rank logs into the same run with keys suffixed `/rank{r}`; when
    torch.distributed is initialised and no run is given, rank 0 draws a token and broadcasts
    it (a collective: every rank constructs its logger at the same point); rank 0's background
    thread creates the run tagged with it, the others' find it by that tag.

    `fields` are the `BatchRecord` fields logged per batch (metric key = `prefix + field`).
    `jsonl_path` also writes every record to a JSON-lines file (see `JsonlLogger`).
    Time limits: `close_timeout` bounds `close()` (and `flush()` by default); `probe_timeout`
    the liveness probe before each delivery attempt. `request_timeout` is ignored, with a
    DeprecationWarning: it bounded each request of the writer process through that process's
    own environment (set `MLFLOW_HTTP_REQUEST_TIMEOUT` instead). `process` is ignored: it chose the writer process,
    removed (issue 37); `process=True` warns (DeprecationWarning). Job: when this process's
    attempt of a job is known (a `Checkpointer` made it), rank 0's run becomes a child of the job's parent run (`parent_run_id`), which
    gets the job's figures (`job/goodput`, `job/seconds/...`) at close. Counters: `dropped`
    (records refused, queue full), `metrics_logged`, `metrics_dropped` (buffer overflow or
    rejected by the server), `batch_calls` (log_batch calls), and in `counters()`
    `metrics_undelivered` (as of `close()`: every metric handed to the logger and not
    confirmed delivered).
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
        process: bool | None = None,
        flush_interval: float = 1.0,
        close_timeout: float = 10.0,
        probe_timeout: float = 2.0,
        request_timeout: float | None = None,
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
        if process:
            warnings.warn("MLflowLogger(process=True): the writer process was removed; metrics "
                          "are delivered from a background thread (the argument is ignored)",
                          DeprecationWarning, stacklevel=2)
        if request_timeout is not None:
            warnings.warn("MLflowLogger(request_timeout=...): ignored since the writer process, "
                          "whose own environment it bounded, was removed; set "
                          "MLFLOW_HTTP_REQUEST_TIMEOUT for MLflow's requests",
                          DeprecationWarning, stacklevel=2)
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
        self.run_id: str | None = run_id
        self._run_known = threading.Event()
        self._create_run = True  # False: find the run rank 0 creates (all_ranks)
        self._run_token: str | None = None
        self._sweep = False  # look for runs left RUNNING by dead trainers
        self._owner_tags = owner_tags()
        self._creator_pid = os.getpid()
        self._started_fluent_run = False  # mlflow.start_run on this thread: close() ends it
        self._job: dict[str, Any] | None = None  # this process's attempt ({}: unreadable)
        self._delivery: Delivery | None = None  # made by the background thread
        self._metrics_refused = 0  # metrics of records the queue refused (full)
        self._metrics_submitted = 0  # metrics handed to the delivery
        self._undelivered: int | None = None  # set by close()
        self._flush_deadline = 0.0
        self._close_deadline = 0.0
        self._flush_ok = True
        self._jsonl = JsonlLogger(jsonl_path, max_queue=max_queue) if jsonl_path and self.active else None
        if self.active or _broadcast_needed(all_ranks, run_id):
            self._resolve_run(tracking_uri, group)
        if self.run_id is not None:
            self._run_known.set()
        if self.active:
            _LIVE_LOGGERS.add(self)
            self._start()

    # -- counters (written by the background thread, read here: plain ints) ------------------
    @property
    def metrics_logged(self) -> int:
        return self._delivery.metrics_logged if self._delivery else 0

    @property
    def metrics_dropped(self) -> int:
        return self._delivery.metrics_dropped if self._delivery else 0

    @property
    def batch_calls(self) -> int:
        return self._delivery.batch_calls if self._delivery else 0

    @property
    def parent_run_id(self) -> str | None:
        """The job's parent run, once the background thread has put this run under it."""
        job = self._delivery.job if self._delivery else None
        return job.parent_id if job else None

    def counters(self) -> dict[str, int]:
        """Telemetry health: records dropped, metrics logged, dropped and still pending,
        log_batch calls, after `close()` the metrics not delivered, and under a job the failed
        calls for its parent run."""
        delivery = self._delivery
        out = {"records_dropped": self.dropped, "metrics_logged": self.metrics_logged,
               "metrics_dropped": self.metrics_dropped,
               "metrics_pending": len(delivery.pending) if delivery else 0,
               "batch_calls": self.batch_calls}
        if self._undelivered is not None:
            out["metrics_undelivered"] = self._undelivered
        if self._job:
            out["job_errors"] = delivery.job.errors if delivery and delivery.job else 0
        return out

    def wait_run_id(self, timeout: float = 10.0) -> str | None:
        """The run's id, waiting at most `timeout` seconds for the background thread to create
        or find it; None if it is not known by then (the server does not answer) or this rank
        does not log."""
        deadline = time.monotonic() + timeout
        while self.run_id is None and self.active and self._thread.is_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._run_known.wait(min(0.05, left))
        return self.run_id

    # -- run resolution (constructor, training thread: no network) ----------------------------
    def _resolve_run(self, tracking_uri: str | None, group: Any) -> None:
        import mlflow

        if self.run_id is None:
            active = mlflow.active_run()
            if active is not None and (tracking_uri is None or tracking_uri == mlflow.get_tracking_uri()):
                self.run_id = active.info.run_id
        if _broadcast_needed(self.all_ranks, self.run_id):
            import torch.distributed as dist

            first = rank_and_world()[0] == 0
            box: list[Any] = [uuid.uuid4().hex if first else None]
            dist.broadcast_object_list(box, src=0, group=group)
            self._run_token = box[0]
            self._create_run = first
            self._sweep = self._create_run
            return
        if self.run_id is None:
            self._sweep = True
            if tracking_uri is None and is_local_store(self.tracking_uri):
                self._start_fluent_run()

    def _start_fluent_run(self) -> None:
        """Start the run as this thread's active run: a local store, so no network."""
        import mlflow
        from mlflow import MlflowClient

        experiment_id = (experiment_id_for(MlflowClient(self.tracking_uri), self.experiment)
                         if self.experiment is not None else None)
        run = mlflow.start_run(experiment_id=experiment_id,
                               tags={"shardloader.telemetry": "1", **self._owner_tags})
        self._started_fluent_run = True
        self.run_id = run.info.run_id

    # -- producer side (training thread) ------------------------------------------------------
    def on_batch(self, record: BatchRecord) -> None:
        if not self.active:
            return
        if self._jsonl is not None:
            self._jsonl.on_batch(record)
        if self.every_n_steps > 1 and record.step % self.every_n_steps:
            return
        if not self._put(record):
            self._metrics_refused += len(self.fields)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if not self.active:
            return
        if self._jsonl is not None:
            self._jsonl.log_metrics(metrics, step)
        if not self._put(("m", dict(metrics), int(step), int(time.time() * 1000))):
            self._metrics_refused += _finite_count(metrics)

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
        return ok and self._flush_ok and self.counters()["metrics_pending"] == 0

    def close(self, timeout: float | None = None) -> None:
        """Deliver what is queued, end a run the logger created (FINISHED) and stop, within
        about `timeout` (default `close_timeout`) seconds whatever the server does. Warns with
        the number of metrics not delivered, if any."""
        if self._closed:
            return
        _LIVE_LOGGERS.discard(self)
        if os.getpid() != self._creator_pid:
            self._closed = True  # a forked child: the thread and the run are its parent's
            return
        timeout = self.close_timeout if timeout is None else timeout
        self._close_deadline = time.monotonic() + timeout
        super().close(timeout)
        stuck = self._thread.is_alive()  # a daemon: left behind, it ends with the process
        if self._jsonl is not None:
            self._jsonl.close(max(0.1, self._close_deadline - time.monotonic()))
        healthy = self._delivery is None or self._delivery.healthy
        if self._started_fluent_run and healthy and not stuck:
            import mlflow

            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.run_id:
                mlflow.end_run()
        if self.active:
            self._report_undelivered(timeout, stuck)

    def _close_gave_up(self, timeout: float) -> None:
        """The warning comes from close(), with the count of metrics not delivered."""

    def _report_undelivered(self, timeout: float, stuck: bool) -> None:
        queued = 0
        for item in self._queued_items():
            queued += len(self.fields) if isinstance(item, BatchRecord) else _finite_count(item[1])
        handed = self._metrics_refused + self._metrics_submitted + queued
        self._undelivered = max(0, handed - self.metrics_logged)
        if self._undelivered:
            why = (f"close() gave up after {timeout:.1f} s" if stuck
                   else "the tracking server did not take them")
            log.warning(
                "MLflowLogger: %d of %d metric(s) were not delivered to %s (%s; %d refused "
                "at a full queue, %d dropped from the buffer or rejected by the server)",
                self._undelivered, handed, self.tracking_uri, why, self._metrics_refused,
                self.metrics_dropped,
            )

    # -- consumer side (background thread) ----------------------------------------------------
    def _on_start(self) -> None:
        self._look_for_attempt()
        self._delivery = Delivery(
            tracking_uri=self.tracking_uri, run_id=self.run_id, experiment=self.experiment,
            keys=tuple(self.prefix + f + self.suffix for f in self.fields), suffix=self.suffix,
            max_pending=self.max_queue * max(1, len(self.fields)),
            probe_timeout=self.probe_timeout,
            owns_run=False, create_run=self._create_run, run_token=self._run_token,
            owner_tags=self._owner_tags, sweep=self._sweep, job=self._job or None)
        self._delivery.start()  # creates or finds the run right away
        self._run_is_known()

    def _run_is_known(self) -> None:
        if self.run_id is None and self._delivery is not None and self._delivery.run_id:
            self.run_id = self._delivery.run_id
            self._run_known.set()

    def _look_for_attempt(self) -> None:
        """Hand the delivery this process's attempt of a job once it exists (a module global
        read: cheap). Rank 0 only: one logger per attempt links the run to its job."""
        if self._job is not None or self.rank != 0:
            return
        try:
            attempt = jobruns.current_attempt()
            if attempt is None:
                return
            self._job = jobruns.attempt_info(attempt)
        except Exception as exc:  # noqa: BLE001 - the run still logs, only not under its job
            self._job = {}
            log.warning("MLflowLogger: could not read this process's job attempt (%r); the run "
                        "is not put under a job", exc)
            return
        if self._delivery is not None:
            self._delivery.set_job(self._job)

    def _handle(self, items: list[Any]) -> None:
        if self._delivery is None:  # its construction failed (warned): nothing can be sent
            raise RuntimeError("no MLflow client")
        fields = self.fields
        rows: list[tuple[Any, ...]] = []
        metrics = 0
        for item in items:
            if isinstance(item, BatchRecord):
                rows.append(("b", item.step, int(item.time * 1000),
                             tuple(getattr(item, name) for name in fields)))
                metrics += len(fields)
            else:
                rows.append(item)
                metrics += _finite_count(item[1])
        self._metrics_submitted += metrics
        self._delivery.add(rows)
        self._delivery.deliver()
        self._run_is_known()

    def _idle(self) -> None:
        self._look_for_attempt()
        if self._delivery is not None:
            self._delivery.deliver()
            self._run_is_known()

    def _at_flush(self) -> None:
        self._look_for_attempt()  # flush() also waits for the run to be put under its job
        if self._delivery is None:
            self._flush_ok = False
        elif time.monotonic() < self._flush_deadline:
            self._delivery.deliver(force=True, deadline=self._flush_deadline)
            self._run_is_known()
            self._flush_ok = True

    def _on_stop(self) -> None:
        self._look_for_attempt()
        if self._delivery is not None:
            self._delivery.close(self._close_deadline - _CLOSE_MARGIN)
            self._run_is_known()


# Seconds inside close()'s deadline at which the background thread stops starting MLflow
# calls, so that it ends before close() gives up on it.
_CLOSE_MARGIN = 0.5


def _finite_count(metrics: Mapping[str, Any]) -> int:
    """How many of `metrics` the delivery side logs (non-finite values are skipped)."""
    count = 0
    for value in metrics.values():
        try:
            count += math.isfinite(float(value))
        except (TypeError, ValueError):
            pass
    return count


# Loggers not closed yet: closed (bounded) at interpreter exit, while their daemon threads
# still run, so a script that never calls close() still delivers and ends its run. A forked
# child (a loader worker) forgets them: they, their threads and their runs belong to its parent.
_LIVE_LOGGERS: weakref.WeakSet[MLflowLogger] = weakref.WeakSet()


def _close_live_loggers() -> None:
    for logger in list(_LIVE_LOGGERS):
        if logger._creator_pid == os.getpid():
            try:
                logger.close()
            except Exception:  # noqa: BLE001 - exiting anyway
                log.exception("MLflowLogger: close at exit failed")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_LIVE_LOGGERS.clear)
atexit.register(_close_live_loggers)


def _broadcast_needed(all_ranks: bool, run_id: str | None) -> bool:
    if not all_ranks or run_id is not None:
        return False
    return process_group_active() and rank_and_world()[1] > 1
