"""Where the time went: turn a run's batch records into a report, a text table and a plot.

`analyse(records)` is a pure function from batch records to a report dict: wall time, time
waiting for data, fetch_seconds quantiles, the slowest batches, the dominant cause and
concrete recommendations. `render_text(report)` formats it; `plot(records, path)` draws
fetch_seconds over steps and its histogram (matplotlib's Agg canvas, no display needed).
`records_from_mlflow` / `records_from_jsonl` load records from the two places telemetry goes.

How the cause is decided. The first `warmup_steps` batches (worker start-up, first download)
are reported but left out of the diagnosis. If, after them, the loop waited less than
`none_threshold` of wall time, the cause is "none". Otherwise every batch the loop waited for
(fetch_seconds > `stall_seconds`) lends its waiting time to the worker-side costs of that
batch in proportion: download wait and row reads to "storage", decode + augment to "decode".
The larger share is the dominant cause. If no worker timings were recorded, it is "unknown".
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Collection, Mapping, Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from shardloader.telemetry.records import (
    LOGGABLE_FIELDS,
    BatchRecord,
    TelemetryInputError,
)
from shardloader.telemetry.sinks import read_jsonl

CAUSES = ("storage", "decode", "none", "unknown")
_WORKER_FIELDS = ("read_seconds", "transform_seconds", "download_wait_seconds")


# -- analysis (pure) ----------------------------------------------------------------------------
def analyse(
    records: Sequence[BatchRecord],
    *,
    fields: Collection[str] | None = None,
    extra: Mapping[str, Sequence[tuple[int, float]]] | None = None,
    warmup_steps: int = 1,
    top_k: int = 5,
    none_threshold: float = 0.05,
    stall_seconds: float = 0.001,
) -> dict[str, Any]:
    """The report of `records` (any order; analysed in delivery-time order).

    `fields` names the record fields that were really recorded (None: all); a field that was
    not (e.g. not logged to MLflow) is reported as unknown rather than as zero. `extra` holds
    other per-step series, such as gpu_idle_seconds: {name: [(step, value), ...]}.
    """
    if not records:
        raise TelemetryInputError("no batch records to analyse")
    known = set(LOGGABLE_FIELDS if fields is None else fields)
    if "fetch_seconds" not in known:
        raise TelemetryInputError("the records lack fetch_seconds; nothing to analyse")
    ordered = sorted(records, key=lambda r: r.time)  # stable: ties keep the given order
    n = len(ordered)
    fetch = np.array([r.fetch_seconds for r in ordered], dtype=np.float64)
    times = np.array([r.time for r in ordered], dtype=np.float64)
    steps = [r.step for r in ordered]
    sampled_every = _sampling_interval(steps)
    # When only every k-th step was logged, each record stands for the steps up to the next
    # one: scale sums by steps covered / records (1 for complete histories).
    scale = _steps_covered(steps) / n

    wall = max(float(times[-1] - (times[0] - fetch[0])), 0.0)
    wait = min(float(fetch.sum()) * scale, wall) if wall > 0 else float(fetch.sum())
    warm = min(max(warmup_steps, 0), n - 1)
    steady = ordered[warm:]
    steady_fetch = fetch[warm:]
    steady_wall = max(float(times[-1] - (times[warm] - fetch[warm])), 0.0)
    steady_wait = float(steady_fetch.sum()) * _steps_covered(steps[warm:]) / len(steady)
    steady_fraction = min(steady_wait / steady_wall, 1.0) if steady_wall > 0 else 0.0
    samples = round(sum(r.samples for r in ordered) * scale)

    report: dict[str, Any] = {
        "steps": n,
        "first_step": steps[0],
        "last_step": steps[-1],
        "sampled_every": sampled_every,
        "epochs": sorted({r.epoch for r in ordered}) if "epoch" in known else None,
        "ranks": sorted({r.rank for r in ordered}),
        "wall_seconds": wall,
        "wait_seconds": wait,
        "wait_fraction": min(wait / wall, 1.0) if wall > 0 else 0.0,
        "warmup_steps": warm,
        "steady_wait_seconds": steady_wait,
        "steady_wait_fraction": steady_fraction,
        "samples": samples if "samples" in known else None,
        "samples_per_second": samples / wall if wall > 0 and "samples" in known else None,
        "fetch_seconds": {
            "mean": float(fetch.mean()),
            "p50": float(np.percentile(fetch, 50)),
            "p95": float(np.percentile(fetch, 95)),
            "p99": float(np.percentile(fetch, 99)),
            "max": float(fetch.max()),
            "max_step": steps[int(fetch.argmax())],
        },
        "slowest": _slowest(ordered, fetch, top_k, known),
        "worker_seconds_per_batch": {
            name: (float(np.mean([getattr(r, name) for r in steady])) if name in known else None)
            for name in _WORKER_FIELDS
        },
        "step_seconds": _step_seconds(steady, sampled_every),
        "cache": _cache(ordered, known),
        "extra": {
            name: _series_summary(values) for name, values in (extra or {}).items() if values
        },
    }
    attribution = _attribute(steady, steady_fetch, known, stall_seconds)
    report["attributed_wait_seconds"] = attribution
    report["cause"] = _cause(steady_fraction, attribution, none_threshold, known)
    report["recommendations"] = _recommend(report)
    return report


def _sampling_interval(steps: Sequence[int]) -> int:
    """1 for every step; k when only every k-th step was logged (median positive gap)."""
    gaps = [b - a for a, b in pairwise(steps) if b > a]
    if not gaps:
        return 1
    return max(1, int(statistics.median(gaps)))


def _steps_covered(steps: Sequence[int]) -> int:
    """Training steps spanned by logged `steps` (a repeat or a step back after resume: 1)."""
    return 1 + sum(b - a if b > a else 1 for a, b in pairwise(steps))


def _slowest(ordered: Sequence[BatchRecord], fetch: np.ndarray, top_k: int,
             known: Collection[str]) -> list[dict[str, Any]]:
    order = sorted(range(len(ordered)), key=lambda i: (-fetch[i], i))[:top_k]
    out = []
    for i in order:
        r = ordered[i]
        row: dict[str, Any] = {"step": r.step, "epoch": r.epoch, "fetch_seconds": r.fetch_seconds}
        for name in (*_WORKER_FIELDS, "queue_depth"):
            row[name] = getattr(r, name) if name in known else None
        out.append(row)
    return out


def _step_seconds(steady: Sequence[BatchRecord], sampled_every: int) -> float | None:
    """Median time the loop spent outside next(loader) per step (its compute), if measurable."""
    if sampled_every != 1 or len(steady) < 2:
        return None
    gaps = [
        (b.time - a.time) - b.fetch_seconds
        for a, b in pairwise(steady)
        if b.step == a.step + 1
    ]
    if not gaps:
        return None
    return max(float(statistics.median(gaps)), 0.0)


def _cache(ordered: Sequence[BatchRecord], known: Collection[str]) -> dict[str, Any] | None:
    if not {"cache_hits", "cache_misses"} <= set(known):
        return None
    hits = sum(r.cache_hits for r in ordered)
    misses = sum(r.cache_misses for r in ordered)
    out: dict[str, Any] = {
        "hits": hits,
        "misses": misses,
        "hit_ratio": hits / (hits + misses) if hits + misses else None,
        "bytes_downloaded": (
            sum(r.bytes_downloaded for r in ordered) if "bytes_downloaded" in known else None
        ),
    }
    if "epoch" in known:
        first_epoch = min(r.epoch for r in ordered)
        later = [r for r in ordered if r.epoch > first_epoch]
        if later:
            later_hits = sum(r.cache_hits for r in later)
            later_total = later_hits + sum(r.cache_misses for r in later)
            out["later_epochs_hit_ratio"] = later_hits / later_total if later_total else None
    return out


def _series_summary(values: Sequence[tuple[int, float]]) -> dict[str, float]:
    array = np.array([v for _, v in values], dtype=np.float64)
    return {"count": int(array.size), "total": float(array.sum()), "mean": float(array.mean()),
            "p95": float(np.percentile(array, 95)), "max": float(array.max())}


def _attribute(steady: Sequence[BatchRecord], steady_fetch: np.ndarray, known: Collection[str],
               stall_seconds: float) -> dict[str, float]:
    """Split the steady-state waiting time between storage and decode (see module doc)."""
    storage_known = bool({"download_wait_seconds", "read_seconds"} & set(known))
    decode_known = "transform_seconds" in known
    storage = decode = unexplained = 0.0
    for record, waited in zip(steady, steady_fetch, strict=True):
        if waited <= stall_seconds:
            continue
        s = (record.download_wait_seconds + record.read_seconds) if storage_known else 0.0
        d = record.transform_seconds if decode_known else 0.0
        if s + d <= 0:
            unexplained += waited
            continue
        storage += waited * s / (s + d)
        decode += waited * d / (s + d)
    return {"storage": storage, "decode": decode, "unexplained": unexplained}


def _cause(steady_fraction: float, attribution: Mapping[str, float], none_threshold: float,
           known: Collection[str]) -> str:
    if steady_fraction < none_threshold:
        return "none"
    if not set(_WORKER_FIELDS) & set(known):
        return "unknown"
    if attribution["storage"] == attribution["decode"] == 0.0:
        return "unknown"
    return "storage" if attribution["storage"] >= attribution["decode"] else "decode"


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1000:.1f} ms"


def _recommend(report: Mapping[str, Any]) -> list[str]:
    cause = report["cause"]
    fraction = report["steady_wait_fraction"]
    per_batch = report["worker_seconds_per_batch"]
    step = report["step_seconds"]
    cache = report["cache"] or {}
    out: list[str] = []
    if cause == "none":
        out.append(
            f"The input pipeline keeps up: after warm-up the loop waited {fraction:.1%} of wall "
            "time for data. No change needed."
        )
        return out
    if cause == "unknown":
        out.append(
            f"The loop waited {fraction:.1%} of wall time for data, but no worker timings were "
            "recorded; log read/transform/download_wait seconds to find the cause."
        )
        return out
    if cause == "storage":
        download = per_batch.get("download_wait_seconds") or 0.0
        read = per_batch.get("read_seconds") or 0.0
        if download >= read:
            out.append(
                f"Storage is the bottleneck: workers waited {_ms(download)} per batch for shards "
                f"to arrive in the cache (the loop waited {fraction:.1%} of wall time). Enlarge "
                "the prefetch window so downloads start further ahead of use."
            )
            ratio = cache.get("later_epochs_hit_ratio")
            if ratio is not None and ratio < 0.9:
                out.append(
                    f"Later epochs still hit the cache only {ratio:.0%} of the time: the working "
                    "set does not fit. A bigger cache (cache_limit at least the dataset size) "
                    "makes every epoch after the first read locally."
                )
            elif ratio is None:
                out.append(
                    "If the dataset fits on local disk, a cache at least as large as the dataset "
                    "makes every epoch after the first read locally."
                )
            else:
                out.append(
                    f"Later epochs hit the cache {ratio:.0%} of the time: the waiting is the "
                    "first pass over the data."
                )
            out.append(
                "If the window is already large, the storage's bandwidth is the limit: more "
                "parallel downloads (prefetch concurrency) or storage closer to the compute."
            )
        else:
            out.append(
                f"Reading rows from local shards is slow ({_ms(read)} per batch; the loop waited "
                f"{fraction:.1%} of wall time): put the cache on local NVMe, or raise "
                "num_workers so reads overlap."
            )
        return out
    # decode
    worker = sum(v for v in per_batch.values() if v is not None)
    decode = per_batch.get("transform_seconds") or 0.0
    if step is not None and step > 1e-4:
        needed = math.ceil(worker / step) + 1
        out.append(
            f"Decode/augment is the bottleneck: {_ms(decode)} of worker time per batch while "
            f"the training step takes {_ms(step)} (the loop waited {fraction:.1%} of wall time). "
            f"Raise num_workers to at least {needed} (each worker makes one batch at a time), "
            "CPU cores permitting."
        )
    else:
        out.append(
            f"Decode/augment is the bottleneck: {_ms(decode)} of worker time per batch and the "
            f"loop consumes batches as fast as they come (the loop waited {fraction:.1%} of "
            "wall time). Raise num_workers as far as CPU cores allow."
        )
    out.append(
        "Or make the transform cheaper: decode at reduced size (JPEG draft mode), crop "
        "before resizing, move augmentations to the GPU."
    )
    return out


# -- text ---------------------------------------------------------------------------------------
def _fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1000:.1f} ms"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"  # pragma: no cover


def render_text(report: Mapping[str, Any], *, title: str | None = None) -> str:
    """A plain-text table of `report` (from `analyse`)."""
    f = report["fetch_seconds"]
    lines = []
    if title:
        lines.append(title)
        lines.append("=" * len(title))
    sampled = f" (every {report['sampled_every']}th step logged)" if report["sampled_every"] > 1 else ""
    lines.append(f"steps              {report['steps']:,} (step {report['first_step']} .. "
                 f"{report['last_step']}){sampled}")
    if report.get("epochs"):
        lines.append(f"epochs             {', '.join(map(str, report['epochs']))}")
    lines.append(f"wall time          {_fmt_seconds(report['wall_seconds'])}")
    lines.append(f"waiting for data   {_fmt_seconds(report['wait_seconds'])} "
                 f"({report['wait_fraction']:.1%} of wall time; "
                 f"{report['steady_wait_fraction']:.1%} after {report['warmup_steps']} warm-up "
                 f"step{'s' if report['warmup_steps'] != 1 else ''})")
    if report.get("samples_per_second") is not None:
        lines.append(f"samples/s          {report['samples_per_second']:,.1f}")
    lines.append(f"fetch_seconds      p50 {_fmt_seconds(f['p50'])}   p95 {_fmt_seconds(f['p95'])}"
                 f"   p99 {_fmt_seconds(f['p99'])}   max {_fmt_seconds(f['max'])} "
                 f"(step {f['max_step']})")
    w = report["worker_seconds_per_batch"]
    lines.append(f"worker time/batch  read {_fmt_seconds(w['read_seconds'])}   decode "
                 f"{_fmt_seconds(w['transform_seconds'])}   download wait "
                 f"{_fmt_seconds(w['download_wait_seconds'])}")
    if report.get("step_seconds") is not None:
        lines.append(f"training step      {_fmt_seconds(report['step_seconds'])} (median, outside "
                     "next(loader))")
    cache = report.get("cache")
    if cache and cache["hits"] + cache["misses"]:
        text = (f"cache              {cache['hits']:,} hits, {cache['misses']:,} misses "
                f"({cache['hit_ratio']:.1%} hit ratio)")
        if cache.get("bytes_downloaded"):
            text += f", {_fmt_bytes(cache['bytes_downloaded'])} downloaded"
        lines.append(text)
    for name, s in report.get("extra", {}).items():
        lines.append(f"{name:<18} total {_fmt_seconds(s['total'])}   mean {_fmt_seconds(s['mean'])}"
                     f"   p95 {_fmt_seconds(s['p95'])}   max {_fmt_seconds(s['max'])}")
    lines.append("")
    lines.append("slowest batches")
    lines.append(f"  {'step':>8} {'epoch':>5} {'fetch':>10} {'dl wait':>10} {'read':>10} "
                 f"{'decode':>10} {'queue':>5}")
    for row in report["slowest"]:
        queue = "?" if row["queue_depth"] is None else str(row["queue_depth"])
        lines.append(
            f"  {row['step']:>8} {row['epoch']:>5} {_fmt_seconds(row['fetch_seconds']):>10} "
            f"{_fmt_seconds(row['download_wait_seconds']):>10} "
            f"{_fmt_seconds(row['read_seconds']):>10} "
            f"{_fmt_seconds(row['transform_seconds']):>10} {queue:>5}"
        )
    a = report["attributed_wait_seconds"]
    lines.append("")
    lines.append(f"waiting attributed storage {_fmt_seconds(a['storage'])}   decode "
                 f"{_fmt_seconds(a['decode'])}   unexplained {_fmt_seconds(a['unexplained'])}")
    lines.append(f"dominant cause     {report['cause']}")
    lines.append("recommendations")
    for text in report["recommendations"]:
        lines.append(f"  - {text}")
    return "\n".join(lines) + "\n"


# -- plot ---------------------------------------------------------------------------------------
def plot(records: Sequence[BatchRecord], path: str | os.PathLike[str],
         *, title: str | None = None, dpi: int = 80) -> str:
    """Write a PNG: fetch_seconds over steps (left) and its histogram (right). Returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not records:
        raise TelemetryInputError("no batch records to plot")
    ordered = sorted(records, key=lambda r: r.time)
    steps = np.array([r.step for r in ordered])
    fetch = np.array([r.fetch_seconds for r in ordered], dtype=np.float64) * 1000.0
    fig = Figure(figsize=(10, 3.6), dpi=dpi)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    left.plot(steps, fetch, linewidth=0.7, color="tab:blue")
    epochs = [r.epoch for r in ordered]
    for i in range(1, len(ordered)):
        if epochs[i] != epochs[i - 1]:  # epoch boundary
            left.axvline(steps[i], color="grey", linestyle=":", linewidth=0.8)
    p95 = float(np.percentile(fetch, 95))
    left.axhline(p95, color="tab:red", linestyle="--", linewidth=0.8, label=f"p95 {p95:.1f} ms")
    left.set_xlabel("step")
    left.set_ylabel("fetch_seconds (ms)")
    left.set_title("time waiting in next(loader)")
    positive = fetch[fetch > 0]
    if positive.size and positive.max() / max(positive.min(), 1e-6) > 100:
        left.set_yscale("log")
        bins = np.logspace(np.log10(max(positive.min(), 1e-3)), np.log10(positive.max()), 40)
        right.set_xscale("log")
        right.hist(np.clip(fetch, bins[0], None), bins=bins, color="tab:blue")
    else:
        right.hist(fetch, bins=40, color="tab:blue")
    left.legend(loc="upper right", fontsize="small")
    right.set_xlabel("fetch_seconds (ms)")
    right.set_ylabel("batches")
    right.set_title("histogram")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, format="png")
    return path


# -- loading ------------------------------------------------------------------------------------
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
        history = client.get_metric_history(run_id, f"{prefix}{name}{suffix}")
        if history:
            histories[name] = history
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
        for name in LOGGABLE_FIELDS:
            value = values.get(name, 0.0)
            data[name] = int(value) if name in _INT_FIELDS else float(value)
        records.append(BatchRecord.from_dict(data, where=f"MLflow run {run_id} step {step}"))
    extra = {}
    for name in extra_metrics:
        history = client.get_metric_history(run_id, f"{name}{suffix}")
        if history:
            extra[name] = [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)]
    return records, set(histories), extra


_INT_FIELDS = frozenset({"epoch", "samples", "queue_depth", "cache_hits", "cache_misses",
                         "bytes_downloaded", "padded"})
