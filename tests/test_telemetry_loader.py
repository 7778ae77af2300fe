"""The real Loader with telemetry: slow storage (a bandwidth-limited HTTP proxy in front of the
dataset) and a slow transform (burns CPU); the report names the right cause in each, and the
loader's stats() agree with what the sinks received."""

from __future__ import annotations

import hashlib
import time

import pytest
from mlflow import MlflowClient

from shardloader.cli import main as cli_main
from shardloader.dataset.sharded import Dataset
from shardloader.ingest.writer import write_shards
from shardloader.loader import Loader
from shardloader.telemetry import JsonlLogger, MLflowLogger, MultiSink, read_jsonl
from shardloader.telemetry.analysis import analyse
from shardloader.telemetry.history import records_from_jsonl
from tests.fixtures.data import make_samples

STEP_SECONDS = 0.002  # stands in for the training step's compute


def burn_cpu(sample):
    """A deliberately slow transform: ~1 ms of hashing per sample."""
    digest = sample["data"]
    for _ in range(3000):
        digest = hashlib.blake2b(digest).digest()
    return sample


def train(loader):
    for _ in loader:
        time.sleep(STEP_SECONDS)


def test_slow_storage_is_reported_as_storage(tmp_path, http_server, fault_proxy,
                                              mlflow_local_store, capsys):
    write_shards(make_samples(64, seed=3, min_bytes=900, max_bytes=1100), tmp_path / "ds",
                 shard_samples=4)
    proxy = fault_proxy(http_server(tmp_path / "ds").url, bandwidth=40_000)  # ~0.1 s per shard
    dataset = Dataset(proxy.url, cache_dir=tmp_path / "cache")
    # Artifacts go under tmp_path, not MLflow's default ./mlruns in the working directory.
    MlflowClient(mlflow_local_store).create_experiment(
        "slow-storage", artifact_location=(tmp_path / "artifacts").as_uri())
    logger = MLflowLogger(tracking_uri=mlflow_local_store, experiment="slow-storage",
                          jsonl_path=tmp_path / "t.jsonl")
    loader = Loader(dataset, 4, num_workers=0, seed=1, telemetry=logger)
    train(loader)
    logger.close()
    stats = loader.stats()
    records, _ = read_jsonl(tmp_path / "t.jsonl")
    assert [r.step for r in records] == list(range(1, 17))
    assert stats["batches"] == 16
    assert stats["fetch_seconds_total"] == pytest.approx(sum(r.fetch_seconds for r in records))
    assert stats["cache_misses"] == sum(r.cache_misses for r in records) > 0
    assert stats["stall_fraction"] > 0.5

    report = analyse(records)
    assert report["cause"] == "storage", report
    assert "prefetch window" in report["recommendations"][0]
    # The same run, read back from MLflow by the CLI, gets the same diagnosis.
    assert cli_main.main(["report", logger.run_id, "--tracking-uri", mlflow_local_store]) == 0
    out = capsys.readouterr().out
    assert "dominant cause     storage" in out
    artifacts = MlflowClient(mlflow_local_store).list_artifacts(logger.run_id, "shardloader-report")
    assert "shardloader-report/report.png" in [a.path for a in artifacts]


def test_slow_transform_is_reported_as_decode(tmp_path, capsys):
    write_shards(make_samples(64, seed=3), tmp_path / "ds", shard_samples=16)
    sink = JsonlLogger(tmp_path / "t.jsonl")
    stats_seen = []

    class Recorder:  # a second real sink: what the Loader hands over, per batch
        def on_batch(self, record):
            stats_seen.append(record)

        def log_metrics(self, metrics, step):
            pass

        def flush(self):
            pass

        def close(self):
            pass

    loader = Loader(Dataset(tmp_path / "ds"), 8, num_workers=0, seed=1, transform=burn_cpu,
                    telemetry=MultiSink([sink, Recorder()]))
    train(loader)
    sink.close()
    records, _ = records_from_jsonl(tmp_path / "t.jsonl")
    assert records == stats_seen
    report = analyse(records)
    assert report["cause"] == "decode", report
    assert "Raise num_workers to at least" in report["recommendations"][0]
    assert cli_main.main(["report", str(tmp_path / "t.jsonl")]) == 0
    assert "dominant cause     decode" in capsys.readouterr().out
    assert (tmp_path / "t.jsonl.report.png").read_bytes()[:4] == b"\x89PNG"
