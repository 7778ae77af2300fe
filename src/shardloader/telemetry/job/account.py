"""The job's account (I15): where every second, sample and byte of all its attempts went.

`account(records)` turns what `read_job` returns (each attempt's ranks: final counters and event
log) into the job contract's report; pure: no I/O, no clock. Seconds are accounted per rank over
its attempt's span, an attempt's figure of each kind the mean over its ranks: an attempt's kinds
add up to its wall time, the job's (with the gaps between attempts) to the job's.

Progress is real only once a checkpoint holding it is committed: an attempt's *mark* is its last
committed save, and step time after the mark is lost progress (unless the attempt finished the
job). Which samples entered the final weights twice or never is counted from the recorded
cursors: the final attempt's contiguous segments, then, through each restore, the segments of
the attempt that committed the restored checkpoint up to that save, swept as intervals (never a
per-position array: positions can number 10^9).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardloader.telemetry.job.endings import ENDINGS, attempt_ending
from shardloader.telemetry.job.prices import SECOND_KINDS, cost
from shardloader.telemetry.job.sources import parse_sources, sources_total

#: An attempt's kinds of seconds (the job's less the gaps between attempts).
ATTEMPT_KINDS = tuple(k for k in SECOND_KINDS if k != "between_attempts")
#: Report byte key -> counter summed over ranks (cache_peak is a max, apart).
_BYTES = {"remote_read": "bytes_remote", "cache_hits": "bytes_from_cache",
          "redownloaded": "bytes_redownloaded", "checkpoint_written": "checkpoint_bytes"}  # fmt: skip
#: Report request key -> counter summed over ranks.
_REQUESTS = {"shard_downloads": "downloads", "range_requests": "range_requests",
             "checkpoint_files": "checkpoint_files"}  # fmt: skip
_SECONDS = (
    "launch_time", "heartbeat_time", "first_batch_time", "blocked_before_first",
    "data_wait_seconds", "step_seconds", "checkpoint_seconds", "restore_seconds", "epoch_data_wait",
)  # fmt: skip
_COUNTS = (
    "steps", "positions", "segment_start", "cursor", "epoch", "cache_peak",
    *_BYTES.values(), *_REQUESTS.values(),
)  # fmt: skip
_EVENT_FIELDS: dict[str, dict[str, Any]] = {
    "restore": {"step": "count", "checkpoint": "str", "cursor": "cursor?"},
    "save": {
        "step": "count", "checkpoint": "str", "cursor": "cursor?", "steps": "count",
        "step_seconds": "seconds", "positions": "count",
    },
    "committed": {"step": "count", "checkpoint": "str"},
    "epoch": {"epoch": "count", "data_wait_seconds": "seconds"},
    "segment": {"from_cursor": "count", "to_cursor": "count"},
    "end": {"how": "how", "error": "str?"},
}  # fmt: skip


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _integer(where: str, value: Any, low: int) -> int:
    number = _number(where, value)
    if not number.is_integer() or number < low:
        raise ValueError(f"{where}: expected an integer >= {low}, got {value!r}")
    return int(number)


def _field(where: str, kind: str, value: Any) -> Any:
    """`value` checked as `kind` (see `_EVENT_FIELDS`); a ValueError says `where` it failed."""
    if kind.endswith("?") and value is None:
        return None
    kind = kind.rstrip("?")
    if kind in ("seconds", "count", "cursor"):
        return _number(where, value) if kind == "seconds" else _integer(where, value, 0)
    if kind == "how" and value not in ENDINGS:
        raise ValueError(f"{where}: expected one of {ENDINGS}, got {value!r}")
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True)
class Save:
    """A `save` event: the attempt's progress captured in checkpoint `checkpoint`."""

    checkpoint: str
    step: int
    cursor: int | None  # None: a save without a loader
    steps: int
    step_seconds: float
    positions: int


@dataclass
class Rank:
    """One rank of one attempt: validated counters and what its events say."""

    rank: int
    c: dict[str, float | int]
    end_time: float | None = None
    how: str | None = None
    error: str | None = None
    end_fields: dict[str, Any] = field(default_factory=dict)  # the end event's other fields
    saves: dict[str, Save] = field(default_factory=dict)
    committed: dict[str, tuple[int, float]] = field(default_factory=dict)  # id -> (step, time)
    restore: dict[str, Any] | None = None  # the last restore event
    epoch_wait: dict[int, float] = field(default_factory=dict)
    segments: list[tuple[int, int]] = field(default_factory=list)  # finished, in order
    sources: dict[str, dict[str, float]] = field(default_factory=dict)  # its last "sources" event


