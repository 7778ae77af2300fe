"""MLflowLogger against a real `mlflow server` and a local sqlite store: exact readback,
thinning, batching, rank keys; a dead, silent, hung or killed server that never blocks training,
bounded requests and a bounded close() that counts what was lost, a server that comes back and
gets everything, a forked child that leaves the logger alone, and a killed trainer that leaves
no process behind and whose run the next logger marks FAILED."""

from __future__ import annotations

import http.server
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import mlflow
import pytest
from mlflow import MlflowClient

from shardloader.dataset.sharded import Dataset
from shardloader.ingest.writer import write_shards
from shardloader.loader import Loader
from shardloader.telemetry import BatchRecord, MLflowLogger
from shardloader.telemetry.mlflow.logger import DEFAULT_FIELDS, LOGGABLE_FIELDS
from tests.fixtures.data import make_samples
from tests.fixtures.mlflow import _stop_group, start_mlflow_server
from tests.proctree import Proc, alive, descendants, wait_gone

T0 = 1_790_000_000.0


def make_records(n: int, start: int = 0) -> list[BatchRecord]:
    """Records with distinct, non-round values so readback must be exact to match."""
    return [
        BatchRecord(
            step=i, epoch=i // 1000, rank=0, samples=64 - (i % 3),
            fetch_seconds=0.001 * (i % 17) + 1e-7 * i + 1 / 3,
            time=T0 + 0.0123 * i, read_seconds=0.002 + 1e-6 * i,
            transform_seconds=0.01 + 1e-5 * (i % 11), shard_wait_seconds=(i % 5) * 0.1,
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


# Default fields against the server; every loggable field against the local store.
@pytest.mark.parametrize("store,fields", [("server", DEFAULT_FIELDS), ("local", LOGGABLE_FIELDS)])
def test_every_field_reads_back_exactly(store, fields, request):
    uri = request.getfixturevalue("mlflow_server" if store == "server" else "mlflow_local_store")
    records = make_records(1200 if store == "server" else 700)  # 7,200 / 7,700 metrics
    logger = MLflowLogger(tracking_uri=uri, experiment=f"readback-{store}", flush_interval=0.05,
                          fields=fields)
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


def test_process_true_still_logs_and_says_the_writer_process_is_gone(mlflow_local_store):
    with pytest.warns(DeprecationWarning, match="writer process was removed"):
        logger = MLflowLogger(tracking_uri=mlflow_local_store, experiment="process-true",
                              process=True, fields=("fetch_seconds",))
    records = make_records(3)
    for record in records:
        logger.on_batch(record)
    logger.close()
    assert history(MlflowClient(mlflow_local_store), logger.run_id,
                   "fetch_seconds") == expected(records, "fetch_seconds")


def test_every_n_steps_thins_and_log_metrics_is_not_thinned(mlflow_local_store):
    records = make_records(100)
    logger = MLflowLogger(tracking_uri=mlflow_local_store, every_n_steps=10,
                          fields=("fetch_seconds",))
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
                         fields=("fetch_seconds",))
    rank1 = MLflowLogger(run_id=run_id, tracking_uri=mlflow_local_store, rank=1)
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
        logger = MLflowLogger(fields=("fetch_seconds",))
        assert logger.run_id == run.info.run_id
        for record in make_records(5):
            logger.on_batch(record)
        logger.close()
        assert mlflow.active_run().info.run_id == run.info.run_id
    assert len(client.get_metric_history(run.info.run_id, "fetch_seconds")) == 5
    # No active run: start one (active on this thread), end it on close.
    logger = MLflowLogger(fields=("fetch_seconds",))
    assert mlflow.active_run().info.run_id == logger.run_id
    logger.on_batch(make_records(1)[0])
    logger.close()
    assert mlflow.active_run() is None
    assert client.get_run(logger.run_id).info.status == "FINISHED"
    assert len(client.get_metric_history(logger.run_id, "fetch_seconds")) == 1


def test_dead_server_never_blocks_on_batch_and_close_is_bounded(dead_tracking_uri):
    start = time.monotonic()
    logger = MLflowLogger(tracking_uri=dead_tracking_uri, experiment="x", max_queue=500,
                          flush_interval=0.01)
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
    # Every record is accounted for: refused at the queue, dropped from the buffer, or still
    # buffered; all of it reported as undelivered.
    c = logger.counters()
    fields = len(DEFAULT_FIELDS)
    assert (c["records_dropped"] * fields + c["metrics_dropped"] + c["metrics_pending"]
            == c["metrics_undelivered"] == 3000 * fields)


def test_full_queue_drops_and_counts_while_server_hangs(hanging_tracking_server, monkeypatch):
    # A server that accepts but never answers: the background thread is stuck talking to it.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    # A long probe timeout: the delivery side stays stuck on the silent server (probe or call).
    logger = MLflowLogger(run_id="0" * 32, tracking_uri=hanging_tracking_server.url,
                          max_queue=100, flush_interval=0.01, fields=("fetch_seconds",),
                          probe_timeout=60)
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


class AnswersOnlyHealth:
    """An HTTP server that answers `GET /health` (the probe passes) and never answers anything
    else: every MLflow request hangs. Counts the requests it got, by path."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.requests: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.rstrip("/") == "/health":
                    self.send_response(200)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"OK")
                    return
                self.hang()

            def do_POST(self) -> None:  # noqa: N802
                self.hang()

            def hang(self) -> None:
                outer.requests.append(self.path)
                outer.release.wait()  # until the test ends

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_server_that_answers_its_probe_then_hangs_holds_neither_training_nor_close(caplog):
    # The server answers /health and hangs every MLflow call: the thread is stuck in MLflow's
    # own request (its timeout: 120 s by default), while records still go in without waiting
    # and close() returns at its deadline with what was not delivered counted and said. The
    # process's environment (the user's) is left as it was.
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    environment = dict(os.environ)
    server = AnswersOnlyHealth()
    try:
        logger = MLflowLogger(run_id="0" * 32, tracking_uri=server.url, flush_interval=0.01,
                              fields=("fetch_seconds",))
        first, *rest = make_records(6)
        logger.on_batch(first)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and LOG_BATCH not in server.requests:
            time.sleep(0.05)  # polling a list the server's threads append to
        assert LOG_BATCH in server.requests, "the thread never sent its batch"
        start = time.monotonic()
        for record in rest:
            logger.on_batch(record)
        assert time.monotonic() - start < 0.5  # nothing waits on the stuck thread
        assert dict(os.environ) == environment
        start = time.monotonic()
        logger.close(timeout=3)
        assert time.monotonic() - start < 4
        assert logger._thread.daemon  # left behind, stuck, at the deadline: never joined
        assert logger.counters()["metrics_undelivered"] == 6
        assert [m for m in undelivered_warnings(caplog) if "6 of 6 metric(s)" in m]
    finally:
        server.close()


LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"


def test_a_server_that_comes_back_gets_every_metric(tmp_path, dead_tracking_uri):
    port = int(dead_tracking_uri.rsplit(":", 1)[1])
    logger = MLflowLogger(tracking_uri=dead_tracking_uri, experiment="comes-back",
                          flush_interval=0.05, fields=("fetch_seconds", "read_seconds"))
    records = make_records(300)
    for record in records[:200]:
        logger.on_batch(record)
    assert logger.flush(timeout=2) is False and logger.run_id is None
    process, url = start_mlflow_server(tmp_path, port=port)
    try:
        assert url == dead_tracking_uri
        for record in records[200:]:
            logger.on_batch(record)
        assert logger.flush(timeout=60)  # retries now, whatever the backoff
        logger.close()
        client = MlflowClient(url)
        for field in ("fetch_seconds", "read_seconds"):
            assert history(client, logger.run_id, field) == expected(records, field)
        assert logger.counters()["metrics_undelivered"] == 0
        assert logger.metrics_logged == 600 and logger.metrics_dropped == 0
        assert client.get_run(logger.run_id).info.status == "FINISHED"
    finally:
        _stop_group(process)


FORKED_CHILD_CLOSES = textwrap.dedent("""
    import json, os, sys, time
    from shardloader.telemetry import BatchRecord, MLflowLogger
    from shardloader.telemetry.mlflow.bounded import request_bounds

    logger = MLflowLogger(tracking_uri=sys.argv[1], experiment="forked", flush_interval=0.05,
                          fields=("fetch_seconds",))
    for step in range(10):
        logger.on_batch(BatchRecord(step=step, epoch=0, rank=0, samples=4, fetch_seconds=step,
                                    time=1.8e9 + step, read_seconds=0.0, transform_seconds=0.0,
                                    shard_wait_seconds=0.0, queue_depth=0))
    run_id = logger.wait_run_id(60)
    read, write = os.pipe()
    with request_bounds(7):  # as if the logger's thread were mid-request at the fork
        pid = os.fork()
    if pid == 0:  # the child: a loader worker would be here
        start = time.monotonic()
        logger.close()  # the run and the thread are the parent's: nothing to do
        seen = {"close_s": time.monotonic() - start,
                "timeout_env": os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT"),
                "threads": __import__("threading").active_count()}
        os.write(write, json.dumps(seen).encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child = json.loads(os.read(read, 4096))
    logger.close()
    print(json.dumps({"run_id": run_id, "child": child, "status": status,
                      "logged": logger.metrics_logged}))
""")


def test_a_forked_child_leaves_the_parents_logger_and_run_alone(mlflow_local_store):
    proc = subprocess.run([sys.executable, "-c", FORKED_CHILD_CLOSES, mlflow_local_store],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["status"] == 0
    assert out["child"]["close_s"] < 0.1
    assert out["child"]["timeout_env"] is None  # the bounds were not inherited
    assert out["child"]["threads"] == 1  # no copy of the logger's thread
    client = MlflowClient(mlflow_local_store)
    assert client.get_run(out["run_id"]).info.status == "FINISHED"  # ended by the parent only
    assert out["logged"] == 10
    assert len(client.get_metric_history(out["run_id"], "fetch_seconds")) == 10


# -- training speed, close() and lost metrics when the server is silent or dies ---------------
BATCHES = 150  # timed batches per pass (one more is delivered before the clock starts)
STEP_SECONDS = 0.002  # stands in for the training step
SPEED_RATIO = 1.5  # generous: the 2-core test machine is shared; blocking would cost far more
LOGGER_NAME = "shardloader.telemetry.mlflow.logger"


@pytest.fixture
def small_dataset(tmp_path):
    path = tmp_path / "ds"
    write_shards(make_samples((BATCHES + 10) * 4, seed=5, max_bytes=64), path, shard_samples=128)
    return path


def loop_seconds(path, telemetry) -> float:
    """Seconds a training loop takes for BATCHES batches (after the first) with `telemetry`."""
    loader = Loader(Dataset(path), 4, num_workers=0, seed=1, telemetry=telemetry)
    try:
        batches = iter(loader)
        next(batches)
        start = time.perf_counter()
        for _ in range(BATCHES):
            next(batches)
            time.sleep(STEP_SECONDS)
        return time.perf_counter() - start
    finally:
        loader.close()


def speed_ratio(path, logger, passes: int = 3) -> float:
    """Best pass with the logger / best pass without it, passes interleaved (the best pass is
    the least disturbed by other load on the machine)."""
    off, on = [], []
    for _ in range(passes):
        off.append(loop_seconds(path, None))
        on.append(loop_seconds(path, logger))
    return min(on) / min(off)


def undelivered_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER_NAME and "not delivered" in r.getMessage()]


def test_silent_server_costs_training_nothing_and_close_counts_the_loss(
        small_dataset, hanging_tracking_server, caplog, monkeypatch):
    # Short MLflow timeouts only so that a blocking constructor fails this test in seconds.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    start = time.perf_counter()
    logger = MLflowLogger(tracking_uri=hanging_tracking_server.url, experiment="silent",
                          flush_interval=0.05)
    constructed = time.perf_counter() - start
    assert constructed < 1.0, f"constructor took {constructed:.2f} s"
    assert hanging_tracking_server.request_received.wait(60)  # the delivery side is trying
    ratio = speed_ratio(small_dataset, logger)
    assert ratio < SPEED_RATIO, f"training {ratio:.2f}x slower with telemetry on"
    start = time.perf_counter()
    logger.close(timeout=3.0)
    closed = time.perf_counter() - start
    assert closed < 4.0, f"close took {closed:.2f} s"
    assert logger.run_id is None and logger.metrics_logged == 0
    total = 3 * (BATCHES + 1) * len(DEFAULT_FIELDS)
    assert logger.counters()["metrics_undelivered"] == total
    messages = undelivered_warnings(caplog)
    assert len(messages) == 1 and f"{total} of {total} metric(s)" in messages[0], messages
    assert hanging_tracking_server.url in messages[0]
    print(f"\nsilent server: constructor {constructed * 1000:.1f} ms, "
          f"close {closed:.2f} s (timeout 3 s), speed ratio on/off {ratio:.3f}")


def test_server_killed_mid_run(small_dataset, killable_mlflow_server, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER_NAME)
    server = killable_mlflow_server
    logger = MLflowLogger(tracking_uri=server.url, experiment="killed", flush_interval=0.05)
    run_id = logger.wait_run_id(60)
    assert run_id is not None
    loop_seconds(small_dataset, logger)
    assert logger.flush(60)
    per_pass = (BATCHES + 1) * len(DEFAULT_FIELDS)
    assert logger.metrics_logged == per_pass  # delivered while the server lived
    server.kill()
    ratio = speed_ratio(small_dataset, logger)
    assert ratio < SPEED_RATIO, f"training {ratio:.2f}x slower with telemetry on"
    start = time.perf_counter()
    logger.close(timeout=5.0)
    closed = time.perf_counter() - start
    assert closed < 6.0, f"close took {closed:.2f} s"
    lost = 3 * per_pass  # everything after the kill
    assert logger.metrics_logged == per_pass
    assert logger.counters()["metrics_undelivered"] == lost
    messages = undelivered_warnings(caplog)
    assert len(messages) == 1 and f"{lost} of {lost + per_pass} metric(s)" in messages[0], messages
    print(f"\nserver killed mid-run: close {closed:.2f} s (timeout 5 s), "
          f"speed ratio on/off {ratio:.3f}")


# -- a SIGKILLed trainer ----------------------------------------------------------------------
TRAINER = textwrap.dedent("""
    import json, multiprocessing, os, sys, time
    from shardloader.telemetry import BatchRecord, MLflowLogger

    def forked_worker(parent, started):  # stands in for a loader worker
        started.set()
        while os.getppid() == parent:
            time.sleep(0.05)

    logger = MLflowLogger(tracking_uri=sys.argv[1], experiment=sys.argv[2], flush_interval=0.05)
    for step in range(10):
        logger.on_batch(BatchRecord(step=step, epoch=0, rank=0, samples=4, fetch_seconds=0.1,
                                    time=1.8e9 + step, read_seconds=0.0, transform_seconds=0.0,
                                    shard_wait_seconds=0.0, queue_depth=0))
    assert logger.flush(60)
    context = multiprocessing.get_context("fork")
    started = context.Event()
    worker = context.Process(target=forked_worker, args=(os.getpid(), started))
    worker.start()
    assert started.wait(60), "the forked worker did not start"
    print(json.dumps({"run_id": logger.wait_run_id(0), "worker": worker.pid}), flush=True)
    sys.stdin.read()  # until killed
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="walks /proc")
def test_sigkilled_trainer_leaves_no_process_and_its_run_is_marked_failed(mlflow_server):
    experiment = f"killed-trainer-{uuid.uuid4().hex[:8]}"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, mlflow_server, experiment],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    tree: list[Proc] = []
    try:
        poller = select.poll()  # select refuses descriptors past 1024, which a long suite reaches
        poller.register(trainer.stdout, select.POLLIN)
        assert poller.poll(120_000), "the trainer did not start"
        info = json.loads(trainer.stdout.readline())
        tree = descendants(trainer.pid)
        # The logger starts no process: the trainer's only child is its forked worker.
        assert [p.pid for p in tree] == [info["worker"]], [p.describe() for p in tree]
        client = MlflowClient(mlflow_server)
        assert client.get_run(info["run_id"]).info.status == "RUNNING"
        trainer.kill()  # SIGKILL: no cleanup runs in the trainer
        trainer.wait(30)
        left = wait_gone(tree, 10)  # (pid, start time): a recycled pid is not a survivor
        assert not left, f"processes outlived the trainer: {[p.describe() for p in left]}"
    finally:
        trainer.kill()
        trainer.wait(30)
        for p in tree:  # what the trainer started, should the test have failed
            if alive(p):
                os.kill(p.pid, signal.SIGKILL)
    # The next logger in the experiment finds the dead trainer's run and marks it FAILED.
    assert client.get_run(info["run_id"]).info.status == "RUNNING"
    logger = MLflowLogger(tracking_uri=mlflow_server, experiment=experiment)
    new_run = logger.wait_run_id(60)
    assert new_run is not None and new_run != info["run_id"]
    logger.close()
    old = client.get_run(info["run_id"])
    assert old.info.status == "FAILED"
    assert "ended without closing" in old.data.tags["shardloader.ended"]
    assert client.get_run(new_run).info.status == "FINISHED"


EXITS_WITHOUT_CLOSE = textwrap.dedent("""
    import sys
    from shardloader.telemetry import BatchRecord, MLflowLogger

    logger = MLflowLogger(tracking_uri=sys.argv[1], experiment="no-close", flush_interval=60)
    for step in range(25):
        logger.on_batch(BatchRecord(step=step, epoch=0, rank=0, samples=4, fetch_seconds=step,
                                    time=1.8e9 + step, read_seconds=0.0, transform_seconds=0.0,
                                    shard_wait_seconds=0.0, queue_depth=0))
    print(logger.wait_run_id(60), flush=True)
    # no close(): the interpreter exits with the records still queued (flush_interval 60 s)
""")


def test_script_that_never_closes_delivers_and_finishes_its_run_at_exit(mlflow_local_store):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", EXITS_WITHOUT_CLOSE, mlflow_local_store],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = proc.stdout.strip().splitlines()[-1]
    client = MlflowClient(mlflow_local_store)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, "fetch_seconds"),
                                              key=lambda m: m.step)] == [
        (step, float(step)) for step in range(25)]
    assert time.monotonic() - start < 60
