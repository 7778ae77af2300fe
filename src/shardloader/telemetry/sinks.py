"""Plain sinks: a JSON-lines file writer and a fan-out to several sinks.

JSONL format, one object per line::

    {"kind": "batch", "step": 12, "epoch": 0, "rank": 0, "samples": 64, "fetch_seconds": ...}
    {"kind": "metrics", "step": 12, "time": 1735000000.1, "metrics": {"ckpt/stage_s": 0.4}}

Batch lines carry every `BatchRecord` field. The file is opened in append mode, so a resumed
run continues the same file (steps may then repeat; each line is one delivered batch).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from shardloader.telemetry.background import BackgroundSink
from shardloader.telemetry.records import BatchRecord, TelemetryInputError, TelemetrySink

log = logging.getLogger(__name__)


class JsonlLogger(BackgroundSink):
    """Writes one JSON line per batch record (and per `log_metrics` call) from a background thread."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_queue: int = 10_000,
        flush_interval: float = 1.0,
        close_timeout: float = 10.0,
    ) -> None:
        super().__init__(max_queue=max_queue, flush_interval=flush_interval,
                         close_timeout=close_timeout, name="shardloader-jsonl")
        self.path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in _on_close
        self._start()

    def on_batch(self, record: BatchRecord) -> None:
        self._put(record)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._put(("metrics", dict(metrics), int(step), time.time()))

    def _handle(self, items: list[Any]) -> None:
        lines = []
        for item in items:
            if isinstance(item, BatchRecord):
                lines.append(json.dumps({"kind": "batch", **item.to_dict()}))
            else:
                _, metrics, step, when = item
                lines.append(json.dumps(
                    {"kind": "metrics", "step": step, "time": when, "metrics": metrics}
                ))
        self._file.write("\n".join(lines) + "\n")
        self._file.flush()

    def _on_close(self) -> None:
        self._file.close()


def read_jsonl(
    path: str | os.PathLike[str],
) -> tuple[list[BatchRecord], list[dict[str, Any]]]:
    """Batch records and metric entries of a JSONL telemetry file, in file order.

    Raises `TelemetryInputError` naming the file and line of anything malformed. A last line
    without its newline (a writer killed mid-line) is skipped with a warning, not an error.
    """
    path = os.fspath(path)
    records: list[BatchRecord] = []
    metrics: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        raise TelemetryInputError(f"{path}: telemetry file not found") from None
    last = len(lines) - 1
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            if number - 1 == last:  # torn final line: the writer died mid-write
                log.warning("%s: ignoring an incomplete last line", where)
                continue
            raise TelemetryInputError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise TelemetryInputError(f"{where}: expected a JSON object")
        kind = data.get("kind", "batch")
        if kind == "batch":
            records.append(BatchRecord.from_dict(data, where=where))
        elif kind == "metrics":
            step, values = data.get("step"), data.get("metrics")
            if not isinstance(step, int) or isinstance(step, bool):
                raise TelemetryInputError(f"{where}: metrics line needs an integer 'step'")
            if not isinstance(values, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values()
            ):
                raise TelemetryInputError(f"{where}: 'metrics' must map names to numbers")
            metrics.append({"step": step, "time": data.get("time"), "metrics": values})
        else:
            raise TelemetryInputError(f"{where}: unknown line kind {kind!r} (batch or metrics)")
    return records, metrics


class MultiSink:
    """Sends everything to several sinks. A failing sink is logged and does not affect the rest."""

    def __init__(self, sinks: Iterable[TelemetrySink]) -> None:
        self.sinks = list(sinks)

    def on_batch(self, record: BatchRecord) -> None:
        for sink in self.sinks:
            try:
                sink.on_batch(record)
            except Exception:  # noqa: BLE001 - one sink must not take training down
                log.exception("telemetry sink %r failed in on_batch", sink)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for sink in self.sinks:
            try:
                sink.log_metrics(metrics, step)
            except Exception:  # noqa: BLE001
                log.exception("telemetry sink %r failed in log_metrics", sink)

    def flush(self) -> None:
        for sink in self.sinks:
            try:
                sink.flush()
            except Exception:  # noqa: BLE001
                log.exception("telemetry sink %r failed in flush", sink)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:  # noqa: BLE001
                log.exception("telemetry sink %r failed in close", sink)
