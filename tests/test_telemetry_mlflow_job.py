"""A job in MLflow, against a real `mlflow server`: the attempts' logger runs become children of
one parent run per job, which gets the job's figures at each close; a logger with no attempt
is as before; a dead server costs close() no more than its bound."""

from __future__ import annotations

import importlib.util
import logging
import math
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass

import pytest
from mlflow import MlflowClient

from shardloader.telemetry import BatchRecord, MLflowLogger
from shardloader.telemetry.mlflow import jobruns

ATTEMPT_KINDS = ("productive", "data_wait", "checkpoint", "restore", "startup",
                 "lost_progress", "other")
JOB_KINDS = ATTEMPT_KINDS + ("between_attempts",)


@dataclass
class StandInAttempt:
    """What the logger reads of an `AttemptRecorder`."""

    job_id: str
    job_name: str
    attempt_id: str
    job_dir: str | None
    rank: int = 0
    world_size: int = 1


class Job:
    """A stand-in job: the attempt the logger finds, and the accounting it gets (one report per
    close, over the attempts so far, with distinct non-round figures)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, job_dir: str | None) -> None:
        self.job_id = uuid.uuid4().hex
        self.job_dir = job_dir
        self.attempt: StandInAttempt | None = None
        self.calls: list[tuple[str, str]] = []
        self.reports: list[dict] = []
        monkeypatch.setattr(jobruns, "current_attempt", lambda: self.attempt)
        monkeypatch.setattr(jobruns, "job_report", self.report)

    def start(self, attempt_id: str) -> None:
        self.attempt = StandInAttempt(self.job_id, "resnet-tiny", attempt_id, self.job_dir)

    def report(self, job_dir: str, running: str) -> dict:
        self.calls.append((job_dir, running))
        ids = [attempt for _, attempt in self.calls]
        attempts = [{"id": a, "ended": "finished", "wall_seconds": 10.125 + i,
                     "first_step": 1 + 10 * i, "last_step": 10 * (i + 1), "lost_steps": 3 - i,
                     "restored_step": None if i == 0 else 10 * i,
                     "seconds": {k: 0.5 + i + j / 7 for j, k in enumerate(ATTEMPT_KINDS)}}
                    for i, a in enumerate(ids)]
        n = len(ids)
        report = {"job": {"job_id": self.job_id, "name": "resnet-tiny"},
                  "wall_seconds": 21.5 * n, "goodput": 0.3 + n / 9,
                  "seconds": {k: 1.25 * n + j / 3 for j, k in enumerate(JOB_KINDS)},
                  "steps": {"trained": 10 * n + 3, "recomputed": 3, "lost": 3 + n},
                  "samples": {"trained": 640 * n, "recomputed": 192, "trained_twice": 0,
                              "never_trained": 0},
                  "bytes": {"remote_read": 1_000_003 * n, "cache_hits": 77, "redownloaded": 0,
                            "checkpoint_written": 4096 * n, "cache_peak": 123_456},
                  "attempts": attempts, "cost": None}
        self.reports.append(report)
        return report


def records(n: int) -> list[BatchRecord]:
    return [BatchRecord(step=i, epoch=0, rank=0, samples=4, fetch_seconds=0.001 * i + 1 / 3,
                        time=1.79e9 + i, read_seconds=0.0, transform_seconds=0.0,
                        shard_wait_seconds=0.0, queue_depth=1) for i in range(n)]


def experiment_id(client: MlflowClient, name: str) -> str:
    return client.get_experiment_by_name(name).experiment_id


def parents(client: MlflowClient, exp: str) -> list:
    return client.search_runs([exp], filter_string=f"tags.`{jobruns.TAG_PARENT}` = '1'")


def children(client: MlflowClient, exp: str, parent_id: str) -> list:
    return client.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")


def expected_figures(report: dict, attempt_id: str) -> tuple[dict, dict, int]:
    attempt = next(a for a in report["attempts"] if a["id"] == attempt_id)
    parent = {"job/goodput": report["goodput"], "job/wall_seconds": report["wall_seconds"],
              "job/attempts": float(len(report["attempts"]))}
    for section in ("seconds", "samples", "bytes", "steps"):
        parent.update({f"job/{section}/{k}": float(v) for k, v in report[section].items()})
    child = {f"attempt/seconds/{k}": v for k, v in attempt["seconds"].items()}
    child["attempt/wall_seconds"] = attempt["wall_seconds"]
    child["attempt/lost_steps"] = float(attempt["lost_steps"])
    return parent, child, attempt["last_step"]


def test_two_attempts_make_one_parent_run_with_two_children_and_the_jobs_figures(
        mlflow_server, monkeypatch, tmp_path):
    job = Job(monkeypatch, str(tmp_path / ".job"))
    experiment = f"job-{uuid.uuid4().hex[:8]}"
    attempt_ids = ["20260101T120000-0a1b2c3d", "20260101T121500-4e5f6a7b"]
    run_ids = []
    for attempt_id in attempt_ids:
        job.attempt = None  # the README's order: the logger first, then the Checkpointer
        logger = MLflowLogger(tracking_uri=mlflow_server, experiment=experiment,
                              flush_interval=0.05, fields=("fetch_seconds",))
        run_ids.append(logger.wait_run_id(60))
        assert run_ids[-1] is not None and logger.parent_run_id is None
        job.start(attempt_id)
        for record in records(5):
            logger.on_batch(record)
        assert logger.flush(60)
        assert logger.parent_run_id is not None  # flush() also waits for the link
        logger.close()
        assert logger.counters()["metrics_undelivered"] == 0
    client = MlflowClient(mlflow_server)
    exp = experiment_id(client, experiment)
    [parent] = parents(client, exp)
    assert parent.info.run_name == "resnet-tiny"
    assert parent.info.status == "FINISHED"
    assert parent.data.tags[jobruns.TAG_JOB_ID] == job.job_id
    assert parent.data.tags[jobruns.TAG_JOB_NAME] == "resnet-tiny"
    kids = {run.info.run_id: run for run in children(client, exp, parent.info.run_id)}
    assert set(kids) == set(run_ids)
    for run_id, attempt_id in zip(run_ids, attempt_ids):
        kid = kids[run_id]
        assert kid.data.tags[jobruns.TAG_ATTEMPT_ID] == attempt_id
        assert kid.data.tags[jobruns.TAG_JOB_ID] == job.job_id
        assert kid.info.run_name == f"attempt {attempt_id}"
        assert kid.info.status == "FINISHED"
        assert [m.value for m in sorted(client.get_metric_history(run_id, "fetch_seconds"),
                                        key=lambda m: m.step)] == [r.fetch_seconds
                                                                   for r in records(5)]
    # Each close accounted the job with its own attempt as the running one.
    assert job.calls == [(job.job_dir, a) for a in attempt_ids]
    # The parent: the latest figures, and one point per attempt at its last step.
    figures = [expected_figures(report, a) for report, a in zip(job.reports, attempt_ids)]
    parent_now, _, _ = figures[-1]
    assert parent.data.metrics == parent_now
    assert {f"job/seconds/{k}" for k in JOB_KINDS} <= parent.data.metrics.keys()
    goodput = sorted(client.get_metric_history(parent.info.run_id, "job/goodput"),
                     key=lambda m: m.step)
    assert [(m.step, m.value) for m in goodput] == [(step, p["job/goodput"])
                                                    for p, _, step in figures]
    for run_id, (_, child, step) in zip(run_ids, figures):
        metrics = kids[run_id].data.metrics
        assert {k: v for k, v in metrics.items() if k.startswith("attempt/")} == child
        assert [m.step for m in client.get_metric_history(run_id, "attempt/wall_seconds")] == [step]


def test_a_logger_without_an_attempt_is_as_before(mlflow_server, monkeypatch, tmp_path):
    job = Job(monkeypatch, str(tmp_path / ".job"))  # never started: no attempt
    experiment = f"no-job-{uuid.uuid4().hex[:8]}"
    logger = MLflowLogger(tracking_uri=mlflow_server, experiment=experiment,
                          flush_interval=0.05, fields=("fetch_seconds",))
    for record in records(7):
        logger.on_batch(record)
    assert logger.flush(60)
    logger.close()
    assert logger.parent_run_id is None and job.calls == []
    counters = logger.counters()
    assert counters.pop("batch_calls") >= 1
    assert counters == {"records_dropped": 0, "metrics_logged": 7, "metrics_dropped": 0,
                        "metrics_pending": 0, "metrics_undelivered": 0}
    client = MlflowClient(mlflow_server)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    job_tags = {"mlflow.parentRunId", jobruns.TAG_JOB_ID, jobruns.TAG_ATTEMPT_ID}
    assert not job_tags & run.data.tags.keys()
    assert run.data.metrics.keys() == {"fetch_seconds"}
    assert parents(client, experiment_id(client, experiment)) == []


def test_an_attempt_known_at_the_start_links_the_run_and_a_remote_job_gets_no_figures(
        mlflow_server, monkeypatch):
    # The attempt exists before the logger: its thread links the run as it creates it; a job
    # whose directory is not local (a remote checkpoint root) is not accounted here.
    job = Job(monkeypatch, None)
    experiment = f"job-early-{uuid.uuid4().hex[:8]}"
    job.start("20260102T080000-89abcdef")
    logger = MLflowLogger(tracking_uri=mlflow_server, experiment=experiment, flush_interval=0.05,
                          fields=("fetch_seconds",))
    for record in records(3):
        logger.on_batch(record)
    assert logger.flush(60)
    assert logger.parent_run_id is not None
    logger.close()
    client = MlflowClient(mlflow_server)
    exp = experiment_id(client, experiment)
    [parent] = parents(client, exp)
    assert parent.info.run_id == logger.parent_run_id and parent.info.status == "FINISHED"
    assert [r.info.run_id for r in children(client, exp, parent.info.run_id)] == [logger.run_id]
    assert parent.data.metrics == {}
    assert len(client.get_metric_history(logger.run_id, "fetch_seconds")) == 3


def test_an_account_that_fails_is_a_warning_and_the_runs_still_end(
        mlflow_server, monkeypatch, tmp_path, caplog):
    job = Job(monkeypatch, str(tmp_path / ".job"))

    def broken(job_dir: str, running: str) -> dict:
        raise ValueError("attempt 20260103T000000-00000000 rank 0: counters: no steps")

    monkeypatch.setattr(jobruns, "job_report", broken)
    caplog.set_level(logging.WARNING, logger="shardloader.telemetry.mlflow")
    experiment = f"job-broken-{uuid.uuid4().hex[:8]}"
    job.start("20260103T000000-00000000")
    logger = MLflowLogger(tracking_uri=mlflow_server, experiment=experiment,
                          flush_interval=0.05, fields=("fetch_seconds",))
    logger.on_batch(records(1)[0])
    logger.close()
    client = MlflowClient(mlflow_server)
    parent = client.get_run(logger.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.metrics == {}
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics.keys() == {"fetch_seconds"}
    assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert logger.counters()["job_errors"] == 1
    warnings = [r.getMessage() for r in caplog.records if "could not account job" in r.getMessage()]
    assert len(warnings) == 1 and "counters: no steps" in warnings[0], warnings


def test_a_run_with_a_parent_of_its_own_is_left_there(mlflow_server, monkeypatch, tmp_path):
    job = Job(monkeypatch, str(tmp_path / ".job"))
    client = MlflowClient(mlflow_server)
    exp = client.create_experiment(f"own-parent-{uuid.uuid4().hex[:8]}")
    theirs = client.create_run(exp).info.run_id
    run_id = client.create_run(exp, tags={"mlflow.parentRunId": theirs}).info.run_id
    job.start("20260104T000000-11111111")
    logger = MLflowLogger(run_id=run_id, tracking_uri=mlflow_server,
                          flush_interval=0.05, fields=("fetch_seconds",))
    logger.on_batch(records(1)[0])
    logger.close()
    assert client.get_run(run_id).data.tags["mlflow.parentRunId"] == theirs
    assert logger.parent_run_id is None and job.calls == []
    assert parents(client, exp) == []  # no parent run made for a run that cannot join it


def test_a_dead_server_does_not_hold_close_beyond_its_bound(dead_tracking_uri, monkeypatch,
                                                            tmp_path):
    job = Job(monkeypatch, str(tmp_path / ".job"))
    job.start("20260105T000000-22222222")
    start = time.monotonic()
    logger = MLflowLogger(tracking_uri=dead_tracking_uri, experiment="x",
                          flush_interval=0.01, fields=("fetch_seconds",))
    assert time.monotonic() - start < 5
    for record in records(50):
        logger.on_batch(record)
    assert logger.flush(timeout=2) is False
    start = time.monotonic()
    logger.close(timeout=3)
    assert time.monotonic() - start < 4
    assert logger.run_id is None and logger.parent_run_id is None
    assert job.calls == []  # nothing to account for a server that does not answer


def test_job_metrics_skip_what_is_not_a_finite_number():
    report = {"goodput": 0.5, "wall_seconds": math.inf, "seconds": {"productive": 2.0,
                                                                    "other": math.nan},
              "steps": {"trained": 4}, "samples": None, "bytes": {"remote_read": True},
              "attempts": [{"id": "a", "seconds": {"productive": 1.5}, "wall_seconds": None,
                            "lost_steps": 2, "last_step": None}]}
    parent, child, step = jobruns.job_metrics(report, "a")
    assert parent == {"job/goodput": 0.5, "job/attempts": 1.0, "job/seconds/productive": 2.0,
                      "job/steps/trained": 4.0}
    assert child == {"attempt/seconds/productive": 1.5, "attempt/lost_steps": 2.0}
    assert step == 0
    assert jobruns.job_metrics(report, "not-there")[1:] == ({}, 0)


# -- the real job records: two attempts of a small training script ------------------------------
_REAL = all(importlib.util.find_spec(name) is not None for name in (
    "shardloader.telemetry.job.account", "shardloader.telemetry.job.read",
    "shardloader.telemetry.job.recorder", "shardloader.checkpoint.job"))

TRAINER = textwrap.dedent("""
    import sys
    from shardloader.checkpoint import Checkpointer
    from shardloader.dataset.sharded import Dataset
    from shardloader.loader import Loader
    from shardloader.telemetry import MLflowLogger

    uri, experiment, data, root, last = sys.argv[1:6]
    logger = MLflowLogger(tracking_uri=uri, experiment=experiment, flush_interval=0.05)
    loader = Loader(Dataset(data), 4, num_workers=0, seed=1, telemetry=logger)
    ckpt = Checkpointer(root)
    step = 0
    if ckpt.latest() is not None:
        step = ckpt.load(loader=loader)
    for batch in loader:
        step += 1
        if step % 4 == 0:
            ckpt.save(step, loader=loader)
        if step == int(last):
            break
    assert logger.flush(60)
    print(logger.wait_run_id(0), logger.parent_run_id, flush=True)
    ckpt.close()
    loader.close()
    logger.close()
