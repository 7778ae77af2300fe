"""Running statistics of delivered batches: what `loader.stats()` returns.

Cost per batch is O(1): running sums, a fixed-size window (a deque with running sums) and a
log-bucketed histogram for the quantiles. The histogram keeps one counter per bucket of
relative width `2 * relative_accuracy`, so every quantile it reports is within
`relative_accuracy` (default 1%) of a value that was really observed at that rank, whatever
the number of batches. Memory is bounded by the value range: between 1 ns and 1 hour there are
fewer than 1,300 buckets. The maximum and the top-k slowest batches are exact.

Every metric field of `BatchRecord` is summed, whatever it is: the summary names each by
`records.SUMMARY_KEYS`, so a new field reaches `loader.stats()` without a line here.
"""

from __future__ import annotations

import heapq
import math
import operator
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

from shardloader.telemetry.records import FIELD_KINDS, METRIC_FIELDS, SUMMARY_KEYS, BatchRecord

_TINY = 1e-9  # values at or below this (seconds) count as zero

#: A batch as one tuple: (step, time, *METRIC_FIELDS), from a record or from its field values.
_ROW_OF_RECORD = operator.attrgetter("step", "time", *METRIC_FIELDS)
_ROW_OF_VALUES = operator.itemgetter("step", "time", *METRIC_FIELDS)
_FETCH = 2 + METRIC_FIELDS.index("fetch_seconds")
_SAMPLES = 2 + METRIC_FIELDS.index("samples")
#: Metric fields summarised as a mean over batches (a level, such as queue_depth).
_MEANS = frozenset(name for name, key in SUMMARY_KEYS.items() if key == f"{name}_mean")


class LogHistogram:
    """Quantiles of non-negative values within a relative accuracy, in bounded memory."""

    def __init__(self, relative_accuracy: float = 0.01) -> None:
        if not 0 < relative_accuracy < 1:
            raise ValueError(f"relative_accuracy must be in (0, 1), got {relative_accuracy}")
        self.relative_accuracy = relative_accuracy
        self._gamma = (1 + relative_accuracy) / (1 - relative_accuracy)
        self._log_gamma = math.log(self._gamma)
        self._buckets: dict[int, int] = {}
        self._zeros = 0
        self.count = 0

    def add(self, value: float) -> None:
        self.count += 1
        if value <= _TINY:
            self._zeros += 1
            return
        key = math.ceil(math.log(value) / self._log_gamma)
        self._buckets[key] = self._buckets.get(key, 0) + 1

    def quantile(self, q: float) -> float:
        """The value at quantile `q` (0..1); 0.0 when empty."""
        if self.count == 0:
            return 0.0
        rank = q * (self.count - 1)
        if rank < self._zeros:
            return 0.0
        seen = self._zeros
        for key in sorted(self._buckets):
            seen += self._buckets[key]
            if seen > rank:
                # Midpoint (in relative terms) of the bucket (gamma^(k-1), gamma^k].
                return 2 * self._gamma**key / (self._gamma + 1)
        return 2 * self._gamma ** max(self._buckets) / (self._gamma + 1)

    def __len__(self) -> int:
        return len(self._buckets) + (1 if self._zeros else 0)


