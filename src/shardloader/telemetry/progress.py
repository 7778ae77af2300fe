"""A tqdm progress bar driven by batch records: samples, samples/s and stall %.

`ProgressSink` is a `TelemetrySink`: pass it to the Loader (`telemetry=`, alone or in a
`MultiSink`). Per batch it adds the samples to the bar and keeps windowed sums; the postfix
(samples/s and the share of wall time spent waiting for data over the last `window` batches)
is refreshed at most every `refresh_seconds`, so the per-batch cost stays around a microsecond.
`progress(loader)` wraps iteration when you would rather not touch the loader's sinks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

from shardloader.telemetry.records import BatchRecord

T = TypeVar("T")


class ProgressSink:
    """Drives a tqdm bar counting samples; postfix shows samples/s and stall %."""

    def __init__(self, total: int | None = None, *, window: int = 50,
                 refresh_seconds: float = 0.5, bar: Any = None, **tqdm_kwargs: Any) -> None:
        if bar is None:
            from tqdm.auto import tqdm

            tqdm_kwargs.setdefault("unit", "sample")
            tqdm_kwargs.setdefault("unit_scale", True)
            bar = tqdm(total=total, **tqdm_kwargs)
        self.bar = bar
        self.window = window
        self.refresh_seconds = refresh_seconds
        self._recent: deque[tuple[float, float, int]] = deque()
        self._fetch = 0.0
        self._samples = 0
        self._last_refresh = 0.0
        self.postfix: dict[str, str] = {}

    def on_batch(self, record: BatchRecord) -> None:
        self.update(record.samples, record.fetch_seconds, record.time)

    def update(self, samples: int, fetch_seconds: float, when: float | None = None) -> None:
        when = time.time() if when is None else when
        recent = self._recent
        recent.append((fetch_seconds, when, samples))
        self._fetch += fetch_seconds
        self._samples += samples
        if len(recent) > self.window:
            old_fetch, _, old_samples = recent.popleft()
            self._fetch -= old_fetch
            self._samples -= old_samples
        self.bar.update(samples)
        if when - self._last_refresh >= self.refresh_seconds:
            self._last_refresh = when
            first_fetch, first_time, _ = recent[0]
            wall = when - (first_time - first_fetch)
            if wall > 0:
                self.postfix = {
                    "samples/s": f"{self._samples / wall:,.0f}",
                    "stall": f"{100 * min(self._fetch / wall, 1.0):.1f}%",
                }
                self.bar.set_postfix(self.postfix, refresh=False)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        return None

    def flush(self) -> None:
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def progress(loader: Iterable[T], total: int | None = None, **tqdm_kwargs: Any) -> Iterator[T]:
    """Iterate `loader` under a progress bar of samples, samples/s and stall %.

    It times `next()` itself (the same quantity as fetch_seconds) and counts samples with the
    loader's `batch_size` (1 per batch when it has none). `total` is in samples; by default
    `len(loader) * batch_size` when the loader has a length.
    """
    batch_size = int(getattr(loader, "batch_size", None) or 1)
    if total is None:
        try:
            total = len(loader) * batch_size  # type: ignore[arg-type]
        except TypeError:
            total = None
    sink = ProgressSink(total=total, **tqdm_kwargs)
    iterator = iter(loader)
    try:
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            waited = time.perf_counter() - start
            sink.update(batch_size, waited)
            yield batch
    finally:
        sink.close()
