"""A job in MLflow: one parent run per job, the run of each attempt's logger as its child, and
the job's accounting as metrics on both, so the MLflow UI shows goodput beside the loss.

A job is all the attempts that share a checkpoint directory (`shardloader.telemetry.job`);
each attempt's `MLflowLogger` run becomes a child (`mlflow.parentRunId`) of the job's parent
run, found in the same experiment by its tag `shardloader.job_id` (created, named after the
job, when the first attempt's logger gets there). At the logger's close the job's figures
(`account` over the job directory, with this attempt as the running one) are logged as
`job/...` metrics on the parent and this attempt's as `attempt/...` metrics on the child, at
the attempt's last step, so that each attempt adds a point to the job's goodput history.

Where it runs: `current_attempt` and `attempt_info` on the logger's background thread (a
module-global read each time it wakes: the attempt appears when the user creates a
`Checkpointer`, usually after the logger); everything else in its `Delivery` on the same
thread, never on the training thread. Nothing here raises into
training: `Delivery` catches and counts what fails.

The parent run is RUNNING while an attempt's logger links to it and FINISHED after each
attempt's logger has closed (the next attempt sets it RUNNING again).
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Any

log = logging.getLogger("shardloader.telemetry.mlflow")

TAG_JOB_ID = "shardloader.job_id"
TAG_JOB_NAME = "shardloader.job_name"
TAG_ATTEMPT_ID = "shardloader.attempt_id"
TAG_PARENT = "shardloader.parent"
TAG_PARENT_RUN = "mlflow.parentRunId"  # MLflow's own: the UI nests the run under that one

_JOB_ID = re.compile(r"[0-9a-f]{32}")
_LINK_BACKOFF_MAX = 30.0
# Error codes after which linking is not tried again (the run keeps logging metrics).
_PERMANENT = frozenset({"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE",
                        "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED"})
# The job's figures logged per section of the report: metric key prefix -> report key.
_JOB_SECTIONS = {"job/seconds/": "seconds", "job/samples/": "samples", "job/bytes/": "bytes",
                 "job/steps/": "steps"}

_recorder: Any = None  # shardloader.telemetry.job.recorder once imported; False: not there


def current_attempt() -> Any | None:
    """This process's attempt (`AttemptRecorder`), or None: no Checkpointer made one yet, or
    the job recorder is not part of this installation. Cheap after the first call."""
    global _recorder
    if _recorder is None:
        try:
            from shardloader.telemetry.job import recorder
        except ModuleNotFoundError as exc:
            if exc.name not in ("shardloader.telemetry.job", "shardloader.telemetry.job.recorder"):
                raise
            _recorder = False
        else:
            _recorder = recorder
    return _recorder.current_attempt() if _recorder else None


def attempt_info(attempt: Any) -> dict[str, Any]:
    """What the delivery needs to know of `attempt`, as a plain dict. `job_dir` None: no local
    directory holds the whole job (a remote checkpoint root: only this attempt's files are
    local), so no figures are logged."""
    job_dir = None if getattr(attempt, "remote", False) else attempt.job_dir
    return {"job_id": str(attempt.job_id), "job_name": str(attempt.job_name or ""),
            "attempt_id": str(attempt.attempt_id), "rank": int(attempt.rank),
            "world_size": int(attempt.world_size),
            "job_dir": None if job_dir is None else str(job_dir)}


def job_report(job_dir: str, attempt_id: str) -> dict[str, Any]:
    """The job's accounting (the report object of `shardloader.telemetry.job.account`) with
    `attempt_id` as the attempt still running."""
    from shardloader.telemetry.job.account import account
    from shardloader.telemetry.job.read import read_job_dir

    return account(read_job_dir(job_dir), running=attempt_id)


def _numbers(prefix: str, figures: Any) -> dict[str, float]:
    """`figures`' finite numbers (not bools, not None) as metrics `prefix + key`."""
    out: dict[str, float] = {}
    if not isinstance(figures, dict):
        return out
    for key, value in figures.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[f"{prefix}{key}"] = float(value)
    return out


def job_metrics(report: dict[str, Any], attempt_id: str
                ) -> tuple[dict[str, float], dict[str, float], int]:
    """The parent run's metrics, the child run's (attempt `attempt_id`) and their step (the
    attempt's last training step; 0 when unknown) from a job report."""
    parent = _numbers("job/", {"goodput": report.get("goodput"),
                               "wall_seconds": report.get("wall_seconds"),
                               "attempts": len(report.get("attempts") or ())})
    for prefix, section in _JOB_SECTIONS.items():
        parent.update(_numbers(prefix, report.get(section)))
    mine = next((a for a in report.get("attempts") or () if a.get("id") == attempt_id), None)
    child: dict[str, float] = {}
    step = 0
    if mine is not None:
        child.update(_numbers("attempt/seconds/", mine.get("seconds")))
        child.update(_numbers("attempt/", {"wall_seconds": mine.get("wall_seconds"),
                                           "lost_steps": mine.get("lost_steps")}))
        last = mine.get("last_step")
        step = int(last) if isinstance(last, (int, float)) and math.isfinite(last) else 0
    return parent, child, step