""")


@pytest.mark.skipif(not _REAL, reason="shardloader.telemetry.job (recorder, read, account) is "
                                      "not there yet: the stand-in tests above cover the logger")
def test_two_real_attempts_give_the_parent_the_accounts_figures(mlflow_server, tmp_path):
    from shardloader.ingest.writer import write_shards
    from shardloader.telemetry.job.account import account
    from shardloader.telemetry.job.read import read_job_dir
    from tests.fixtures.data import make_samples

    data, root = tmp_path / "ds", tmp_path / "ckpt"
    write_shards(make_samples(64, seed=3, max_bytes=64), data, shard_samples=16)
    experiment = f"real-job-{uuid.uuid4().hex[:8]}"
    runs = []
    for last in (6, 10):  # the first attempt stops after step 6 (its last save: step 4)
        proc = subprocess.run([sys.executable, "-c", TRAINER, mlflow_server, experiment,
                               str(data), str(root), str(last)],
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        # The first line: MLflow's client prints its "View run ... at" links after it (close).
        runs.append(proc.stdout.splitlines()[0].split())
    (first, parent_id), (second, parent_again) = runs
    assert parent_id == parent_again and parent_id != "None"
    client = MlflowClient(mlflow_server)
    exp = experiment_id(client, experiment)
    assert {r.info.run_id for r in children(client, exp, parent_id)} == {first, second}
    records_ = read_job_dir(str(root))
    second_attempt = records_["attempts"][-1]["id"]
    report = account(records_, running=second_attempt)  # as the second logger's close did
    parent, child, _ = jobruns.job_metrics(report, second_attempt)
    assert client.get_run(parent_id).data.metrics == parent
    assert parent["job/attempts"] == 2.0 and 0 < parent["job/goodput"] <= 1
    got = client.get_run(second).data.metrics
    assert {k: v for k, v in got.items() if k.startswith("attempt/")} == child
    assert client.get_run(second).data.tags[jobruns.TAG_ATTEMPT_ID] == second_attempt