def _events(rank: Rank, where: str, events: Any) -> None:
    if not isinstance(events, Sequence) or isinstance(events, (str, bytes)):
        raise ValueError(f"{where}: events: expected a list, got {type(events).__name__}")
    for i, raw in enumerate(events):
        at = f"{where}: event {i}"
        if not isinstance(raw, Mapping):
            raise ValueError(f"{at}: expected an object, got {type(raw).__name__}")
        kind = _field(f"{at}: field 'event'", "str", raw.get("event"))
        at = f"{at} ({kind})"
        if "time" not in raw:
            raise ValueError(f"{at}: field 'time' missing")
        time = _number(f"{at}: field 'time'", raw["time"])
        spec = _EVENT_FIELDS.get(kind)
        if kind == "sources":  # a mixture's running totals per source (sources.py)
            rank.sources = parse_sources(at, raw.get("figures"))
        if spec is None:
            continue  # start and events unknown here carry nothing the account needs
        ev: dict[str, Any] = {}
        for name, fkind in spec.items():
            if name not in raw:
                raise ValueError(f"{at}: field {name!r} missing")
            ev[name] = _field(f"{at}: field {name!r}", fkind, raw[name])
        if kind == "save":
            rank.saves[ev["checkpoint"]] = Save(**ev)
        elif kind == "committed":
            rank.committed[ev["checkpoint"]] = (ev["step"], time)
        elif kind == "restore":
            rank.restore = ev
        elif kind == "epoch":
            rank.epoch_wait[ev["epoch"]] = (
                rank.epoch_wait.get(ev["epoch"], 0.0) + ev["data_wait_seconds"]
            )
        elif kind == "segment":
            if ev["to_cursor"] < ev["from_cursor"]:
                raise ValueError(f"{at}: to_cursor {ev['to_cursor']} < from_cursor")
            rank.segments.append((ev["from_cursor"], ev["to_cursor"]))
        else:
            rank.end_time, rank.how, rank.error = time, ev["how"], ev["error"]
            rank.end_fields = {k: raw[k] for k in ("rank", "signal") if isinstance(raw.get(k), (int, str))}


def parse_rank(attempt_id: str, rank: Any, raw: Any) -> Rank:
    """One rank's record, validated: a ValueError names the attempt, rank and field."""
    where = f"attempt {attempt_id!r} rank {rank!r}"
    if isinstance(rank, str) and rank.isdigit():
        rank = int(rank)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"{where}: rank must be an integer >= 0")
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(raw).__name__}")
    for key in ("counters", "events"):
        if key not in raw:
            raise ValueError(f"{where}: {key!r} missing")
    counters = raw["counters"]
    if not isinstance(counters, Mapping):
        raise ValueError(f"{where}: counters: expected an object, got {type(counters).__name__}")
    c: dict[str, float | int] = {}
    for key in (*_SECONDS, *_COUNTS):
        if key not in counters:
            raise ValueError(f"{where}: counters.{key} missing")
        low = -1 if key in ("segment_start", "cursor", "epoch") else 0
        check = _number if key in _SECONDS else (lambda w, v, lo=low: _integer(w, v, lo))
        c[key] = check(f"{where}: counters.{key}", counters[key])
    out = Rank(rank, c)
    _events(out, where, raw["events"])
    return out


@dataclass
class Attempt:
    """One attempt, its ranks parsed, with its span and how it ended."""

    id: str
    ranks: list[Rank]  # by rank
    start: float = 0.0
    end: float = 0.0
    ended: str = "killed"
    error: str | None = None
    reason: str | None = None  # why it ended, in words (`endings.attempt_ending`)


