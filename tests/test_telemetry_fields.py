"""Every field of `BatchRecord` reaches every place a batch's figures go: the worker's
`BatchTimings`, the record the Loader builds, the no-sink path into `loader.stats()`, the
summary and its combination over ranks, JSONL and MLflow, and back. The checks run over the
dataclass's fields themselves, so a field added to `BatchRecord` that some place drops (a
hand-written list, a positional call) fails here, naming the field and the place."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardloader.dataset.sharded import Dataset
from shardloader.loader.batches import BatchProducer, BatchTask, BatchTimings
from shardloader.loader.protocol import NO_SHARD_SOURCE
from shardloader.loader.recording import BatchRecorder
from shardloader.telemetry import (
    BatchRecord,
    JsonlLogger,
    MLflowLogger,
    StatsAggregator,
    combine_summaries,
    read_jsonl,
)
from shardloader.telemetry.history import records_from_mlflow
from shardloader.telemetry.records import (
    FIELD_KINDS,
    LOGGABLE_FIELDS,
    METRIC_FIELDS,
    SUMMARY_KEYS,
    WORKER_FIELDS,
)

FIELDS = tuple(f.name for f in dataclasses.fields(BatchRecord))


class _Capture:
    """A sink that keeps the records it gets."""

    def __init__(self) -> None:
        self.records: list[BatchRecord] = []

    def on_batch(self, record: BatchRecord) -> None:
        self.records.append(record)

    def log_metrics(self, metrics, step) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


class _ValuesSeen(StatsAggregator):
    """The Loader's summary, keeping the field values its no-sink path hands it."""

    seen: list[dict]

    def add_values(self, values) -> None:
        self.seen = [*getattr(self, "seen", []), dict(values)]
        super().add_values(values)


def _distinct_timings() -> BatchTimings:
    """A worker's figures with a different, exactly representable value for each field."""
    timings = BatchTimings()
    for i, name in enumerate(WORKER_FIELDS):
        timings.figures[name] = FIELD_KINDS[name](i + 1) * (0.125 if FIELD_KINDS[name] is float else 7)
    return timings


def _recorded(telemetry) -> tuple[dict, StatsAggregator]:
    """One batch through `BatchRecorder.record`: the field values it made, and the summary."""
    stats = _ValuesSeen()
    recorder = BatchRecorder(stats, telemetry, NO_SHARD_SOURCE, rank=3, epoch=2)
    recorder.record(_distinct_timings(), step=2 * 10 + 4 + 1, samples=32, padded=2,
                    fetch_seconds=0.375, queue_depth=5)
    if telemetry is None:
        return stats.seen[0], stats
    return telemetry.records[0].to_dict(), stats


def test_the_worker_measures_every_worker_field(arrow_dataset):
    producer = BatchProducer(Dataset(arrow_dataset), seed=1)
    _, timings = producer(BatchTask(0, 0, 0, np.arange(0, 130, 7)))  # across three shards
    assert set(timings.figures) == set(WORKER_FIELDS)
    assert timings.figures["read_seconds"] > 0 and timings.figures["transform_seconds"] > 0
    assert set(BatchTimings().figures) == set(WORKER_FIELDS)  # also a failed batch's


def test_every_field_reaches_the_record_and_the_no_sink_path():
    without_sink, fast_stats = _recorded(None)
    with_sink, stats = _recorded(_Capture())
    missing = [name for name in FIELDS if name not in without_sink]
    assert not missing, f"the Loader's no-sink path (loader/recording.py) drops {missing}"
    assert set(without_sink) == set(FIELDS)
    expected = {**_distinct_timings().figures, "step": 2 * 10 + 4 + 1, "epoch": 2, "rank": 3,
                "samples": 32, "padded": 2, "fetch_seconds": 0.375, "queue_depth": 5}
    for values in (without_sink, with_sink):
        assert {k: v for k, v in values.items() if k != "time"} == expected
    assert without_sink["time"] > 0 and with_sink["time"] > 0
    fast, slow = fast_stats.summary(), stats.summary()
    for name in METRIC_FIELDS:  # one batch: a sum and a mean are the value
        key = SUMMARY_KEYS[name]
        assert fast[key] == slow[key] == expected[name], f"loader.stats() lost {name} ({key})"


def test_every_summary_key_is_combined_over_ranks():
    _, stats = _recorded(_Capture())
    one = stats.summary()
    combined = combine_summaries([one, one])["combined"]
    for name, key in SUMMARY_KEYS.items():
        if key != f"{name}_mean":  # totals add up over ranks
            assert combined[key] == 2 * one[key], f"combine_summaries drops {key}"


def test_every_field_goes_to_jsonl_and_back(tmp_path):
    with_sink, _ = _recorded(_Capture())
    record = BatchRecord(**with_sink)
    logger = JsonlLogger(tmp_path / "t.jsonl")
    logger.on_batch(record)
    logger.close()
    assert read_jsonl(tmp_path / "t.jsonl")[0] == [record]


def test_every_metric_field_can_go_to_mlflow_and_back(mlflow_local_store):
    assert set(LOGGABLE_FIELDS) == set(METRIC_FIELDS) | {"epoch"}
    with_sink, _ = _recorded(_Capture())
    record = BatchRecord(**with_sink)
    logger = MLflowLogger(tracking_uri=mlflow_local_store, experiment="fields",
                          fields=LOGGABLE_FIELDS)
    logger.on_batch(record)
    logger.close()
    (back,), logged, _ = records_from_mlflow(logger.run_id, mlflow_local_store)
    assert logged == set(LOGGABLE_FIELDS)
    for name in LOGGABLE_FIELDS:
        assert getattr(back, name) == getattr(record, name), name
    assert back.time == pytest.approx(record.time, abs=0.001)  # MLflow keeps milliseconds
