"""Loader throughput with telemetry on vs off: what logging fetch_seconds costs training.

The Loader always keeps its StatsAggregator (that is `loader.stats()`); "off" is
`telemetry=None`, "mlflow" is an `MLflowLogger` (default settings: MLflow's client in one
background thread of the training process) writing every step's metrics into a local MLflow
store (sqlite in a temp dir: MLflow's default kind of store, no server), "mlflow-silent" the
same logger against a tracking
server that accepts connections and never answers (a listening socket nobody reads; the
logger's constructor time is reported, and it is closed with `close(timeout=3)`), "jsonl"
a `JsonlLogger`, and "job" no sink but a `Checkpointer` open on a local root: the job's
account (`shardloader.telemetry.job`) records every next() of the loader. Each repeat iterates one epoch of a small Arrow dataset as fast as the loader
delivers (no training step: the worst case, where telemetry's share is largest), modes
interleaved so that machine drift hits all of them alike. Reported: median samples/s over the
repeats, the ratio to "off" (goal >= 0.99) of the medians and of the best runs (the best run
is the least disturbed by other load on a shared machine), the training process's CPU time per
batch (all its threads: what telemetry takes from training even when throughput hides it),
records dropped, and how long close() took to deliver what was still queued at the end.

Run: .venv/bin/python -m benchmarks.telemetry_overhead [--repeats 7] [--samples 32768]
     [--modes mlflow mlflow-silent] [--server]

`--server`: "mlflow" writes to a real `mlflow server` on 127.0.0.1 (sqlite backend, started as
the tests start it) instead of a local store: what a job logging to a tracking server pays
(issue 37, which retired the writer process this once compared against), e.g.

    .venv/bin/python -m benchmarks.telemetry_overhead --server --modes mlflow \
        --workers 2 --step-ms 5 50 --batch 64 --samples 8192 --repeats 5
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks._common import load_average, machine, table
from shardloader.checkpoint import Checkpointer
from shardloader.dataset.sharded import Dataset
from shardloader.ingest.writer import write_shards
from shardloader.loader import Loader
from shardloader.telemetry import JsonlLogger, MLflowLogger

MODES = ("off", "mlflow", "mlflow-silent", "jsonl", "job")
SILENT_CLOSE_TIMEOUT = 3.0


def silent_server() -> tuple[socket.socket, str]:
    """A tracking URI whose TCP connections complete (the kernel's backlog) and never answer."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def make_dataset(root: str, samples: int) -> str:
    rng = np.random.default_rng(0)
    path = os.path.join(root, "ds")
    write_shards(
        ({"data": rng.bytes(128), "label": int(i % 10)} for i in range(samples)),
        path, shard_samples=samples // 8,
    )
    return path


def one_epoch(path: str, mode: str, tracking_uri: str, tmp: str, workers: int,
              batch: int, step_seconds: float,
              silent_uri: str = "") -> tuple[float, int, float, float, float]:
    """(seconds for the epoch, records dropped, seconds close() took, training-process CPU
    seconds during the epoch: all its threads, the telemetry thread included, seconds the
    sink's constructor took)."""
    sink = None
    construct = time.perf_counter()
    if mode == "mlflow-silent":
        sink = MLflowLogger(tracking_uri=silent_uri, experiment="overhead")
    elif mode == "mlflow":
        sink = MLflowLogger(tracking_uri=tracking_uri, experiment="overhead")
    elif mode == "jsonl":
        sink = JsonlLogger(os.path.join(tmp, f"t-{time.monotonic_ns()}.jsonl"))
    construct = time.perf_counter() - construct if sink is not None else 0.0
    ckpt = Checkpointer(os.path.join(tmp, f"job-{time.monotonic_ns()}")) if mode == "job" else None
    loader = Loader(Dataset(path), batch, num_workers=workers, seed=1, telemetry=sink,
                    worker_type="process", shuffle=True, persistent_workers=workers > 0)
    iterator = iter(loader)
    next(iterator)  # workers started, first shard open: not what we measure
    if sink is not None:
        # The run exists (a one-off cost per run, not per batch); against the silent server
        # this returns False once the thread's first probe timed out.
        sink.flush(60 if mode != "mlflow-silent" else 10)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in iterator:
        if step_seconds:
            time.sleep(step_seconds)  # an accelerator-bound step: the host waits, GIL released
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu
    dropped, close_seconds = 0, 0.0
    if sink is not None:
        t = time.perf_counter()
        sink.close(SILENT_CLOSE_TIMEOUT if mode == "mlflow-silent" else None)
        close_seconds = time.perf_counter() - t
        dropped = sink.dropped
    loader.close()
    if ckpt is not None:
        ckpt.close()
    return seconds, dropped, close_seconds, cpu, construct


def sink_costs(tmp: str, tracking_uri: str, n: int = 20_000) -> list[list[object]]:
    """Per-record costs: `on_batch` on the training thread, then the background's CPU."""
    from shardloader.telemetry import BatchRecord

    records = [BatchRecord(step=i, epoch=0, rank=0, samples=32, fetch_seconds=1e-4 * (i % 7),
                           time=1.8e9 + i / 100, read_seconds=1e-3, transform_seconds=2e-3,
                           shard_wait_seconds=0.0, queue_depth=2) for i in range(n)]
    rows = []
    for name in ("jsonl", "mlflow"):
        if name == "jsonl":
            sink: Any = JsonlLogger(os.path.join(tmp, "costs.jsonl"), max_queue=n)
        else:
            sink = MLflowLogger(tracking_uri=tracking_uri, experiment="costs", max_queue=n)
        cpu = time.process_time()
        start = time.perf_counter()
        for record in records:
            sink.on_batch(record)
        put = time.perf_counter() - start
        sink.flush(600)
        sink.close(600)
        cpu = time.process_time() - cpu
        rows.append([name, f"{put / n * 1e6:.2f}", f"{(cpu - put) / n * 1e6:.1f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--samples", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="telemetry modes to compare (off is always included)")
    parser.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 5.0],
                        help="simulated training step per batch (0: loader-bound worst case)")
    parser.add_argument("--server", action="store_true",
                        help="log to a real `mlflow server` on 127.0.0.1, not a local store")
    args = parser.parse_args()
    modes = ["off"] + [m for m in args.modes if m != "off"]
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "1")  # a line per run
    print(f"telemetry overhead: {machine()}; {load_average()}")
    listener, silent_uri = silent_server()
    with listener, tempfile.TemporaryDirectory() as tmp:
        path = make_dataset(tmp, args.samples)
        tracking_uri = f"sqlite:///{os.path.join(tmp, 'mlflow.db')}"
        server = None
        if args.server:
            from pathlib import Path

            from tests.fixtures.mlflow import start_mlflow_server

            server, tracking_uri = start_mlflow_server(Path(tmp))
            print(f"tracking server {tracking_uri}")
        from mlflow import MlflowClient

        MlflowClient(tracking_uri).search_experiments()  # create the store's schema up front
        print(table(["sink", "on_batch us/record", "background CPU us/record"],
                    sink_costs(tmp, tracking_uri)))
        rows = []
        batches = args.samples // args.batch - 1
        for workers in args.workers:
            for step_ms in args.step_ms:
                step = step_ms / 1000
                results: dict[str, list[tuple[float, int, float, float, float]]] = {
                    m: [] for m in modes}
                one_epoch(path, "mlflow", tracking_uri, tmp, workers, args.batch, step)  # warm-up
                for _ in range(args.repeats):
                    for mode in modes:
                        results[mode].append(one_epoch(path, mode, tracking_uri, tmp, workers,
                                                       args.batch, step, silent_uri))
                off = statistics.median(r[0] for r in results["off"])
                off_best = min(r[0] for r in results["off"])
                for mode in modes:
                    seconds = statistics.median(r[0] for r in results[mode])
                    best = min(r[0] for r in results[mode])
                    cpu_us = statistics.median(r[3] for r in results[mode]) / batches * 1e6
                    rows.append([
                        workers, step_ms, mode, batches / seconds, f"{off / seconds:.3f}",
                        f"{off_best / best:.3f}", f"{cpu_us:.0f}",
                        sum(r[1] for r in results[mode]),
                        statistics.median(r[2] for r in results[mode]),
                        f"{statistics.median(r[4] for r in results[mode]) * 1000:.1f}",
                    ])
        print(f"{args.samples} samples of 128 B, batch {args.batch}, {args.repeats} repeats "
              "(medians)")
        print(table(["workers", "step ms", "telemetry", "batches/s (median)",
                     "ratio to off (medians)", "ratio to off (best runs)",
                     "train-proc CPU us/batch", "dropped", "close s", "constructor ms"],
                    rows))
        print(f"load after: {load_average()}")
        if server is not None:
            from tests.fixtures.mlflow import _stop_group

            _stop_group(server)


if __name__ == "__main__":
    main()
