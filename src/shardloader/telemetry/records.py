"""What the Loader reports per batch (`BatchRecord`) and who receives it (`TelemetrySink`).

A `BatchRecord` is made once per delivered batch on the training thread. `fetch_seconds` is
the wall time the caller spent inside `next(loader)`: the time the training loop waited for
data. The worker-side fields say where the batch's production time went (reading rows,
decode + augment, waiting for shard files), so a stall can be attributed to a cause.

The dataclass's fields are the one list of per-batch figures: everything else is derived from
them, so a new figure is declared here once and measured where it happens. A field marked
`WORKER` is measured by the worker that made the batch and travels by name in
`loader.batches.BatchTimings.figures` (`WORKER_FIELDS`); the others are set by the training
process (`loader.recording`). From the fields come the JSONL lines (`to_dict`), the MLflow
metrics (`LOGGABLE_FIELDS`), their reading back (`from_dict`, `telemetry.history`), and
`loader.stats()`: every metric is summed, under `SUMMARY_KEYS` (`<name>_total` for seconds,
the name for counts, `<name>_mean` for a field marked `LEVEL`, averaged over batches), on the
Loader's no-sink path as on the sink path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from shardloader.errors import ShardloaderError


class TelemetryInputError(ShardloaderError, ValueError):
    """A telemetry file or metric history is malformed (names the file/line and field)."""


#: Field metadata: measured by the worker that made the batch (`BatchTimings.figures`).
WORKER = {"measured_by": "worker"}
#: Field metadata: a level, not an amount: `loader.stats()` reports its mean over batches.
LEVEL = {"summary": "mean"}


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """Telemetry of one delivered batch on one rank."""

    step: int  # training step: the loader's running batch count, restored on resume
    epoch: int
    rank: int
    samples: int
    fetch_seconds: float  # wall time the caller spent inside next(loader)
    time: float  # time.time() when the batch was delivered
    read_seconds: float = field(metadata=WORKER)  # worker time reading rows
    transform_seconds: float = field(metadata=WORKER)  # decoding + augmenting (+ collating)
    shard_wait_seconds: float = field(metadata=WORKER)  # waiting for shard files to be there
    queue_depth: int = field(metadata=LEVEL)  # ready batches waiting when the caller asked
    cache_hits: int = field(default=0, metadata=WORKER)  # the worker's and this process's
    cache_misses: int = field(default=0, metadata=WORKER)
    bytes_downloaded: int = field(default=0, metadata=WORKER)
    padded: int = 0  # samples of padding (tail="pad")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in _FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "record") -> BatchRecord:
        """Validate a plain dict (e.g. one JSON line); `where` names it in error messages.

        Keys that are not fields are ignored (a newer writer may add fields with defaults); a
        field's old name (`RENAMED_FIELDS`) is read as its new one.
        """
        if not isinstance(data, Mapping):
            raise TelemetryInputError(f"{where}: expected an object, got {type(data).__name__}")
        renamed = {new: data[old] for old, new in RENAMED_FIELDS.items()
                   if old in data and new not in data}
        if renamed:  # written before the rename
            data = {**data, **renamed}
        missing = [name for name in REQUIRED_FIELDS if name not in data]
        if missing:
            raise TelemetryInputError(f"{where}: batch record lacks {', '.join(missing)}")
        values: dict[str, Any] = {}
        for name, kind in FIELD_KINDS.items():
            if name not in data:
                continue
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TelemetryInputError(
                    f"{where}: field {name!r} must be a number, got {value!r}"
                )
            if kind is int:
                if isinstance(value, float):
                    if not value.is_integer():
                        raise TelemetryInputError(
                            f"{where}: field {name!r} must be an integer, got {value!r}"
                        )
                    value = int(value)
            else:
                value = float(value)
                if math.isnan(value):
                    raise TelemetryInputError(f"{where}: field {name!r} is NaN")
            values[name] = value
        return cls(**values)


_FIELDS = dataclasses.fields(BatchRecord)
#: Each field's kind: int or float.
FIELD_KINDS: dict[str, type] = {
    f.name: (int if f.type in ("int", int) else float) for f in _FIELDS
}
#: Fields every record must carry (the ones without defaults).
REQUIRED_FIELDS: tuple[str, ...] = tuple(
    f.name for f in _FIELDS if f.default is dataclasses.MISSING
)
#: Which batch of which run: the record's identity, no metric.
IDENTITY_FIELDS: tuple[str, ...] = ("step", "epoch", "rank", "time")
#: Numeric per-batch fields that make sense as metrics (everything but the identity fields).
METRIC_FIELDS: tuple[str, ...] = tuple(f.name for f in _FIELDS if f.name not in IDENTITY_FIELDS)
#: Fields the worker measures (`loader.batches.BatchTimings.figures`), in field order.
WORKER_FIELDS: tuple[str, ...] = tuple(
    f.name for f in _FIELDS if f.metadata.get("measured_by") == "worker"
)
#: Metric field -> its key in `loader.stats()`: a level's mean, a duration's total, a count's sum.
SUMMARY_KEYS: dict[str, str] = {
    f.name: (f"{f.name}_mean" if f.metadata.get("summary") == "mean"
             else f"{f.name}_total" if FIELD_KINDS[f.name] is float else f.name)
    for f in _FIELDS if f.name in METRIC_FIELDS
}
#: Fields a metrics backend can store per step (the step and time are the metric's own).
LOGGABLE_FIELDS: tuple[str, ...] = METRIC_FIELDS + ("epoch",)
#: Fields renamed since first written, old name -> new. Files and MLflow runs written under the
#: old name are read under the new one (`from_dict`, `telemetry.history`); only the new is
#: written. download_wait_seconds: the time the reading thread waited for shard files, which
#: the dataset protocol (`shard_wait_seconds()`) and every other place call shard wait.
RENAMED_FIELDS: dict[str, str] = {"download_wait_seconds": "shard_wait_seconds"}


def worker_figures() -> dict[str, float]:
    """Zeros for every `WORKER_FIELDS` (what a worker measured before it measured anything)."""
    return {name: FIELD_KINDS[name](0) for name in WORKER_FIELDS}


def old_names(name: str) -> tuple[str, ...]:
    """The names field `name` was written under before (`RENAMED_FIELDS`), oldest last."""
    return tuple(old for old, new in RENAMED_FIELDS.items() if new == name)


@runtime_checkable
class TelemetrySink(Protocol):
    """Receives telemetry. `on_batch` runs on the training thread and must cost microseconds."""

    def on_batch(self, record: BatchRecord) -> None:
        """One delivered batch. Must not block (enqueue; a background thread does the rest)."""
        ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Free-form metrics at a training step (e.g. checkpoint phase timings). Non-blocking."""
        ...

    def flush(self) -> None:
        """Deliver everything received so far (bounded wait)."""
        ...

    def close(self) -> None:
        """Flush (bounded wait) and release resources. Later calls are ignored."""
        ...


class NullSink:
    """A sink that drops everything (for ranks that do not log)."""

    def on_batch(self, record: BatchRecord) -> None:
        return None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None
