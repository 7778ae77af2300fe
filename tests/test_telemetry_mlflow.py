"""MLflowLogger against a real `mlflow server` and a local sqlite store: exact readback,
thinning, batching, rank keys, and a dead or hanging server that never blocks training."""

from __future__ import annotations

import math
import time

import mlflow
import pytest
from mlflow import MlflowClient

from shardloader.telemetry import BatchRecord, MLflowLogger
from shardloader.telemetry.mlflow_logger import DEFAULT_FIELDS, LOGGABLE_FIELDS

T0 = 1_790_000_000.0


def make_records(n: int, start: int = 0) -> list[BatchRecord]:
    """Records with distinct, non-round values so readback must be exact to match."""
    return [
        BatchRecord(
            step=i, epoch=i // 1000, rank=0, samples=64 - (i % 3),
            fetch_seconds=0.001 * (i % 17) + 1e-7 * i + 1 / 3,
            time=T0 + 0.0123 * i, read_seconds=0.002 + 1e-6 * i,
            transform_seconds=0.01 + 1e-5 * (i % 11), download_wait_seconds=(i % 5) * 0.1,
            queue_depth=i % 4, cache_hits=i % 2, cache_misses=1 - i % 2,
            bytes_downloaded=(1 - i % 2) * 1_000_003, padded=0,
        )
        for i in range(start, start + n)
    ]


def history(client: MlflowClient, run_id: str, key: str) -> dict[int, tuple[float, int]]:
    out: dict[int, tuple[float, int]] = {}
    for metric in client.get_metric_history(run_id, key):
        assert metric.step not in out, f"step {metric.step} of {key} logged twice"
        out[metric.step] = (metric.value, metric.timestamp)
    return out


def expected(records: list[BatchRecord], field: str) -> dict[int, tuple[float, int]]:
    return {r.step: (float(getattr(r, field)), int(r.time * 1000)) for r in records}


# The writer process and default fields against the server; in-thread delivery and every
# loggable field against the local store.
@pytest.mark.parametrize("store,process,fields", [("server", True, DEFAULT_FIELDS),
                                                  ("local", False, LOGGABLE_FIELDS)])
def test_every_field_reads_back_exactly(store, process, fields, request):
    uri = request.getfixturevalue("mlflow_server" if store == "server" else "mlflow_local_store")
    records = make_records(1200 if store == "server" else 700)  # 7,200 / 7,700 metrics
    logger = MLflowLogger(tracking_uri=uri, experiment=f"readback-{store}", flush_interval=0.05,
                          process=process, fields=fields)
    for record in records:
        logger.on_batch(record)
    assert logger.flush(timeout=60)
    logger.close()
    client = MlflowClient(uri)
    for field in fields:
        assert history(client, logger.run_id, field) == expected(records, field), field
    assert client.get_run(logger.run_id).data.metrics.keys() == set(fields)
    total = len(records) * len(fields)
    assert logger.metrics_logged == total
    assert logger.dropped == logger.metrics_dropped == 0
    # Batched: a full log_batch carries 1,000 metrics, so few calls suffice.
    assert logger.batch_calls <= math.ceil(total / 1000) + 20
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"  # the logger created the run and ends it on close
    assert client.get_experiment(run.info.experiment_id).name == f"readback-{store}"


def test_every_n_steps_thins_and_log_metrics_is_not_thinned(mlflow_local_store):
    records = make_records(100)
    logger = MLflowLogger(tracking_uri=mlflow_local_store, every_n_steps=10,
                          fields=("fetch_seconds",), process=False)
    for record in records:
        logger.on_batch(record)
        if record.step % 25 == 0:
            logger.log_metrics({"checkpoint/stage_seconds": record.step / 7}, step=record.step)
    logger.close()
    client = MlflowClient(mlflow_local_store)
    kept = [r for r in records if r.step % 10 == 0]
    assert history(client, logger.run_id, "fetch_seconds") == expected(kept, "fetch_seconds")
    assert client.get_metric_history(logger.run_id, "read_seconds") == []  # not in fields
    stage = {m.step: m.value for m in
             client.get_metric_history(logger.run_id, "checkpoint/stage_seconds")}
    assert stage == {0: 0.0, 25: 25 / 7, 50: 50 / 7, 75: 75 / 7}


