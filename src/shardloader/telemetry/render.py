"""A report as text, and a run's fetch_seconds as a picture.

`render_text(report)` formats a report of `shardloader.telemetry.analysis.analyse` as a
plain-text table; `plot(records, path)` draws fetch_seconds over steps and its histogram
(matplotlib's Agg canvas, no display needed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardloader.telemetry.records import BatchRecord, TelemetryInputError


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
    lines.append(f"waiting for data   {_fmt_seconds(report['data_wait_seconds'])} "
                 f"({report['data_wait_fraction']:.1%} of wall time; "
                 f"{report['steady_data_wait_fraction']:.1%} after {report['warmup_steps']} warm-up "
                 f"step{'s' if report['warmup_steps'] != 1 else ''})")
    if report.get("samples_per_second") is not None:
        lines.append(f"samples/s          {report['samples_per_second']:,.1f}")
    lines.append(f"fetch_seconds      p50 {_fmt_seconds(f['p50'])}   p95 {_fmt_seconds(f['p95'])}"
                 f"   p99 {_fmt_seconds(f['p99'])}   max {_fmt_seconds(f['max'])} "
                 f"(step {f['max_step']})")
    w = report["worker_seconds_per_batch"]
    lines.append(f"worker time/batch  read {_fmt_seconds(w['read_seconds'])}   decode "
                 f"{_fmt_seconds(w['transform_seconds'])}   shard wait "
                 f"{_fmt_seconds(w['shard_wait_seconds'])}")
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
    lines.append(f"  {'step':>8} {'epoch':>5} {'fetch':>10} {'shard wait':>10} {'read':>10} "
                 f"{'decode':>10} {'queue':>5}")
    for row in report["slowest"]:
        queue = "?" if row["queue_depth"] is None else str(row["queue_depth"])
        lines.append(
            f"  {row['step']:>8} {row['epoch']:>5} {_fmt_seconds(row['fetch_seconds']):>10} "
            f"{_fmt_seconds(row['shard_wait_seconds']):>10} "
            f"{_fmt_seconds(row['read_seconds']):>10} "
            f"{_fmt_seconds(row['transform_seconds']):>10} {queue:>5}"
        )
    a = report["attributed_data_wait_seconds"]
    lines.append("")
    lines.append(f"waiting attributed storage {_fmt_seconds(a['storage'])}   decode "
                 f"{_fmt_seconds(a['decode'])}   unexplained {_fmt_seconds(a['unexplained'])}")
    lines.append(f"dominant cause     {report['cause']}")
    lines.append("recommendations")
    for text in report["recommendations"]:
        lines.append(f"  - {text}")
    return "\n".join(lines) + "\n"


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