def parse_attempt(raw: Any, index: int, running: str | None) -> Attempt:
    """The `index`th attempt of the records, validated, its span and ending resolved."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"attempt {index}: expected an object, got {type(raw).__name__}")
    aid = raw.get("id")
    if not isinstance(aid, str) or not aid:
        raise ValueError(f"attempt {index}: field 'id' missing or not a string: {aid!r}")
    ranks = raw.get("ranks")
    if not isinstance(ranks, Mapping) or not ranks:
        raise ValueError(f"attempt {aid!r}: field 'ranks' missing or empty")
    parsed = sorted((parse_rank(aid, r, v) for r, v in ranks.items()), key=lambda x: x.rank)
    if len({r.rank for r in parsed}) != len(parsed):
        raise ValueError(f"attempt {aid!r}: a rank is given twice")
    a = Attempt(aid, parsed, start=min(r.c["launch_time"] for r in parsed))
    if aid == running:
        a.end, a.ended = max(r.c["heartbeat_time"] for r in parsed), "finished"
        return a
    a.end = max(r.c["heartbeat_time"] if r.end_time is None else r.end_time for r in parsed)
    a.ended, a.error, a.reason = attempt_ending(parsed)
    return a


def parse_records(records: Any, running: str | None) -> tuple[dict[str, str], list[Attempt]]:
    """The job's identity and its attempts sorted by start, or a ValueError saying what's wrong."""
    if not isinstance(records, Mapping):
        raise ValueError(f"job records: expected an object, got {type(records).__name__}")
    job = records.get("job")
    if not isinstance(job, Mapping):
        raise ValueError("job records: 'job' missing or not an object")
    ident = {k: _field(f"job: field {k!r}", "str", job.get(k)) for k in ("job_id", "name")}
    raw = records.get("attempts")
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or not raw:
        raise ValueError("job records: 'attempts' missing, not a list, or empty")
    attempts = [parse_attempt(a, i, running) for i, a in enumerate(raw)]
    ids = [a.id for a in attempts]
    if len(set(ids)) != len(ids):
        raise ValueError("job records: an attempt id is given twice")
    if running is not None and running not in ids:
        raise ValueError(f"running attempt {running!r} is not in the job's records")
    return ident, sorted(attempts, key=lambda a: (a.start, a.id))


def marks(a: Attempt, proven: set[str]) -> tuple[int | None, dict[int, Save | None]]:
    """The attempt's last committed step and each rank's save of that checkpoint.

    The mark is the committed checkpoint of the highest step whose `save` event is known.
    Committed: a rank logged `committed`, or the checkpoint is in `proven` (a later attempt
    restored it: a kill between the commit and its event loses only the event). A rank that did
    not log that save uses the lowest rank's that did.
    """
    committed: dict[str, tuple[int, float]] = {}
    for r in a.ranks:
        for ckpt, key in r.committed.items():
            committed[ckpt] = max(key, committed.get(ckpt, key))
        for ckpt in proven & r.saves.keys():
            committed.setdefault(ckpt, (r.saves[ckpt].step, -math.inf))
    known = [
        (key, ckpt) for ckpt, key in committed.items() if any(ckpt in r.saves for r in a.ranks)
    ]
    if not known:
        return None, {r.rank: None for r in a.ranks}
    (step, _), ckpt = max(known)
    fallback = next(r.saves[ckpt] for r in a.ranks if ckpt in r.saves)
    return step, {r.rank: r.saves.get(ckpt, fallback) for r in a.ranks}


def rank_seconds(
    r: Rank, start: float, span: float, mark: Save | None, all_productive: bool
) -> dict[str, float]:
    """One rank's seconds of each kind over its attempt's span; `other` closes the sum."""
    c = r.c
    s = {"data_wait": c["data_wait_seconds"], "checkpoint": c["checkpoint_seconds"]}
    s["restore"] = c["restore_seconds"]
    if c["first_batch_time"] > 0:
        s["startup"] = c["first_batch_time"] - start - c["blocked_before_first"]
    else:
        s["startup"] = span - s["restore"] - s["checkpoint"]
    step = float(c["step_seconds"])
    kept = step if all_productive else (mark.step_seconds if mark else 0.0)
    s["productive"], s["lost_progress"] = kept, step - kept
    s["other"] = span - sum(s.values())
    return {k: float(s[k]) for k in ATTEMPT_KINDS}


def restore_of(a: Attempt) -> dict[str, Any] | None:
    """The attempt's restore (the lowest rank's that logged one; its last), or None."""
    return next((r.restore for r in a.ranks if r.restore is not None), None)


def attempt_report(a: Attempt, is_last: bool, proven: set[str]) -> dict[str, Any]:
    """The report's entry of one attempt (the contract's `attempts[i]`).

    `proven`: checkpoints that later attempts restored (committed, whatever the events say).
    """
    step, saves = marks(a, proven)
    all_productive = is_last and a.ended == "finished"
    span = a.end - a.start
    per_rank = [rank_seconds(r, a.start, span, saves[r.rank], all_productive) for r in a.ranks]
    n = len(a.ranks)
    seconds = {k: sum(s[k] for s in per_rank) / n for k in ATTEMPT_KINDS}
    steps = max(int(r.c["steps"]) for r in a.ranks)
    positions = max(int(r.c["positions"]) for r in a.ranks)
    lost = recomputed = 0
    if not all_productive:
        lost = max(
            int(r.c["steps"]) - (saves[r.rank].steps if saves[r.rank] else 0) for r in a.ranks
        )
        if not is_last:
            recomputed = max(
                int(r.c["positions"]) - (saves[r.rank].positions if saves[r.rank] else 0)
                for r in a.ranks
            )
    restore = restore_of(a)
    restored = restore["step"] if restore else None
    bytes_ = {k: sum(int(r.c[src]) for r in a.ranks) for k, src in _BYTES.items()}
    bytes_["cache_peak"] = max(int(r.c["cache_peak"]) for r in a.ranks)
    return {
        "id": a.id, "ended": a.ended, "error": a.error, "reason": a.reason, "start": a.start, "end": a.end,
        "wall_seconds": span, "ranks": n, "first_step": (restored or 0) + 1,
        "last_step": (restored or 0) + steps, "steps": steps, "lost_steps": lost,
        "restored_step": restored, "last_committed_step": step, "seconds": seconds,
        "samples": {"trained": positions, "recomputed": recomputed}, "bytes": bytes_,
        "requests": {k: sum(int(r.c[src]) for r in a.ranks) for k, src in _REQUESTS.items()},
    }  # fmt: skip


def segments(r: Rank) -> list[tuple[int, int]]:
    """The rank's contiguous runs of linear positions in the order trained, the open one last."""
    out = [s for s in r.segments if s[1] > s[0]]
    start, end = int(r.c["segment_start"]), int(r.c["cursor"])
    if start >= 0 and end > start:
        out.append((start, end))
    return out


