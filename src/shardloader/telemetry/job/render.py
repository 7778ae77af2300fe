"""A job's accounting as text, and its attempts as a timeline picture.

`render_job_text(report)` lays out the report object of `shardloader.telemetry.job.account`:
where the job's wall time went (per kind, with money when the report carries prices), its
attempts, samples, bytes and requests, the data wait by rank, and a diagnosis: the largest
badput kind and what to change for it. `plot_job(report, path)` draws one bar per attempt on
the job's time axis. The records hold each attempt's totals, not a per-second timeline, so a
bar's segments are the attempt's seconds per kind laid end to end: true in proportion, not in
order of occurrence.
"""

from __future__ import annotations

import os
import textwrap
from collections import Counter
from collections.abc import Mapping
from typing import Any

from shardloader.telemetry.job.endings import ENDINGS, FINISHED, PREEMPTED_SAVED
from shardloader.telemetry.job.sources import source_lines
from shardloader.telemetry.records import TelemetryInputError
from shardloader.telemetry.render import _fmt_bytes, _fmt_seconds

#: The job's seconds kinds, in the order of the table; they add up to the wall time.
KINDS = ("productive", "data_wait", "checkpoint", "restore", "startup", "lost_progress",
         "between_attempts", "other")
LABELS = {k: k.replace("_", " ") for k in KINDS}
#: A bar's segments, left to right, and their colours (step time: productive, then lost).
SEGMENTS = ("startup", "restore", "productive", "lost_progress", "data_wait", "checkpoint", "other")
COLOURS = {"startup": "tab:purple", "restore": "tab:brown", "productive": "tab:green",
           "lost_progress": "tab:red", "data_wait": "tab:orange", "checkpoint": "tab:blue",
           "other": "silver"}
#: The mark at the end of an attempt's bar, by its ending (finished: none).
ENDING_MARKS = {"preempted_saved": ("v", "tab:green"), "preempted_lost": ("v", "tab:red"),
                "killed": ("x", "black"), "failed": ("x", "tab:red"), "hung": ("s", "tab:red")}


def _fmt_money(amount: float) -> str:
    return f"{amount:,.2f}" if abs(amount) >= 1 or amount == 0 else f"{amount:.4f}"