def test_all_ranks_suffixes_keys_and_other_ranks_are_silent(mlflow_local_store):
    client = MlflowClient(mlflow_local_store)
    run_id = client.create_run(client.create_experiment("ranks")).info.run_id
    records = make_records(20)
    rank3 = MLflowLogger(run_id=run_id, tracking_uri=mlflow_local_store, all_ranks=True, rank=3,
                         fields=("fetch_seconds",), process=False)
    rank1 = MLflowLogger(run_id=run_id, tracking_uri=mlflow_local_store, rank=1, process=False)
    assert not rank1.active and rank3.active
    for record in records:
        rank3.on_batch(record)
        rank1.on_batch(record)
    rank3.close()
    rank1.close()
    assert history(client, run_id, "fetch_seconds/rank3") == expected(records, "fetch_seconds")
    assert client.get_run(run_id).data.metrics.keys() == {"fetch_seconds/rank3"}
    assert client.get_run(run_id).info.status == "RUNNING"  # a given run is not ended


def test_no_arguments_uses_active_run_or_starts_one(mlflow_local_store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_local_store)
    client = MlflowClient(mlflow_local_store)
    # Inside a run the user started: log into it and leave it running.
    with mlflow.start_run() as run:
        logger = MLflowLogger(fields=("fetch_seconds",), process=False)
        assert logger.run_id == run.info.run_id
        for record in make_records(5):
            logger.on_batch(record)
        logger.close()
        assert mlflow.active_run().info.run_id == run.info.run_id
    assert len(client.get_metric_history(run.info.run_id, "fetch_seconds")) == 5
    # No active run: start one (active on this thread), end it on close.
    logger = MLflowLogger(fields=("fetch_seconds",), process=False)
    assert mlflow.active_run().info.run_id == logger.run_id
    logger.on_batch(make_records(1)[0])
    logger.close()
    assert mlflow.active_run() is None
    assert client.get_run(logger.run_id).info.status == "FINISHED"
    assert len(client.get_metric_history(logger.run_id, "fetch_seconds")) == 1


@pytest.mark.parametrize("process", [False, True])
def test_dead_server_never_blocks_on_batch_and_close_is_bounded(dead_tracking_uri, process):
    start = time.monotonic()
    logger = MLflowLogger(tracking_uri=dead_tracking_uri, experiment="x", max_queue=500,
                          flush_interval=0.01, process=process)
    assert time.monotonic() - start < 5  # constructor: one refused TCP connect, no retries
    assert logger.run_id is None
    worst = 0.0
    for record in make_records(3000):
        t = time.perf_counter()
        logger.on_batch(record)
        worst = max(worst, time.perf_counter() - t)
    assert worst < 0.05, f"on_batch took {worst * 1000:.1f} ms"
    assert logger.flush(timeout=2) is False  # nothing can be delivered
    start = time.monotonic()
    logger.close(timeout=5)
    assert time.monotonic() - start < 6
    assert logger.metrics_logged == 0 and logger.run_id is None
    if process:
        assert logger._transport.process.poll() is not None  # the writer process is gone
    else:
        # Every record is accounted for: refused at the queue, dropped from the buffer, or
        # still buffered.
        c = logger.counters()
        fields = len(DEFAULT_FIELDS)
        assert (c["records_dropped"] * fields + c["metrics_dropped"] + c["metrics_pending"]
                == 3000 * fields)


def test_full_queue_drops_and_counts_while_server_hangs(hanging_tracking_server, monkeypatch):
    # A server that accepts but never answers: the background thread is stuck in log_batch.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    logger = MLflowLogger(run_id="0" * 32, tracking_uri=hanging_tracking_server.url,
                          max_queue=100, flush_interval=0.01, fields=("fetch_seconds",),
                          process=False)
    records = make_records(251)
    logger.on_batch(records[0])
    assert hanging_tracking_server.request_received.wait(timeout=30)
    worst = 0.0
    for record in records[1:]:
        t = time.perf_counter()
        logger.on_batch(record)
        worst = max(worst, time.perf_counter() - t)
    assert logger.pending == 100
    assert logger.dropped == 150
    assert worst < 0.05
    start = time.monotonic()
    logger.close(timeout=1.0)
    assert time.monotonic() - start < 3.0
    assert logger.metrics_logged == 0


def test_hanging_server_with_writer_process_is_killed_on_close(hanging_tracking_server,
                                                               monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    logger = MLflowLogger(run_id="0" * 32, tracking_uri=hanging_tracking_server.url,
                          max_queue=100, flush_interval=0.01, fields=("fetch_seconds",))
    records = make_records(20_000)
    logger.on_batch(records[0])
    assert hanging_tracking_server.request_received.wait(timeout=60)  # the writer is stuck
    worst = 0.0
    for record in records[1:]:
        t = time.perf_counter()
        logger.on_batch(record)
        worst = max(worst, time.perf_counter() - t)
    assert worst < 0.05
    assert logger.dropped > 0  # the socket to the writer filled up, then the queue
    start = time.monotonic()
    logger.close(timeout=1.0)
    assert time.monotonic() - start < 3.0
    assert logger._transport.process.poll() is not None
    assert logger.metrics_logged == 0
