"""Delivery of metric rows to MLflow: run creation, buffering, batching, health checks, backoff.

`Delivery` is what talks to MLflow, with MLflow's own client (`MlflowClient.log_batch`, up to
1,000 metrics a call), on `MLflowLogger`'s background thread, never on the training thread:
creating the run (or, for the other ranks of an `all_ranks` logger, finding rank 0's run by
its token), logging, putting the run under its job's parent run, ending it. Each call to an
HTTP tracking server runs with MLflow's own request timeout and retries (its defaults: 120 s a
request, 7 retries; `MLFLOW_HTTP_REQUEST_TIMEOUT`, `MLFLOW_HTTP_REQUEST_MAX_RETRIES`). They are
not changed here: they are read from the process's environment, which in the training process
is the user's (the writer process this replaced set them in its own), and changing a
variable from this thread while others may read the C environment is not safe. A short probe
with its own timeout runs before each attempt, so a server that is down costs the thread
`probe_timeout`; one that answers the probe and then hangs holds this thread, never training
nor `close()` (the logger abandons a stuck thread at its deadline, counting what it did not
deliver).

Rows (what the logger hands over), plain tuples:
    ("b", step, timestamp_ms, (value, ...))  - one batch record, values in `keys` order
    ("m", {name: value}, step, timestamp_ms) - free-form metrics (name gets the rank suffix)
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from shardloader.telemetry.mlflow.jobruns import JobRuns
from shardloader.telemetry.mlflow.owner import TAG_HOST, owner_is_gone
from shardloader.telemetry.mlflow.probe import is_http, probe

log = logging.getLogger("shardloader.telemetry.mlflow")

#: MLflow accepts at most this many metrics per log_batch call.
MAX_METRICS_PER_CALL = 1000
#: Tag of the run shared by the ranks of an `all_ranks=True` logger (rank 0 creates it).
TAG_RUN_TOKEN = "shardloader.run_token"
# Errors that will not go away by retrying: drop the chunk instead of retrying it forever.
_PERMANENT_ERROR_CODES = frozenset({
    "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "BAD_REQUEST",
    "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_LIMIT_EXCEEDED",
})
_MAX_BACKOFF = 30.0
_STALE_RUNS_CHECKED = 200  # RUNNING runs of this host looked at when a run is created


def server_reachable(tracking_uri: str, timeout: float = 2.0) -> bool:
    """For http(s) tracking URIs: does the server answer an HTTP request within `timeout`?
    Other stores: True."""
    return probe(tracking_uri, timeout) is None


def experiment_id_for(client: Any, experiment: str | None, *, create: bool = True) -> str | None:
    """The id of experiment `experiment` (created if new and `create`; None if it does not
    exist and not `create`), else $MLFLOW_EXPERIMENT_ID or "0"."""
    if experiment is not None:
        found = client.get_experiment_by_name(experiment)
        if found is not None:
            return found.experiment_id
        if not create:
            return None
        try:
            return client.create_experiment(experiment)
        except Exception:  # noqa: BLE001 - created meanwhile by another rank or process
            found = client.get_experiment_by_name(experiment)
            if found is None:
                raise
            return found.experiment_id
    return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")  # "0": every store's Default


class Delivery:
    """Creates or finds the run, buffers metric rows and sends them with `log_batch`, never
    raising.

    A server that is down or silent costs one short probe per attempt (`probe_timeout`), not
    MLflow's retry loop; failed attempts back off up to 30 s; the buffer holds at most
    `max_pending` metrics and drops the oldest beyond that (counted). `run_id` None means the
    run is made here when the server answers: created (in `experiment`, tagged with
    `owner_tags` and `run_token`) when `create_run`, else found by its `run_token` tag (rank 0
    creates it). `owns_run` marks a run this side ends on `finish()`. `job` (or a later
    `set_job`): the job's attempt; the run is then put under the job's parent run, and
    `close()` logs the job's figures (see `jobruns`).
    """

    def __init__(self, *, tracking_uri: str, run_id: str | None, experiment: str | None,
                 keys: tuple[str, ...], suffix: str, max_pending: int, probe_timeout: float,
                 owns_run: bool, create_run: bool = True, run_token: str | None = None,
                 owner_tags: dict[str, str] | None = None, sweep: bool = False,
                 job: dict[str, Any] | None = None) -> None:
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
        self.create_run = create_run
        self.run_token = run_token
        self.owner_tags = dict(owner_tags or {})
        self.pending: deque[Any] = deque()
        self.healthy = True
        self.waiting_for_run = False  # the server answers; rank 0's run is not there yet
        self.stopping = False
        self.swept = not sweep  # sweep: look for runs left RUNNING by dead trainers
        self.job = JobRuns(job) if job is not None else None
        self._backoff = 0.0
        self._next_attempt = 0.0
        self._last_warning = 0.0
        self.metrics_logged = 0
        self.metrics_dropped = 0
        self.batch_calls = 0

    def set_job(self, info: dict[str, Any]) -> None:
        """This process's attempt of a job became known: put the run under its parent run."""
        if self.job is None:
            self.job = JobRuns(info)

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

    # -- the run --------------------------------------------------------------------------------
    def start(self) -> None:
        """First attempt to create or find the run, right when the delivery side starts (for a
        run created by the logger itself: look for runs left RUNNING by dead trainers)."""
        if self.run_id is None:
            self.deliver(force=True)
            return
        if self.swept or not server_reachable(self.tracking_uri, self.probe_timeout):
            return
        try:
            experiment_id = self.client.get_run(self.run_id).info.experiment_id
        except Exception as exc:  # noqa: BLE001 - best effort
            log.warning("could not read MLflow run %s: %r", self.run_id, exc)
            return
        self._mark_stale_runs_failed(experiment_id)

    def _ensure_run(self) -> bool:
        """Create or find the run; False (after `_failed`) if that is not possible now."""
        if self.run_id is not None:
            return True
        try:
            if self.create_run:
                experiment_id = experiment_id_for(self.client, self.experiment)
                tags = {"shardloader.telemetry": "1", **self.owner_tags}
                if self.run_token:
                    tags[TAG_RUN_TOKEN] = self.run_token
                run = self.client.create_run(experiment_id, tags=tags)
                self.run_id = run.info.run_id
                self.owns_run = True
                self._mark_stale_runs_failed(experiment_id)
            else:
                self.run_id = self._find_shared_run()
                if self.run_id is None:
                    self.waiting_for_run = True
                    self._failed("waiting for rank 0 to create the shared MLflow run")
                    return False
        except Exception as exc:  # noqa: BLE001 - the server's problem, not training's
            self._failed(f"could not create an MLflow run: {exc!r}")
            return False
        self.waiting_for_run = False
        return True

    def _find_shared_run(self) -> str | None:
        experiment_id = experiment_id_for(self.client, self.experiment, create=False)
        if experiment_id is None:
            return None
        runs = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{TAG_RUN_TOKEN}` = '{self.run_token}'",
            max_results=1)
        return runs[0].info.run_id if runs else None

    def _mark_stale_runs_failed(self, experiment_id: str) -> None:
        """Mark RUNNING runs of this experiment whose owner process died (on this machine)
        FAILED: a SIGKILLed trainer could not end its run itself."""
        if self.swept or TAG_HOST not in self.owner_tags:
            return
        self.swept = True
        host = self.owner_tags.get(TAG_HOST, "").replace("'", "")
        try:
            runs = self.client.search_runs(
                [experiment_id],
                filter_string=f"attributes.status = 'RUNNING' and tags.`{TAG_HOST}` = '{host}'",
                max_results=_STALE_RUNS_CHECKED)
            for run in runs:
                if run.info.run_id == self.run_id or not owner_is_gone(run.data.tags):
                    continue
                self.client.set_terminated(run.info.run_id, status="FAILED")
                self.client.set_tag(run.info.run_id, "shardloader.ended",
                                    "marked FAILED: its training process ended without "
                                    "closing the logger (killed or crashed)")
                log.warning("MLflow run %s was still RUNNING but its training process (%s) is "
                            "gone: marked FAILED", run.info.run_id,
                            run.data.tags.get("shardloader.pid", "?"))
        except Exception as exc:  # noqa: BLE001 - best effort
            log.warning("could not check for runs left RUNNING by dead processes: %r", exc)

    # -- sending --------------------------------------------------------------------------------
    def deliver(self, force: bool = False, deadline: float | None = None) -> None:
        """Send what is buffered (creating the run first), unless backing off (`force` retries
        now)."""
        linking = self.job is not None and self.job.wants_link(force)
        if not self.pending and self.run_id is not None and not linking:
            return
        if not force and time.monotonic() < self._next_attempt:
            return
        if is_http(self.tracking_uri):
            reason = probe(self.tracking_uri, self.probe_timeout)
            if reason is not None:
                self._failed(f"tracking server {self.tracking_uri}: {reason}")
                return
        self._send(linking)

    def _send(self, linking: bool) -> None:
        if not self._ensure_run():
            return
        if linking:
            self._link_job()
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

    def _link_job(self) -> None:
        """Put the run under its job's parent run; a failure is warned about and retried
        later (with its own backoff), never holding back the metrics."""
        try:
            self.job.link(self.client, self.run_id, rename=self.owns_run)
        except Exception as exc:  # noqa: BLE001 - the server's problem, not training's
            again = "" if self.job.gave_up else "; will retry"
            self._warn(f"MLflow telemetry: could not put run {self.run_id} under job "
                       f"{self.job.info['job_id']}'s parent run: {exc!r}{again}")

    def close(self, deadline: float) -> None:
        """Last delivery, the job's figures and the end of its parent run (when the run is
        under one and the server answers), then end a run this side created. One attempt,
        except while the server answers and only rank 0's shared run is still missing
        (retried until `deadline`, a time.monotonic() value)."""
        self.stopping = True
        self.deliver(force=True, deadline=deadline)
        while self.waiting_for_run and time.monotonic() + 0.3 < deadline:
            time.sleep(0.2)  # rank 0 is creating the run right now; nothing to wait on but time
            self.deliver(force=True, deadline=deadline)
        job = self.job
        if (job is not None and job.linked and self.healthy
                and server_reachable(self.tracking_uri, self.probe_timeout)):
            job.close(self.client, self.run_id, deadline)
        self.finish(deadline)

    def finish(self, deadline: float | None = None) -> None:
        """Mark a run this side created FINISHED (only if the server answers)."""
        if self.owns_run and self.healthy and self.run_id is not None:
            if not server_reachable(self.tracking_uri, self.probe_timeout):
                return
            try:
                self.client.set_terminated(self.run_id, status="FINISHED")
            except Exception as exc:  # noqa: BLE001
                log.warning("could not mark MLflow run %s FINISHED: %r", self.run_id, exc)
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