class JobRuns:
    """The job's parent run and this attempt's link to it, for one `Delivery`.

    `link` puts the logger's run under the parent (retried with backoff when it fails, given
    up after an error that will not go away); `close` logs the job's accounting at the
    logger's close and ends the parent. Counters: `errors` (failed MLflow calls or
    accounting), `metrics_logged`."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = dict(info)
        self.parent_id: str | None = None
        self.linked = False
        self.gave_up = False
        self.errors = 0
        self.metrics_logged = 0
        self._backoff = 0.0
        self._next_try = 0.0

    def wants_link(self, force: bool = False) -> bool:
        """Whether linking is still to be done (and, unless `force`, not backing off)."""
        if self.linked or self.gave_up:
            return False
        return force or time.monotonic() >= self._next_try

    def link(self, client: Any, run_id: str, *, rename: bool) -> None:
        """Find or create the parent run in `run_id`'s experiment and make `run_id` its child
        (`rename`: also name it after the attempt: the logger created it). Raises on failure
        (after counting it and setting the backoff or giving up); `Delivery` logs it."""
        try:
            self._link(client, run_id, rename=rename)
        except Exception as exc:
            self.errors += 1
            if isinstance(exc, ValueError) or getattr(exc, "error_code", None) in _PERMANENT:
                self.gave_up = True
            self._backoff = min(_LINK_BACKOFF_MAX, max(1.0, self._backoff * 2))
            self._next_try = time.monotonic() + self._backoff
            raise

    def _link(self, client: Any, run_id: str, *, rename: bool) -> None:
        from mlflow.entities import RunTag

        job_id = self.info["job_id"]
        if not _JOB_ID.fullmatch(job_id):
            raise ValueError(f"job id {job_id!r} is not 32 lowercase hex digits")
        child = client.get_run(run_id)
        experiment_id = child.info.experiment_id
        parent = find_parent(client, experiment_id, job_id)
        theirs = child.data.tags.get(TAG_PARENT_RUN)
        if theirs and (parent is None or theirs != parent.info.run_id):
            self.gave_up = True
            log.warning("MLflow run %s has a parent run of its own (%s): not putting it under "
                        "job %s's parent run", run_id, theirs, job_id)
            return
        if parent is None:
            parent = create_parent(client, experiment_id, job_id, self.info["job_name"])
        parent_id = parent.info.run_id
        client.log_batch(run_id, tags=[RunTag(TAG_PARENT_RUN, parent_id),
                                       RunTag(TAG_JOB_ID, job_id),
                                       RunTag(TAG_ATTEMPT_ID, self.info["attempt_id"])])
        if rename:
            client.update_run(run_id, name=f"attempt {self.info['attempt_id']}")
        if parent.info.status != "RUNNING":
            client.update_run(parent_id, status="RUNNING")  # an attempt of the job runs again
        self.parent_id = parent_id
        self.linked = True

    def close(self, client: Any, run_id: str, deadline: float) -> None:
        """At the logger's close (the run is linked): log the job's accounting to the parent
        run and this attempt's to `run_id` (when the job directory is local), then mark the
        parent FINISHED. Never raises: what fails is logged as a warning and counted."""
        if not self.linked:
            return
        job_dir = self.info["job_dir"]
        report = None
        if job_dir is not None and time.monotonic() < deadline:
            try:
                report = job_report(job_dir, self.info["attempt_id"])
            except Exception as exc:  # noqa: BLE001 - the accounting must not break close()
                self.errors += 1
                log.warning("could not account job %s from %s for MLflow (its parent run gets "
                            "no figures): %r", self.info["job_id"], job_dir, exc)
        try:
            if report is not None:
                self._log(client, run_id, report)
            client.set_terminated(self.parent_id, status="FINISHED")
        except Exception as exc:  # noqa: BLE001 - the server's problem, not training's
            self.errors += 1
            log.warning("could not log job %s's figures to MLflow run %s: %r",
                        self.info["job_id"], self.parent_id, exc)

    def _log(self, client: Any, run_id: str, report: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        parent, child, step = job_metrics(report, self.info["attempt_id"])
        now = int(time.time() * 1000)
        for target, metrics in ((self.parent_id, parent), (run_id, child)):
            if metrics:
                client.log_batch(target, metrics=[Metric(k, v, now, step)
                                                  for k, v in metrics.items()])
                self.metrics_logged += len(metrics)


def find_parent(client: Any, experiment_id: str, job_id: str) -> Any | None:
    """The parent run of job `job_id` (32 hex digits) in the experiment (the earliest, should
    there be two), or None."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{TAG_JOB_ID}` = '{job_id}' and tags.`{TAG_PARENT}` = '1'",
        order_by=["attributes.start_time ASC"], max_results=1)
    return runs[0] if runs else None


def create_parent(client: Any, experiment_id: str, job_id: str, job_name: str) -> Any:
    """A new parent run for job `job_id`, named after the job. Not tagged with an owner
    process: it outlives every attempt, so no sweep for dead trainers' runs marks it FAILED."""
    return client.create_run(experiment_id, run_name=job_name or f"job {job_id[:8]}",
                             tags={TAG_JOB_ID: job_id, TAG_JOB_NAME: job_name, TAG_PARENT: "1"})