def cut(segs: list[tuple[int, int]], positions: int) -> list[tuple[int, int]]:
    """The first `positions` positions of `segs` (in training order): the part before a save."""
    out: list[tuple[int, int]] = []
    for a, b in segs:
        if positions <= 0:
            break
        take = min(b - a, positions)
        out.append((a, a + take))
        positions -= take
    return out


@dataclass
class Lineage:
    """Whose work is in the final weights, and which positions of [start, end) it trained."""

    complete: bool
    attempts: list[str]  # chronological
    intervals: list[tuple[int, int]]
    start: int  # 0, or where an unknown checkpoint's part begins the known part
    end: int  # the final cursor


def lineage(attempts: list[Attempt]) -> Lineage:
    """From the last attempt back through each restore to the earlier attempt that committed
    (or saved: a later restore proves the commit) the restored checkpoint, whose segments count
    cut at that save, until an attempt that restored nothing.

    A restored checkpoint that no earlier attempt saved leaves the lineage incomplete; what is
    known is counted from the cursor that restore gave the loader (else the first interval).
    """
    index = len(attempts) - 1
    chain: list[str] = []
    intervals: list[tuple[int, int]] = []
    final: int | None = None
    limit: int | None = None  # positions of the current attempt that are in the final weights
    while True:
        a = attempts[index]
        chain.append(a.id)
        segs = segments(a.ranks[0])
        kept = segs if limit is None else cut(segs, limit)
        if final is None and kept:
            final = kept[-1][1]
        intervals.extend(kept)
        restore = restore_of(a)
        if restore is None:
            complete = True
            break
        ckpt = restore["checkpoint"]
        holds = (any(ckpt in r.committed or ckpt in r.saves for r in b.ranks) for b in attempts)
        found = [i for i, yes in zip(range(index), holds) if yes]
        save = None
        if found:
            index = found[-1]
            save = next((r.saves[ckpt] for r in attempts[index].ranks if ckpt in r.saves), None)
        if save is None:
            complete = False
            break
        limit = save.positions
    start = 0
    if not complete:
        known = restore["cursor"]
        start = known if known is not None else min((a for a, _ in intervals), default=0)
    order = [x.id for x in attempts]
    return Lineage(complete, sorted(chain, key=order.index), intervals, start, final or 0)