class StatsAggregator:
    """Running summary of `BatchRecord`s. Also a `TelemetrySink` (cheap, synchronous).

    `window` is the number of most recent batches for the windowed stall fraction and
    samples/s; `top_k` is how many slowest batches to remember.
    """

    def __init__(self, window: int = 100, top_k: int = 5, relative_accuracy: float = 0.01) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.window = window
        self.top_k = top_k
        self._lock = threading.Lock()
        self._relative_accuracy = relative_accuracy
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._hist = LogHistogram(self._relative_accuracy)
            self._batches = 0
            #: The running sum of each of METRIC_FIELDS, in that order.
            self._sums: list[float] = [FIELD_KINDS[name](0) for name in METRIC_FIELDS]
            self._fetch_max = 0.0
            self._first_start: float | None = None  # when the first fetch began
            self._last_time: float | None = None
            # Window of (fetch_seconds, delivered time, samples) with running sums.
            self._recent: deque[tuple[float, float, int]] = deque()
            self._recent_fetch = 0.0
            self._recent_samples = 0
            self._slowest: list[tuple[float, int]] = []  # min-heap of (fetch_seconds, step)
            #: A mixture's figures per source ({name: {figure: sum}}): `add_by_source`.
            self._by_source: dict[str, dict[str, float]] = {}

    # -- the sink interface (on_batch is the hot path) ----------------------------------------
    def on_batch(self, record: BatchRecord) -> None:
        self.add(record)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None

    def add(self, record: BatchRecord) -> None:
        self._add_row(_ROW_OF_RECORD(record))

    def add_values(self, values: Mapping[str, float]) -> None:
        """`add` of the record these field values make, without making it: the Loader calls
        this inside next() when no other sink needs a record (a BatchRecord cost ~15 us there).
        `values` holds every field of `BatchRecord` by name."""
        self._add_row(_ROW_OF_VALUES(values))

    def add_by_source(self, figures: Mapping[str, Mapping[str, float]]) -> None:
        """Add one batch's figures per source of a mixture ({name: {figure: amount}}); the
        summary reports their sums as `source.<name>.<figure>` (seconds as `<figure>_total`)."""
        with self._lock:
            for name, amounts in figures.items():
                sums = self._by_source.setdefault(name, {})
                for figure, amount in amounts.items():
                    sums[figure] = sums.get(figure, 0) + amount

    def _add_row(self, row: tuple[Any, ...]) -> None:
        step, time, fetch, samples = row[0], row[1], row[_FETCH], row[_SAMPLES]
        with self._lock:
            self._batches += 1
            self._sums = list(map(operator.add, self._sums, row[2:]))
            if fetch > self._fetch_max:
                self._fetch_max = fetch
            self._hist.add(fetch)
            if self._first_start is None:
                self._first_start = time - fetch
            self._last_time = time
            recent = self._recent
            recent.append((fetch, time, samples))
            self._recent_fetch += fetch
            self._recent_samples += samples
            if len(recent) > self.window:
                old_fetch, _, old_samples = recent.popleft()
                self._recent_fetch -= old_fetch
                self._recent_samples -= old_samples
            if self.top_k:
                if len(self._slowest) < self.top_k:
                    heapq.heappush(self._slowest, (fetch, step))
                elif fetch > self._slowest[0][0]:
                    heapq.heapreplace(self._slowest, (fetch, step))

    # -- reading ------------------------------------------------------------------------------
    def summary(self) -> dict[str, float]:
        """A flat dict of numbers (ready for `log_metrics`).

        Keys: batches; every metric field under its `SUMMARY_KEYS` name (samples, padded,
        {fetch,read,transform,shard_wait}_seconds_total, queue_depth_mean, cache_hits,
        cache_misses, bytes_downloaded, ...); fetch_seconds_{mean,p50,p95,p99,max},
        wall_seconds, stall_fraction, samples_per_second, stall_fraction_window,
        samples_per_second_window and, once the cache was consulted, cache_hit_ratio. The stall
        fraction is time waiting for data / wall time. For a mixture, per source:
        source.<name>.{samples, read_seconds_total, shard_wait_seconds_total, bytes_downloaded}.
        """
        with self._lock:
            n = self._batches
            out: dict[str, float] = {"batches": n}
            for name, total in zip(METRIC_FIELDS, self._sums, strict=True):
                out[SUMMARY_KEYS[name]] = (total / n if n else 0.0) if name in _MEANS else total
            fetch_total = out[SUMMARY_KEYS["fetch_seconds"]]
            out["fetch_seconds_mean"] = fetch_total / n if n else 0.0
            out["fetch_seconds_p50"] = self._hist.quantile(0.50)
            out["fetch_seconds_p95"] = self._hist.quantile(0.95)
            out["fetch_seconds_p99"] = self._hist.quantile(0.99)
            out["fetch_seconds_max"] = self._fetch_max
            wall = 0.0
            if self._first_start is not None and self._last_time is not None:
                wall = max(self._last_time - self._first_start, 0.0)
            out["wall_seconds"] = wall
            out["stall_fraction"] = min(fetch_total / wall, 1.0) if wall > 0 else 0.0
            out["samples_per_second"] = out["samples"] / wall if wall > 0 else 0.0
            window_wall = 0.0
            if self._recent:
                first_fetch, first_time, _ = self._recent[0]
                window_wall = max(self._recent[-1][1] - (first_time - first_fetch), 0.0)
            out["stall_fraction_window"] = (
                min(self._recent_fetch / window_wall, 1.0) if window_wall > 0 else 0.0
            )
            out["samples_per_second_window"] = (
                self._recent_samples / window_wall if window_wall > 0 else 0.0
            )
            lookups = out["cache_hits"] + out["cache_misses"]
            if lookups:
                out["cache_hit_ratio"] = out["cache_hits"] / lookups
            for name, sums in self._by_source.items():
                for figure, total in sums.items():
                    key = f"{figure}_total" if figure.endswith("_seconds") else figure
                    out[f"source.{name}.{key}"] = total
            return out

    def slowest(self) -> list[dict[str, Any]]:
        """The `top_k` slowest batches seen, slowest first: [{"step", "fetch_seconds"}]."""
        with self._lock:
            ranked = sorted(self._slowest, key=lambda item: (-item[0], item[1]))
        return [{"step": step, "fetch_seconds": fetch} for fetch, step in ranked]
