"""Record history: a run's batch records read back from where telemetry wrote them.

`records_from_jsonl` reads a `JsonlLogger` file; `records_from_mlflow` rebuilds the records
from the metric histories an `MLflowLogger` wrote to a run. Both also return the other
per-step series (such as gpu_idle_seconds) for the report's `extra`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from shardloader.telemetry.records import (
    LOGGABLE_FIELDS,
    BatchRecord,
    TelemetryInputError,
    old_names,
)
from shardloader.telemetry.sinks import read_jsonl


def records_from_jsonl(path: str | os.PathLike[str], rank: int | None = None,
                       ) -> tuple[list[BatchRecord], dict[str, list[tuple[int, float]]]]:
    """Batch records (of `rank`, if given) and extra per-step series of a JSONL file."""
    records, metric_lines = read_jsonl(path)
    if rank is not None:
        records = [r for r in records if r.rank == rank]
    extra: dict[str, list[tuple[int, float]]] = {}
    for entry in metric_lines:
        for name, value in entry["metrics"].items():
            extra.setdefault(name, []).append((entry["step"], float(value)))
    return records, extra


def records_from_mlflow(
    run_id: str,
    tracking_uri: str | None = None,
    *,
    prefix: str = "",
    rank: int | None = None,
    extra_metrics: Sequence[str] = ("gpu_idle_seconds",),
) -> tuple[list[BatchRecord], set[str], dict[str, list[tuple[int, float]]]]:
    """Rebuild batch records from a run's metric histories.

    The metrics of one record share its step and timestamp, so they are joined on
    (step, timestamp); a step logged twice (after a resume) yields two records. `rank` reads
    the keys an `all_ranks=True` logger wrote for that rank. Returns (records, fields that
    were logged, extra series).
    """
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    suffix = "" if rank is None else f"/rank{rank}"
    histories: dict[str, list[Any]] = {}
    for name in LOGGABLE_FIELDS:
        for logged in (name, *old_names(name)):  # a run logged before the field was renamed
            history = client.get_metric_history(run_id, f"{prefix}{logged}{suffix}")
            if history:
                histories[name] = history
                break
    if "fetch_seconds" not in histories:
        logged = sorted(client.get_run(run_id).data.metrics)
        raise TelemetryInputError(
            f"MLflow run {run_id}: no metric {prefix}fetch_seconds{suffix} "
            f"(metrics logged: {', '.join(logged) or 'none'})"
        )
    rows: dict[tuple[int, int], dict[str, float]] = {}
    for name, history in histories.items():
        for metric in history:
            rows.setdefault((metric.step, metric.timestamp), {})[name] = metric.value
    records = []
    for (step, timestamp), values in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if "fetch_seconds" not in values:
            continue
        data: dict[str, Any] = {"step": step, "time": timestamp / 1000.0,
                                "rank": rank or 0, "epoch": 0}
        for name in LOGGABLE_FIELDS:  # from_dict makes an int field's whole float an int
            data[name] = values.get(name, 0)
        records.append(BatchRecord.from_dict(data, where=f"MLflow run {run_id} step {step}"))
    extra = {}
    for name in extra_metrics:
        history = client.get_metric_history(run_id, f"{name}{suffix}")
        if history:
            extra[name] = [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)]
    return records, set(histories), extra