def _percent(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole > 0 else "-"


def render_job_text(report: Mapping[str, Any]) -> str:
    """A plain-text account of the job in `report` (from `account`)."""
    wall, seconds, attempts = report["wall_seconds"], report["seconds"], report["attempts"]
    title = f"job {report['job']['name']} ({report['job']['job_id']})"
    endings = Counter(a["ended"] for a in attempts)
    how = ", ".join(f"{endings[e]} {e.replace('_', ' ')}" for e in ENDINGS if endings[e])
    lines = [title, "=" * len(title),
             f"attempts           {len(attempts)}" + (f" ({how})" if how else ""),
             f"wall time          {_fmt_seconds(wall)}",
             f"goodput            {report['goodput']:.1%} ({_fmt_seconds(seconds['productive'])} "
             "productive)"]
    lineage = report.get("lineage") or {}
    if lineage.get("complete") is False:
        lines.append("lineage            incomplete: a restored checkpoint was not committed by "
                     "this job's attempts; samples are counted as far as known")
    cost = report.get("cost")
    money = (cost or {}).get("compute") or {}

    def row(label: str, secs: float, amount: float | None) -> str:
        cell = "" if not cost else f" {'-' if amount is None else _fmt_money(amount):>10}"
        return f"  {label:<17} {_fmt_seconds(secs):>12} {_percent(secs, wall):>8}{cell}"

    lines += ["", f"where the time went {'seconds':>12} {'% wall':>8}" + (f" {'cost':>10}" if cost else "")]
    lines += [row(LABELS[k], seconds[k], money.get(k)) for k in KINDS]
    lines.append(row("total", sum(seconds[k] for k in KINDS), sum(money.values())))
    if cost:
        prices = ", ".join(f"{k}={v:g}" for k, v in (cost.get("prices") or {}).items())
        lines += ["cost               " + "   ".join(f"{k} {_fmt_money(cost[k])}" for k in
                                                     ("total", "badput", "egress", "requests") if k in cost),
                  f"prices             {prices}" + (f" ({cost['currency_note']})" if cost.get("currency_note") else "")]
    lines += ["", "attempts"] + _attempt_rows(attempts)
    steps, samples = report["steps"], report["samples"]
    b, r = report["bytes"], report["requests"]
    lines += [
        "",
        f"steps              trained {steps['trained']:,}   recomputed {steps['recomputed']:,}   "
        f"lost {steps['lost']:,}",
        f"samples            trained {samples['trained']:,}   recomputed {samples['recomputed']:,}   "
        f"trained twice {samples['trained_twice']:,}   never trained {samples['never_trained']:,}",
        f"bytes              remote read {_fmt_bytes(b['remote_read'])}   cache hits "
        f"{_fmt_bytes(b['cache_hits'])}   redownloaded {_fmt_bytes(b['redownloaded'])}",
        f"                   checkpoint written {_fmt_bytes(b['checkpoint_written'])}   cache peak "
        f"{_fmt_bytes(b['cache_peak'])}",
        f"requests           shard downloads {r['shard_downloads']:,}   range requests "
        f"{r['range_requests']:,}   checkpoint files {r['checkpoint_files']:,}",
        *source_lines(report.get("sources") or {}, _fmt_bytes),
        "",
    ]
    lines += _data_wait_lines(report["data_wait"])
    lines += ["", "diagnosis"] + [textwrap.fill(text, 100, initial_indent="  - ",
                                                subsequent_indent="    ") for text in diagnose(report)]
    return "\n".join(lines) + "\n"


def _attempt_rows(attempts: list[Mapping[str, Any]]) -> list[str]:
    width = max([len(a["id"]) for a in attempts] + [2])
    rows = [f"  {'id':<{width}} {'ended':<15} {'steps':>13} {'lost':>6} {'wall':>10} "
            f"{'data wait':>10} {'startup':>10}"]
    for a in attempts:
        span = f"{a['first_step']}..{a['last_step']}" if a["steps"] else "-"
        rows.append(f"  {a['id']:<{width}} {a['ended']:<15} {span:>13} {a['lost_steps']:>6} "
                    f"{_fmt_seconds(a['wall_seconds']):>10} "
                    f"{_fmt_seconds(a['seconds']['data_wait']):>10} "
                    f"{_fmt_seconds(a['seconds']['startup']):>10}")
    rows += [f"  {a['id']} {a['ended'].replace('_', ' ')}: {_why(a)}" for a in attempts
             if a["ended"] != FINISHED and _why(a)]
    return rows


def _why(a: Mapping[str, Any]) -> str | None:
    """An attempt's reason for its ending (reports made before reasons: its error)."""
    return a.get("reason") or a.get("error")


def _per_rank(data_wait: Mapping[str, Any]) -> dict[int, float]:
    """Rank -> seconds; the keys are ints in the report object, strings after a JSON trip."""
    return {int(k): float(v) for k, v in sorted(data_wait["per_rank"].items(), key=lambda kv: int(kv[0]))}


def _data_wait_lines(data_wait: Mapping[str, Any]) -> list[str]:
    per_rank = _per_rank(data_wait)
    lines = [f"data wait by rank  mean {_fmt_seconds(data_wait['mean'])}   max "
             f"{_fmt_seconds(data_wait['max'])} (rank {data_wait['max_rank']})"]
    if len(per_rank) > 1:
        lines += [f"  rank {rank:<5} {_fmt_seconds(s):>10}" for rank, s in list(per_rank.items())[:16]]
        if len(per_rank) > 16:
            lines.append(f"  ... {len(per_rank) - 16} more ranks")
        for e in data_wait.get("epochs") or []:
            lines.append(f"  epoch {e['epoch']:<4} rank {e['max_rank']} waited most: "
                         f"{_fmt_seconds(e['max_seconds'])} (mean {_fmt_seconds(e['mean_seconds'])})")
    return lines


def diagnose(report: Mapping[str, Any]) -> list[str]:
    """The largest badput kind (anything but productive), and what to change for it."""
    seconds, wall = report["seconds"], report["wall_seconds"]
    kind = max((k for k in KINDS if k != "productive"), key=lambda k: seconds[k])
    if seconds[kind] <= 0:
        return ["No badput: every second of the job was productive step time."]
    head = (f"The largest badput is {LABELS[kind]}: {_fmt_seconds(seconds[kind])} "
            f"({_percent(seconds[kind], wall)} of wall time")
    money = ((report.get("cost") or {}).get("compute") or {}).get(kind)
    head += f", cost {_fmt_money(money)})." if money is not None else ")."
    return [head, _advice(kind, report)]


def _lost_advice(report: Mapping[str, Any]) -> str:
    attempts = report["attempts"]
    hit = [a for a in attempts if a["lost_steps"] > 0 or a["seconds"]["lost_progress"] > 0]
    lost_s = sum(a["seconds"]["lost_progress"] for a in hit) / len(hit)
    lost_steps = sum(a["lost_steps"] for a in hit) / len(hit)
    steps = sum(a["steps"] for a in attempts)
    step_time = sum(a["seconds"]["productive"] + a["seconds"]["lost_progress"] for a in attempts)
    per_step = step_time / steps if steps else 0.0
    who = f"Each of the {len(hit)} interrupted attempts" if len(hit) > 1 else "The interrupted attempt"
    text = (f"{who} lost {_fmt_seconds(lost_s)} of steps{' on average' if len(hit) > 1 else ''} "
            f"({lost_steps:.1f} steps of {_fmt_seconds(per_step)}) after its last committed checkpoint.")
    if lost_steps < 2:
        return text + (" Saves are already about as frequent as steps: the loss is the number "
                       "of interruptions; find why the attempts ended.")
    every = max(1, int(lost_steps // 4))
    return text + (f" Saving every {every} step{'s' if every != 1 else ''} instead would bound "
                   f"it to about {_fmt_seconds(every * per_step)} per interruption. More saves "
                   "block more (checkpoint time so far "
                   f"{_fmt_seconds(report['seconds']['checkpoint'])}): that stays small while a "
                   "save blocks only for its copy into staging.")


def _data_wait_advice(report: Mapping[str, Any]) -> str:
    dw, b = report["data_wait"], report["bytes"]
    text = (f"The loop waited in next(loader) {_fmt_seconds(report['seconds']['data_wait'])}: "
            "raise num_workers (decode) or prefetch_factor, and give the node cache room for the "
            f"data (cache_limit) so later epochs and restarts read locally ("
            f"{_fmt_bytes(b['remote_read'])} read remotely, {_fmt_bytes(b['cache_hits'])} from "
            "the cache). `shardloader report` on an attempt's telemetry names the cause.")
    per_rank = _per_rank(dw)
    low = min(per_rank.values(), default=0.0)
    if len(per_rank) > 1 and dw["max"] > 0 and dw["max"] > 1.2 * low:
        slowest = dw["max_rank"]
        epochs = dw.get("epochs") or []
        most = sum(1 for e in epochs if e["max_rank"] == slowest)
        text += (f" Rank {slowest} waited most ({_fmt_seconds(dw['max'])} against "
                 f"{_fmt_seconds(low)} for the least"
                 + (f"; the most in {most} of {len(epochs)} epochs" if epochs else "")
                 + "): the other ranks wait for it at every collective, so look at its node "
                   "first (disk, network, cache, CPU).")
    return text


def _gaps(report: Mapping[str, Any]) -> list[float]:
    attempts = report["attempts"]
    return [max(0.0, b["start"] - a["end"]) for a, b in zip(attempts, attempts[1:], strict=False)]


def _advice(kind: str, report: Mapping[str, Any]) -> str:
    """What to change for badput `kind`."""
    if kind == "lost_progress":
        return _lost_advice(report)
    if kind == "data_wait":
        return _data_wait_advice(report)
    took, n = _fmt_seconds(report["seconds"][kind]), len(report["attempts"])
    if kind == "checkpoint":
        return (f"Saves blocked the loop for {took}: a save blocks for its copy into staging and, "
                "with on_busy='wait', for the save still in flight. Use on_busy='skip' to drop a "
                "save rather than wait, put staging_dir on local NVMe, or save less often.")
    if kind == "restore":
        restores = sum(1 for a in report["attempts"] if a.get("restored_step") is not None)
        return (f"Loading checkpoints took {took} over {restores} restore"
                f"{'s' if restores != 1 else ''}: keep checkpoints on storage close to the nodes, "
                "or make the state smaller (what the model and optimizer save).")
    if kind == "startup":
        return (f"Launch to first batch took {_fmt_seconds(report['seconds'][kind] / max(n, 1))} "
                f"per attempt ({took} over {n}): imports, opening the dataset, starting workers "
                "and priming the cache. Keep the node cache (cache_dir) across restarts so a "
                "restart reads no shard again, start fewer workers, import heavy modules lazily.")
    if kind == "between_attempts":
        return (f"{took} passed between attempts (longest gap "
                f"{_fmt_seconds(max(_gaps(report), default=0.0))}): the scheduler's or launcher's "
                "restart delay (requeue, node allocation, image pull). Relaunch in place (torchrun "
                "--max-restarts) or shorten the requeue delay.")
    return (f"{took} went to none of the measured parts (steps, next(loader), saves, restores, "
            "start-up): the user's code outside the loop (evaluation, logging, teardown after "
            "the last step).")


def plot_job(report: Mapping[str, Any], path: str | os.PathLike[str], *, dpi: int = 80) -> str:
    """Write a PNG timeline of the job's attempts (see the module doc). Returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    attempts = report["attempts"]
    if not attempts:
        raise TelemetryInputError("the job has no attempts to plot")
    origin = min(a["start"] for a in attempts)
    fig = Figure(figsize=(10, 2.0 + 0.55 * len(attempts)), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for row, a in enumerate(attempts):
        x = a["start"] - origin
        for kind in SEGMENTS:
            width = max(0.0, a["seconds"].get(kind, 0.0))
            if width > 0:
                ax.barh(row, width, left=x, height=0.6, color=COLOURS[kind],
                        hatch="//" if kind == "lost_progress" else None, edgecolor="white",
                        linewidth=0.5)
            x += width
        if a["ended"] in ENDING_MARKS:
            end, (marker, colour) = a["end"] - origin, ENDING_MARKS[a["ended"]]
            ax.plot(end, row, marker=marker, color=colour, markersize=10, markeredgewidth=2)
            label = a["ended"].replace("_", ", ")
            if a["ended"] != PREEMPTED_SAVED or a["lost_steps"]:
                label += f" ({a['lost_steps']} steps lost)"
            ax.annotate(label, (end, row), xytext=(6, 6), textcoords="offset points",
                        fontsize="small", color=colour)
    for row, gap in enumerate(_gaps(report)):
        if gap > 0:
            left = attempts[row]["end"] - origin
            ax.plot([left, left + gap], [row + 0.5, row + 0.5], color="grey", linestyle=":")
            ax.annotate(f"gap {_fmt_seconds(gap)}", (left + gap / 2, row + 0.5), xytext=(0, 3),
                        textcoords="offset points", ha="center", va="bottom", fontsize="x-small",
                        color="grey")
    ax.set_yticks(range(len(attempts)),
                  [f"#{i + 1} {a['id']}" for i, a in enumerate(attempts)], fontsize="small")
    ax.set_ylim(len(attempts) - 0.4, -0.6)  # the first attempt on top
    ax.set_xlim(0, max(report["wall_seconds"], max(a["end"] for a in attempts) - origin) * 1.08)
    ax.set_xlabel("seconds since the job's start (a bar: its attempt's seconds per kind, in proportion)")
    fig.legend(handles=[Patch(facecolor=COLOURS[k], hatch="//" if k == "lost_progress" else None,
                              label=LABELS[k]) for k in SEGMENTS],
               loc="lower center", ncol=len(SEGMENTS), fontsize="small", frameon=False)
    ax.set_title(f"job {report['job']['name']}: goodput {report['goodput']:.1%} "
                 f"({len(attempts)} attempts, wall {_fmt_seconds(report['wall_seconds'])})",
                 fontsize="medium")
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))  # room for the legend
    path = os.fspath(path)
    fig.savefig(path, format="png")
    return path