def coverage(intervals: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """(trained_twice, never_trained) over [start, end): Σ (multiplicity − 1), uncovered length.

    A sweep over the interval ends: O(n log n) in the number of intervals.
    """
    points: list[tuple[int, int]] = []
    for a, b in intervals:
        a, b = max(a, start), min(b, end)
        if b > a:
            points += [(a, 1), (b, -1)]
    points.sort()
    twice = never = depth = 0
    prev = start
    for x, delta in points:
        if x > prev:
            if depth == 0:
                never += x - prev
            elif depth > 1:
                twice += (depth - 1) * (x - prev)
            prev = x
        depth += delta
    return twice, never + max(0, end - prev)


def data_wait(attempts: list[Attempt]) -> dict[str, Any]:
    """Per-rank data wait over the job, its mean and max, and which rank waited most per epoch.

    An epoch's wait is its `epoch` events, plus the unfinished epoch of a rank's counters.
    """
    per_rank: dict[int, float] = {}
    epochs: dict[int, dict[int, float]] = {}
    for a in attempts:
        for r in a.ranks:
            per_rank[r.rank] = per_rank.get(r.rank, 0.0) + r.c["data_wait_seconds"]
            waits = dict(r.epoch_wait)
            if r.c["cursor"] >= 0 and r.c["epoch"] >= 0 and r.c["epoch"] not in waits:
                waits[int(r.c["epoch"])] = float(r.c["epoch_data_wait"])
            for e, w in waits.items():
                row = epochs.setdefault(e, {})
                row[r.rank] = row.get(r.rank, 0.0) + w
    worst = max(per_rank, key=lambda k: (per_rank[k], -k))
    return {
        "per_rank": dict(sorted(per_rank.items())),
        "mean": sum(per_rank.values()) / len(per_rank),
        "max": per_rank[worst],
        "max_rank": worst,
        "epochs": [
            {"epoch": e, "max_rank": (m := max(row, key=lambda k, row=row: (row[k], -k))),
             "max_seconds": row[m], "mean_seconds": sum(row.values()) / len(row)}
            for e, row in sorted(epochs.items())
        ],
    }


def account(
    records: Mapping[str, Any], *, running: str | None = None, prices: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The job's report object (job contract) from `read_job`'s records.

    `running`: the id of an attempt still running in this process, accounted as finished now
    (ending at its ranks' last heartbeat). `prices` (as from `parse_prices`): fills "cost".
    A record missing a key or holding a wrong type is a ValueError naming attempt, rank, field.
    """
    ident, attempts = parse_records(records, running)
    reports = []
    for i, a in enumerate(attempts):
        later = (restore_of(b) for b in attempts[i + 1 :])
        proven = {r["checkpoint"] for r in later if r is not None}
        reports.append(attempt_report(a, i == len(attempts) - 1, proven))
    start, end = attempts[0].start, max(a.end for a in attempts)
    wall = end - start
    seconds = {k: sum(r["seconds"][k] for r in reports) for k in ATTEMPT_KINDS}
    seconds["between_attempts"] = sum(
        max(0.0, b.start - a.end) for a, b in zip(attempts, attempts[1:])
    )
    # Overlapping attempts (or the gaps) make the spans differ from the wall: `other` closes.
    seconds["other"] = wall - sum(v for k, v in seconds.items() if k != "other")
    known = lineage(attempts)
    twice, never = coverage(known.intervals, known.start, known.end)
    bytes_ = {k: sum(r["bytes"][k] for r in reports) for k in _BYTES}
    bytes_["cache_peak"] = max(r["bytes"]["cache_peak"] for r in reports)
    report: dict[str, Any] = {
        "job": ident,
        "wall_seconds": wall,
        "goodput": seconds["productive"] / wall if wall > 0 else 0.0,
        "seconds": {k: seconds[k] for k in SECOND_KINDS},
        "steps": {"trained": sum(r["steps"] for r in reports),
                  "recomputed": sum(r["lost_steps"] for r in reports[:-1]),
                  "lost": sum(r["lost_steps"] for r in reports)},
        "samples": {"trained": sum(r["samples"]["trained"] for r in reports),
                    "recomputed": sum(r["samples"]["recomputed"] for r in reports),
                    "trained_twice": twice, "never_trained": never},
        "bytes": bytes_,
        "requests": {k: sum(r["requests"][k] for r in reports) for k in _REQUESTS},
        "data_wait": data_wait(attempts),
        "sources": sources_total(r.sources for a in attempts for r in a.ranks),
        "lineage": {"complete": known.complete, "attempts": known.attempts},
        "attempts": reports,
        "cost": None,
    }  # fmt: skip
    if prices is not None:
        report["cost"] = cost(report, prices)
    return report
