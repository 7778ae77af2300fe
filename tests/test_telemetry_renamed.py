"""Renamed telemetry fields (`records.RENAMED_FIELDS`): a JSONL file or an MLflow run written
under a field's old name is read under its new one; only the new name is written."""

from __future__ import annotations

import json

from shardloader.telemetry import BatchRecord, JsonlLogger, read_jsonl
from shardloader.telemetry.history import records_from_mlflow
from shardloader.telemetry.records import RENAMED_FIELDS

OLD_LINE = {"kind": "batch", "step": 1, "epoch": 0, "rank": 0, "samples": 8,
            "fetch_seconds": 0.5, "time": 100.0, "read_seconds": 0.01,
            "transform_seconds": 0.02, "download_wait_seconds": 0.25, "queue_depth": 0}


def test_the_shard_wait_was_called_download_wait_before():
    assert RENAMED_FIELDS == {"download_wait_seconds": "shard_wait_seconds"}


def test_a_jsonl_line_of_an_older_version_is_read_under_the_new_name(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(OLD_LINE) + "\n")
    records, _ = read_jsonl(path)
    assert records[0].shard_wait_seconds == 0.25
    # the new name wins where both are there; only the new one is written
    both = BatchRecord.from_dict({**OLD_LINE, "shard_wait_seconds": 0.75})
    assert both.shard_wait_seconds == 0.75
    logger = JsonlLogger(tmp_path / "new.jsonl")
    logger.on_batch(records[0])
    logger.close()
    line = json.loads((tmp_path / "new.jsonl").read_text().splitlines()[0])
    assert line["shard_wait_seconds"] == 0.25 and "download_wait_seconds" not in line


def test_an_mlflow_run_of_an_older_version_is_read_under_the_new_name(mlflow_local_store):
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(mlflow_local_store)
    experiment = client.create_experiment("renamed-fields")
    run = client.create_run(experiment).info.run_id
    metrics = [Metric(name, value, 100_000 + step, step)
               for step in (1, 2)
               for name, value in (("fetch_seconds", 0.5 * step), ("download_wait_seconds", 0.25 * step))]
    client.log_batch(run, metrics=metrics)
    client.set_terminated(run)
    records, fields, _ = records_from_mlflow(run, mlflow_local_store)
    assert [r.shard_wait_seconds for r in records] == [0.25, 0.5]
    assert [r.fetch_seconds for r in records] == [0.5, 1.0]
    assert "shard_wait_seconds" in fields and "download_wait_seconds" not in fields
