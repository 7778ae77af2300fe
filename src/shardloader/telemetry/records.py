"""What the Loader reports per batch (`BatchRecord`) and who receives it (`TelemetrySink`).

A `BatchRecord` is made once per delivered batch on the training thread. `fetch_seconds` is
the wall time the caller spent inside `next(loader)`: the time the training loop waited for
data. The worker-side fields say where the batch's production time went (reading rows,
decode + augment, waiting for a shard download), so a stall can be attributed to a cause.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from shardloader.errors import ShardloaderError


class TelemetryInputError(ShardloaderError, ValueError):
    """A telemetry file or metric history is malformed (names the file/line and field)."""


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """Telemetry of one delivered batch on one rank."""

    step: int  # training step: the loader's running batch count, restored on resume
    epoch: int
    rank: int
    samples: int
    fetch_seconds: float  # wall time the caller spent inside next(loader)
    time: float  # time.time() when the batch was delivered
    read_seconds: float  # worker time reading rows
    transform_seconds: float  # worker time decoding + augmenting (+ collating)
    shard_wait_seconds: float  # worker time waiting for shards to reach the cache
    queue_depth: int  # ready batches waiting when the caller asked
    cache_hits: int = 0
    cache_misses: int = 0
    bytes_downloaded: int = 0
    padded: int = 0

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
        for name, kind in _FIELD_KINDS.items():
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
_FIELD_KINDS: dict[str, type] = {
    f.name: (int if f.type in ("int", int) else float) for f in _FIELDS
}
#: Fields every record must carry (the ones without defaults).
REQUIRED_FIELDS: tuple[str, ...] = tuple(
    f.name for f in _FIELDS if f.default is dataclasses.MISSING
)
#: Numeric per-batch fields that make sense as metrics (everything but the identity fields).
METRIC_FIELDS: tuple[str, ...] = tuple(
    f.name for f in _FIELDS if f.name not in ("step", "epoch", "rank", "time")
)
#: Fields a metrics backend can store per step (the step and time are the metric's own).
LOGGABLE_FIELDS: tuple[str, ...] = METRIC_FIELDS + ("epoch",)
#: Fields renamed since first written, old name -> new. Files and MLflow runs written under the
#: old name are read under the new one (`from_dict`, `telemetry.history`); only the new is
#: written. download_wait_seconds: the time the reading thread waited for shard files, which
#: the dataset protocol (`shard_wait_seconds()`) and every other place call shard wait.
RENAMED_FIELDS: dict[str, str] = {"download_wait_seconds": "shard_wait_seconds"}


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
