"""Telemetry: per-batch fetch_seconds and its causes, to MLflow or JSONL, and the stall report.

The Loader builds one `BatchRecord` per delivered batch and hands it to a `TelemetrySink`
(`MLflowLogger`, `JsonlLogger`, `ProgressSink`, or several through `MultiSink`) and to its
`StatsAggregator` (what `loader.stats()` returns). Sinks do their I/O on a background thread;
the training thread only enqueues.
"""

from shardloader.telemetry.distributed import aggregate_across_ranks, combine_summaries
from shardloader.telemetry.gpu import GpuIdleTimer
from shardloader.telemetry.mlflow.logger import MLflowLogger
from shardloader.telemetry.progress import ProgressSink, progress
from shardloader.telemetry.records import (
    LOGGABLE_FIELDS,
    BatchRecord,
    NullSink,
    TelemetryInputError,
    TelemetrySink,
)
from shardloader.telemetry.sinks import JsonlLogger, MultiSink, read_jsonl
from shardloader.telemetry.stats import StatsAggregator

__all__ = [
    "BatchRecord",
    "GpuIdleTimer",
    "JsonlLogger",
    "LOGGABLE_FIELDS",
    "MLflowLogger",
    "MultiSink",
    "NullSink",
    "ProgressSink",
    "StatsAggregator",
    "TelemetryInputError",
    "TelemetrySink",
    "aggregate_across_ranks",
    "combine_summaries",
    "progress",
    "read_jsonl",
]
