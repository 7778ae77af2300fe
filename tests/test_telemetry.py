"""BatchRecord validation, StatsAggregator, JSONL sink round trip, MultiSink, progress bar,
the GPU idle timer's CPU path, and combining per-rank summaries."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest

from shardloader.telemetry import (
    BatchRecord,
    GpuIdleTimer,
    JsonlLogger,
    MultiSink,
    ProgressSink,
    StatsAggregator,
    TelemetryInputError,
    TelemetrySink,
    combine_summaries,
    progress,
    read_jsonl,
)
from shardloader.telemetry.stats import LogHistogram


def rec(step: int, fetch: float, time: float, samples: int = 32, **kw) -> BatchRecord:
    base = dict(epoch=0, rank=0, read_seconds=0.0, transform_seconds=0.0,
                shard_wait_seconds=0.0, queue_depth=0)
    base.update(kw)
    return BatchRecord(step=step, samples=samples, fetch_seconds=fetch, time=time, **base)


# -- BatchRecord ---------------------------------------------------------------------------------
def test_batch_record_dict_round_trip_and_validation():
    r = rec(3, 0.25, 100.5, cache_hits=2, bytes_downloaded=10)
    assert BatchRecord.from_dict(r.to_dict()) == r
    assert BatchRecord.from_dict({**r.to_dict(), "future_field": 1}) == r
    with pytest.raises(TelemetryInputError, match=r"here: batch record lacks fetch_seconds"):
        BatchRecord.from_dict({k: v for k, v in r.to_dict().items() if k != "fetch_seconds"},
                              where="here")
    with pytest.raises(TelemetryInputError, match=r"field 'samples' must be an integer"):
        BatchRecord.from_dict({**r.to_dict(), "samples": 1.5})
    with pytest.raises(TelemetryInputError, match=r"field 'fetch_seconds' must be a number"):
        BatchRecord.from_dict({**r.to_dict(), "fetch_seconds": "slow"})
    for sink in (StatsAggregator(), MultiSink([])):
        assert isinstance(sink, TelemetrySink)


# -- StatsAggregator -----------------------------------------------------------------------------
def test_add_values_is_add_of_the_record_with_those_fields():
    """The Loader calls add_values when no sink needs a record: the same summary."""
    rng = np.random.default_rng(3)
    records = [rec(step, float(rng.exponential(0.01)), 100.0 + step * 0.02, samples=int(rng.integers(1, 65)),
                   padded=int(rng.integers(0, 3)), read_seconds=float(rng.random()),
                   transform_seconds=float(rng.random()), shard_wait_seconds=float(rng.random()),
                   queue_depth=int(rng.integers(0, 5)), cache_hits=int(rng.integers(0, 9)),
                   cache_misses=int(rng.integers(0, 9)), bytes_downloaded=int(rng.integers(0, 10**6)))
               for step in range(1, 300)]
    by_record, by_values = StatsAggregator(window=7, top_k=4), StatsAggregator(window=7, top_k=4)
    for r in records:
        by_record.add(r)
        by_values.add_values(r.to_dict())
    assert by_values.summary() == by_record.summary()
    assert by_values.slowest() == by_record.slowest()


def test_quantiles_within_relative_accuracy_in_bounded_memory():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.lognormal(-6, 2, 50_000), np.zeros(500)])
    hist = LogHistogram(0.01)
    for v in values:
        hist.add(float(v))
    for q in (0.0, 0.01, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0):
        exact = float(np.quantile(values, q, method="lower"))
        got = hist.quantile(q)
        assert got == pytest.approx(exact, rel=0.0101, abs=1e-9), q
    assert len(hist) < 1300  # buckets, not values


def test_summary_totals_stall_fraction_window_and_slowest():
    agg = StatsAggregator(window=4, top_k=3)
    # Batch i is delivered at t = 10 + i; the loop waited fetch_i of that second.
    fetches = [0.5, 0.0, 0.1, 0.0, 0.0, 0.2, 0.0, 0.05]
    for i, f in enumerate(fetches):
        agg.on_batch(rec(i, f, 10.0 + i, samples=10, transform_seconds=0.01, read_seconds=0.02,
                         shard_wait_seconds=0.03, queue_depth=i % 3, padded=1 if i == 7 else 0))
    s = agg.summary()
    assert s["batches"] == 8 and s["samples"] == 80 and s["padded"] == 1
    assert s["fetch_seconds_total"] == pytest.approx(sum(fetches))
    assert s["fetch_seconds_max"] == 0.5
    wall = (10.0 + 7) - (10.0 - 0.5)  # first fetch began at 9.5, last delivery at 17
    assert s["wall_seconds"] == pytest.approx(wall)
    assert s["stall_fraction"] == pytest.approx(sum(fetches) / wall)
    assert s["samples_per_second"] == pytest.approx(80 / wall)
    # Window: the last 4 batches (steps 4..7), from 14 - 0.0 to 17.
    assert s["stall_fraction_window"] == pytest.approx((0.0 + 0.2 + 0.0 + 0.05) / 3.0)
    assert s["samples_per_second_window"] == pytest.approx(40 / 3.0)
    assert s["transform_seconds_total"] == pytest.approx(0.08)
    assert s["shard_wait_seconds_total"] == pytest.approx(0.24)
    assert s["queue_depth_mean"] == pytest.approx(sum(i % 3 for i in range(8)) / 8)
    assert "cache_hit_ratio" not in s  # the cache was never consulted
    assert agg.slowest() == [{"step": 0, "fetch_seconds": 0.5}, {"step": 5, "fetch_seconds": 0.2},
                             {"step": 2, "fetch_seconds": 0.1}]


def test_cache_counters_and_reset():
    agg = StatsAggregator()
    agg.on_batch(rec(0, 0.1, 1.0, cache_hits=3, cache_misses=1, bytes_downloaded=500))
    s = agg.summary()
    assert (s["cache_hits"], s["cache_misses"], s["bytes_downloaded"]) == (3, 1, 500)
    assert s["cache_hit_ratio"] == 0.75
    agg.reset()
    assert agg.summary()["batches"] == 0 and agg.summary()["stall_fraction"] == 0.0


def test_combine_summaries_sums_counts_and_names_slowest_rank():
    a, b = StatsAggregator(), StatsAggregator()
    for i in range(10):
        a.on_batch(rec(i, 0.01, 1.0 + i, cache_hits=1))
        b.on_batch(rec(i, 0.3, 1.0 + i, cache_misses=1))
    out = combine_summaries([a.summary(), b.summary()])
    c = out["combined"]
    assert out["world_size"] == 2 and len(out["per_rank"]) == 2
    assert c["batches"] == 20 and c["samples"] == 640
    assert c["slowest_rank"] == 1
    assert c["worst_rank_stall_fraction"] == b.summary()["stall_fraction"]
    assert c["stall_fraction_mean"] == pytest.approx(
        (a.summary()["stall_fraction"] + b.summary()["stall_fraction"]) / 2)
    assert c["cache_hit_ratio"] == 0.5
    with pytest.raises(ValueError):
        combine_summaries([])


# -- JSONL ---------------------------------------------------------------------------------------
def test_jsonl_round_trip_in_order(tmp_path):
    path = tmp_path / "telemetry" / "run.jsonl"
    records = [rec(i, 1 / (i + 3), 1000.0 + i / 7, read_seconds=i / 9, cache_hits=i)
               for i in range(300)]
    sink = JsonlLogger(path, flush_interval=0.01)
    for r in records:
        sink.on_batch(r)
        if r.step == 150:
            sink.log_metrics({"checkpoint/stage_seconds": 0.125}, step=150)
    assert sink.flush(timeout=10)
    sink.close()
    got, metrics = read_jsonl(path)
    assert got == records  # every field, bit for bit, in delivery order
    assert [(m["step"], m["metrics"]) for m in metrics] == [(150, {"checkpoint/stage_seconds": 0.125})]
    # Append mode: a resumed run continues the file.
    again = JsonlLogger(path)
    again.on_batch(records[0])
    again.close()
    assert read_jsonl(path)[0] == records + records[:1]


def test_jsonl_reader_errors_name_file_and_line(tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    good = json.dumps({"kind": "batch", **rec(0, 0.1, 1.0).to_dict()})
    path.write_text(good + "\n{not json\n" + good + "\n")
    with pytest.raises(TelemetryInputError, match=rf"{path}:2: not valid JSON"):
        read_jsonl(path)
    path.write_text(good + "\n" + json.dumps({"kind": "batch", "step": 1}) + "\n")
    with pytest.raises(TelemetryInputError, match=rf"{path}:2: batch record lacks"):
        read_jsonl(path)
    path.write_text(good + "\n" + good[:20])  # torn last line: writer killed mid-line
    with caplog.at_level(logging.WARNING):
        assert len(read_jsonl(path)[0]) == 1
    assert "incomplete last line" in caplog.text
    with pytest.raises(TelemetryInputError, match="not found"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_multisink_isolates_a_failing_sink(tmp_path, caplog):
    class Broken:
        def on_batch(self, record):
            raise RuntimeError("boom")

        def log_metrics(self, metrics, step):
            raise RuntimeError("boom")

        def flush(self):
            pass

        def close(self):
            pass

    agg = StatsAggregator()
    jsonl = JsonlLogger(tmp_path / "m.jsonl")
    sink = MultiSink([Broken(), agg, jsonl])
    with caplog.at_level(logging.ERROR):
        for i in range(3):
            sink.on_batch(rec(i, 0.1, 1.0 + i))
        sink.log_metrics({"x": 1.0}, 2)
    sink.flush()
    sink.close()
    assert agg.summary()["batches"] == 3
    assert [r.step for r in read_jsonl(tmp_path / "m.jsonl")[0]] == [0, 1, 2]
    assert "boom" in caplog.text


def test_closed_sink_drops_and_counts(tmp_path):
    sink = JsonlLogger(tmp_path / "c.jsonl")
    sink.close()
    sink.on_batch(rec(0, 0.1, 1.0))
    assert sink.dropped == 1
    sink.close()  # idempotent


# -- progress bar --------------------------------------------------------------------------------
def test_progress_sink_counts_samples_and_shows_stall():
    out = io.StringIO()
    bar = ProgressSink(total=320, file=out, refresh_seconds=0.0, mininterval=0)
    for i in range(10):
        bar.on_batch(rec(i, 0.25, 100.0 + i, samples=32))
    assert bar.bar.n == 320
    assert bar.postfix["stall"] == f"{100 * 2.5 / 9.25:.1f}%"
    assert bar.postfix["samples/s"] == f"{320 / 9.25:,.0f}"
    bar.close()
    assert "stall=" in out.getvalue()


def test_progress_wraps_any_loader():
    class Batches(list):
        batch_size = 4

    out = io.StringIO()
    got = list(progress(Batches(range(5)), file=out, mininterval=0))
    assert got == [0, 1, 2, 3, 4]
    assert "20.0/20.0" in out.getvalue()  # samples: 5 batches of batch_size 4


# -- GPU idle timer ------------------------------------------------------------------------------
def test_gpu_idle_timer_is_a_no_op_on_cpu():
    sink = StatsAggregator()
    timer = GpuIdleTimer("cpu", sink=sink)
    assert not timer.enabled
    assert list(timer.wrap(iter([1, 2, 3]))) == [1, 2, 3]
    timer.step_start(0)
    timer.step_end()
    assert timer.poll(wait=True) == []
    assert timer.summary() == {}
    timer.close()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_gpu_idle_timer_measures_the_gap_on_cuda():
    import time

    import torch

    metrics = []

    class Sink:
        def log_metrics(self, values, step):
            metrics.append((step, values["gpu_idle_seconds"]))

    timer = GpuIdleTimer("cuda", sink=Sink())
    assert timer.enabled
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    # Step 0 queues ~0.2 s of matmuls; the host "fetches" for 10 ms while they run: no idle.
    # Step 1 queues one matmul; the host then waits 100 ms: the GPU idles ~100 ms.
    # Step 2 starts after it.
    timer.step_start(0)
    for _ in range(40):
        x = (x @ x).clamp_(-1, 1)
    timer.step_end()
    time.sleep(0.01)  # the host's data wait, while the GPU is still busy
    timer.step_start(1)
    x = (x @ x).clamp_(-1, 1)
    timer.step_end()
    torch.cuda.synchronize()
    time.sleep(0.1)  # the host's data wait, with the GPU done
    timer.step_start(2)
    timer.close()
    gaps = dict(metrics)
    assert gaps[1] < 0.005, gaps
    assert 0.09 < gaps[2] < 0.5, gaps
    assert timer.summary()["gpu_idle_steps"] == 2
