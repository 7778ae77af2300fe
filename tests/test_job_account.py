"""The job's account (I15) from hand-built records, and the prices that turn it into money.

`attempt()` simulates one attempt's ranks on a clock of exactly representable times (imports,
restore, first batch, then per step: compute, an optional save, the next batch's data wait)
and writes the counters and events the recorder would. Every expected figure below is worked
out from those parameters by hand, so the comparisons are exact.
"""

from __future__ import annotations

import copy
import math

import pytest

from shardloader.telemetry.job.account import account, coverage
from shardloader.telemetry.job.prices import cost, parse_prices

GBS = 64  # global batch size: positions per step


def attempt(
    aid: str,
    *,
    launch: float,
    steps: int,
    start_cursor: int = 0,
    restore: tuple[int, str, int | None] | None = None,  # (step, checkpoint id, cursor)
    saves: tuple[int, ...] = (),  # local steps after which a save event is logged
    commits: tuple[int, ...] = (),  # of those, the ones whose `committed` event is logged
    end: str | None = "finished",  # None: killed (no end event)
    error: str | None = None,
    tail: float = 0.5,  # seconds from the last step (or end of data) to the end/heartbeat
    waits: dict[int, float] | None = None,  # per-rank data wait per step (default rank 0: 0.5)
    step: float = 1.0,
    imports: float = 3.0,
    first_wait: float = 2.0,
    restore_s: float = 0.25,
    save_s: float = 0.25,
    epoch_steps: int = 1000,
) -> dict:
    """One attempt's JobRecords entry; checkpoint ids are `step-<global step>-<aid>`."""
    restored = restore[0] if restore else 0
    ranks = {}
    for rank, wait in (waits or {0: 0.5}).items():
        events: list[dict] = [{"event": "start", "time": launch, "attempt": aid, "rank": rank}]
        t = launch + imports
        if restore:
            t += restore_s
            events.append({"event": "restore", "time": t, "step": restore[0],
                           "checkpoint": restore[1], "seconds": restore_s, "cursor": restore[2]})  # fmt: skip
        t += first_wait
        first_batch = t if steps else 0.0
        cursor, step_s, wait_s, ckpt_s, epoch_wait = start_cursor, 0.0, 0.0, 0.0, 0.0
        for k in range(1, steps + 1):
            t += step
            step_s += step
            cursor += GBS
            if k in saves:
                ckpt = f"step-{restored + k}-{aid}"
                events.append({"event": "save", "time": t, "step": restored + k, "checkpoint": ckpt,
                               "cursor": cursor, "steps": k, "step_seconds": step_s,
                               "positions": k * GBS})  # fmt: skip
                t += save_s
                ckpt_s += save_s
                if k in commits:
                    events.append({"event": "committed", "time": t, "step": restored + k,
                                   "checkpoint": ckpt, "bytes": 100, "files": 2})  # fmt: skip
            if k < steps or end == "finished":  # the next next(): a batch, or the end of data
                t += wait
                wait_s += wait
                epoch_wait += wait
            if cursor % (epoch_steps * GBS) == 0:
                events.append({"event": "epoch", "time": t, "epoch": cursor // (epoch_steps * GBS) - 1,
                               "data_wait_seconds": epoch_wait, "steps": epoch_steps})  # fmt: skip
                epoch_wait = 0.0
        t += tail
        if end is not None:
            events.append({"event": "end", "time": t, "how": end, "error": error})
        counters = {
            "launch_time": launch, "heartbeat_time": t, "rank": rank, "world_size": len(waits or [0]),
            "steps": steps, "positions": steps * GBS, "first_batch_time": first_batch,
            "blocked_before_first": restore_s if restore else 0.0, "first_wait_seconds": first_wait,
            "data_wait_seconds": wait_s, "step_seconds": step_s, "checkpoint_seconds": ckpt_s,
            "restore_seconds": restore_s if restore else 0.0,
            "start_cursor": start_cursor if steps else -1,
            "segment_start": start_cursor if steps else -1, "cursor": cursor if steps else -1,
            "positions_per_epoch": epoch_steps * GBS, "global_batch_size": GBS,
            "epoch": max(cursor - 1, 0) // (epoch_steps * GBS), "epoch_data_wait": epoch_wait,
            "bytes_remote": 1000 * steps + rank, "bytes_from_cache": 10 * steps,
            "downloads": steps, "range_requests": 2 * steps, "redownloads": 1,
            "bytes_redownloaded": 7, "cache_peak": 5000 + rank,
            "checkpoint_bytes": 100 * len(commits), "checkpoint_files": 2 * len(commits),
        }  # fmt: skip
        ranks[rank] = {"counters": {k: float(v) for k, v in counters.items()}, "events": events}
    return {"id": aid, "ranks": ranks}


def job(*attempts: dict) -> dict:
    return {"job": {"job_id": "ab" * 16, "name": "test", "created": 0.0}, "attempts": list(attempts)}


def closes(seconds: dict, wall: float) -> None:
    assert math.fsum(seconds.values()) == pytest.approx(wall, rel=1e-12, abs=1e-9)


def test_one_finished_attempt():
    report = account(job(attempt("a1", launch=100.0, steps=8, saves=(4,), commits=(4,))))
    # 3 imports + 2 first wait + 8 steps + 8 waits (the last: end of data) + 1 save + 0.5 tail
    assert report["wall_seconds"] == 17.75
    assert report["seconds"] == {
        "productive": 8.0, "data_wait": 4.0, "checkpoint": 0.25, "restore": 0.0, "startup": 5.0,
        "lost_progress": 0.0, "between_attempts": 0.0, "other": 0.5,
    }  # fmt: skip
    closes(report["seconds"], report["wall_seconds"])
    assert report["goodput"] == 8.0 / 17.75
    assert report["steps"] == {"trained": 8, "recomputed": 0, "lost": 0}
    assert report["samples"] == {"trained": 512, "recomputed": 0, "trained_twice": 0,
                                 "never_trained": 0}  # fmt: skip
    assert report["bytes"] == {"remote_read": 8000, "cache_hits": 80, "redownloaded": 7,
                               "checkpoint_written": 100, "cache_peak": 5000}  # fmt: skip
    assert report["requests"] == {"shard_downloads": 8, "range_requests": 16, "checkpoint_files": 2}
    assert report["lineage"] == {"complete": True, "attempts": ["a1"]}
    (a,) = report["attempts"]
    assert (a["ended"], a["error"], a["first_step"], a["last_step"]) == ("finished", None, 1, 8)
    assert (a["restored_step"], a["last_committed_step"], a["ranks"]) == (None, 4, 1)
    assert (a["start"], a["end"], a["wall_seconds"]) == (100.0, 117.75, 17.75)
    assert report["cost"] is None


def killed_twice() -> dict:
    """Killed between saves (a1, at step 6), during a save (a2, at step 12), then finished."""
    a1 = attempt("a1", launch=0.0, steps=6, saves=(4,), commits=(4,), end=None)
    a2 = attempt("a2", launch=30.0, steps=8, start_cursor=256, restore=(4, "step-4-a1", 256),
                 saves=(4, 8), commits=(4,), end=None, tail=0.0)  # fmt: skip
    a3 = attempt("a3", launch=60.0, steps=8, start_cursor=512, restore=(8, "step-8-a2", 512),
                 saves=(4,), commits=(4,))  # fmt: skip
    return job(a1, a2, a3)


def test_killed_between_and_during_saves_then_finished():
    records = killed_twice()
    report = account(records)
    a1, a2, a3 = report["attempts"]
    assert [a["ended"] for a in (a1, a2, a3)] == ["killed", "killed", "finished"]
    # Steps after each attempt's last committed save, exactly.
    assert [a["lost_steps"] for a in (a1, a2, a3)] == [2, 4, 0]
    assert [a["last_committed_step"] for a in (a1, a2, a3)] == [4, 8, 12]
    assert [(a["first_step"], a["last_step"]) for a in (a1, a2, a3)] == [(1, 6), (5, 12), (9, 16)]
    assert [a["restored_step"] for a in (a1, a2, a3)] == [None, 4, 8]
    assert report["steps"] == {"trained": 22, "recomputed": 6, "lost": 6}
    assert report["samples"] == {"trained": 22 * GBS, "recomputed": 6 * GBS, "trained_twice": 0,
                                 "never_trained": 0}  # fmt: skip
    assert [a["samples"]["recomputed"] for a in (a1, a2, a3)] == [2 * GBS, 4 * GBS, 0]
    # a1: 3 + 2 startup, 6 steps, 5 waits, a save, 0.5 tail; a2: 3 + 0.25 + 2, 8 steps, 7 waits,
    # 2 saves, no tail. The gaps to the next launch are what is between attempts.
    assert (a1["end"], a2["end"]) == (14.25, 30.0 + 17.25)
    assert report["seconds"]["between_attempts"] == (30.0 - 14.25) + (60.0 - 47.25)
    assert a1["seconds"]["productive"] == 4.0 and a1["seconds"]["lost_progress"] == 2.0
    assert a2["seconds"]["productive"] == 4.0 and a2["seconds"]["lost_progress"] == 4.0
    assert a2["seconds"]["restore"] == 0.25 and a2["seconds"]["startup"] == 5.0
    assert a3["seconds"]["productive"] == 8.0 and a3["seconds"]["lost_progress"] == 0.0
    assert report["seconds"]["lost_progress"] == 6.0
    assert report["wall_seconds"] == a3["end"] - 0.0
    closes(report["seconds"], report["wall_seconds"])
    for a in (a1, a2, a3):
        closes(a["seconds"], a["wall_seconds"])
    assert report["lineage"] == {"complete": True, "attempts": ["a1", "a2", "a3"]}
    assert records == killed_twice()  # pure: the input is left as it was


def test_a_restore_proves_a_commit_whose_event_was_lost():
    records = killed_twice()
    events = records["attempts"][0]["ranks"][0]["events"]
    events[:] = [e for e in events if e["event"] != "committed"]  # killed before the event
    a1 = account(records)["attempts"][0]
    assert (a1["last_committed_step"], a1["lost_steps"]) == (4, 2)


def test_model_restored_but_not_the_loader_trains_samples_twice():
    a1 = attempt("a1", launch=0.0, steps=15, saves=(10,), commits=(10,), end=None)
    a2 = attempt("a2", launch=40.0, steps=10, start_cursor=0, restore=(10, "step-10-a1", None))
    report = account(job(a1, a2))
    assert report["samples"]["trained_twice"] == 640  # the checkpoint's cursor was 640
    assert report["samples"]["never_trained"] == 0
    assert report["lineage"] == {"complete": True, "attempts": ["a1", "a2"]}


def test_resume_that_skipped_ahead_never_trains_samples():
    a1 = attempt("a1", launch=0.0, steps=12, saves=(10,), commits=(10,), end=None)
    a2 = attempt("a2", launch=40.0, steps=5, start_cursor=960, restore=(10, "step-10-a1", 640))
    report = account(job(a1, a2))
    assert report["samples"]["never_trained"] == 960 - 640
    assert report["samples"]["trained_twice"] == 0


def test_checkpoint_unknown_to_the_job_leaves_the_lineage_incomplete():
    a1 = attempt("a1", launch=0.0, steps=5, start_cursor=320, restore=(5, "step-5-elsewhere", 320))
    report = account(job(a1))
    assert report["lineage"] == {"complete": False, "attempts": ["a1"]}
    # Counted as far as known: from the restored cursor on.
    assert (report["samples"]["trained_twice"], report["samples"]["never_trained"]) == (0, 0)
    assert report["attempts"][0]["first_step"] == 6


def test_two_ranks_with_different_data_wait():
    a1 = attempt("a1", launch=0.0, steps=8, waits={0: 0.25, 1: 0.75}, epoch_steps=4)
    report = account(job(a1))
    dw = report["data_wait"]
    assert dw["per_rank"] == {0: 2.0, 1: 6.0}
    assert (dw["mean"], dw["max"], dw["max_rank"]) == (4.0, 6.0, 1)
    assert dw["epochs"] == [
        {"epoch": 0, "max_rank": 1, "max_seconds": 3.0, "mean_seconds": 2.0},
        {"epoch": 1, "max_rank": 1, "max_seconds": 3.0, "mean_seconds": 2.0},
    ]
    (a,) = report["attempts"]
    assert a["ranks"] == 2 and a["seconds"]["data_wait"] == 4.0  # the mean over ranks
    closes(a["seconds"], a["wall_seconds"])
    assert a["wall_seconds"] == 3 + 2 + 8 + 6.0 + 0.5  # to the slower rank's end
    assert report["bytes"]["remote_read"] == 8000 + 8001  # summed once per rank
    assert report["bytes"]["cache_peak"] == 5001  # the node cache's high water: a max
    assert report["steps"]["trained"] == 8 and report["samples"]["trained"] == 8 * GBS


def test_unfinished_epoch_counts_from_the_counters():
    a1 = attempt("a1", launch=0.0, steps=6, waits={0: 0.25, 1: 0.5}, epoch_steps=4, end=None)
    epochs = account(job(a1))["data_wait"]["epochs"]
    # Epoch 1: steps 5 and 6, one wait between them (killed before the next).
    assert epochs[1] == {"epoch": 1, "max_rank": 1, "max_seconds": 0.5, "mean_seconds": 0.375}


def test_running_attempt_is_accounted_as_finished_now():
    records = job(attempt("a1", launch=0.0, steps=6, saves=(4,), commits=(4,), end=None))
    killed = account(records)["attempts"][0]
    assert (killed["ended"], killed["lost_steps"]) == ("killed", 2)
    report = account(records, running="a1")
    a = report["attempts"][0]
    assert (a["ended"], a["lost_steps"], a["end"]) == ("finished", 0, 14.25)
    assert a["seconds"]["productive"] == 6.0
    with pytest.raises(ValueError, match="'nope'"):
        account(records, running="nope")


def test_failed_attempt_keeps_its_error():
    a1 = attempt("a1", launch=0.0, steps=3, end="failed", error="RuntimeError: boom")
    a = account(job(a1))["attempts"][0]
    assert (a["ended"], a["error"], a["lost_steps"]) == ("failed", "RuntimeError: boom", 3)


def damaged(change) -> dict:
    records = copy.deepcopy(killed_twice())
    change(records["attempts"][1]["ranks"][0])
    return records


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r["counters"].pop("step_seconds"), r"attempt 'a2' rank 0: counters.step_seconds missing"),
        (lambda r: r["counters"].update(steps="8"), r"attempt 'a2' rank 0: counters.steps: expected a number"),
        (lambda r: r["counters"].update(cursor=math.nan), r"counters.cursor: expected a finite"),
        (lambda r: r["counters"].update(positions=1.5), r"counters.positions: expected an integer"),
        (lambda r: r.pop("events"), r"attempt 'a2' rank 0: 'events' missing"),
        (lambda r: r["events"][1].pop("checkpoint"), r"event 1 \(restore\): field 'checkpoint' missing"),
        (lambda r: r["events"][2].update(cursor="x"), r"event 2 \(save\): field 'cursor': expected a number"),
        (lambda r: r["events"][2].pop("time"), r"event 2 \(save\): field 'time' missing"),
        (lambda r: r["events"].append({"event": "end", "time": 1.0, "how": "gone", "error": None}),
         r"field 'how': expected one of"),
        (lambda r: r["events"].append(7), r"event \d+: expected an object"),
    ],
)  # fmt: skip
def test_damaged_records_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        account(damaged(change))


def test_damaged_job_and_attempt_records():
    with pytest.raises(ValueError, match="'attempts' missing"):
        account({"job": {"job_id": "x", "name": "y"}, "attempts": []})
    with pytest.raises(ValueError, match="field 'name'"):
        account({"job": {"job_id": "x"}, "attempts": killed_twice()["attempts"]})
    with pytest.raises(ValueError, match="attempt 0: field 'id'"):
        account(job({"ranks": {}}))
    with pytest.raises(ValueError, match="attempt 'a1': field 'ranks'"):
        account(job({"id": "a1", "ranks": {}}))


def test_coverage_sweeps_intervals_not_positions():
    billion = 10**9
    intervals = [(0, billion), (billion // 2, 2 * billion), (billion // 2, billion)]
    # [0.5e9, 1e9) is covered three times; [2e9, 3e9) never.
    assert coverage(intervals, 0, 3 * billion) == (2 * (billion // 2), billion)
    assert coverage([], 5, 9) == (0, 4)
    assert coverage([(0, 4), (4, 8)], 0, 8) == (0, 0)


def test_parse_prices():
    text = "gpu_hour=2.5,gpus=8,egress_gb=0.09,get_1k=0.0004,put_1k=0.005"
    assert parse_prices(text) == {"gpu_hour": 2.5, "gpus": 8.0, "egress_gb": 0.09,
                                  "get_1k": 0.0004, "put_1k": 0.005}  # fmt: skip
    assert parse_prices(" gpu_hour = 3 , ") == {"gpu_hour": 3.0}
    for bad, name in [("gpu_hr=2", "gpu_hr"), ("gpu_hour=two", "gpu_hour"),
                      ("egress_gb=-1", "egress_gb"), ("get_1k=nan", "get_1k"),
                      ("gpus=1,gpus=2", "gpus"), ("gpus=0", "gpus"), ("put_1k", "put_1k")]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            parse_prices(bad)


def priced_report(ranks: int = 2) -> dict:
    seconds = dict.fromkeys(
        ("productive", "data_wait", "checkpoint", "restore", "startup", "lost_progress",
         "between_attempts", "other"), 0.0)  # fmt: skip
    seconds.update(productive=3600.0, data_wait=1800.0, lost_progress=900.0, other=450.0)
    return {
        "seconds": seconds,
        "bytes": {"remote_read": 2_000_000_000},
        "requests": {"shard_downloads": 600, "range_requests": 400, "checkpoint_files": 2000},
        "attempts": [{"ranks": 1}, {"ranks": ranks}],
    }


def test_cost_arithmetic():
    prices = parse_prices("gpu_hour=2,gpus=4,egress_gb=0.5,get_1k=0.25,put_1k=0.5")
    money = cost(priced_report(), prices)
    # gpu_hour * gpus / 3600 = 1/450 per second: 8, 4, 2 and 1 for the seconds above.
    assert money["compute"]["productive"] == 8.0
    assert (money["compute"]["data_wait"], money["compute"]["lost_progress"]) == (4.0, 2.0)
    assert money["compute"]["other"] == 1.0 and money["compute"]["restore"] == 0.0
    assert money["badput"] == 7.0
    assert money["egress"] == 1.0  # 2 GB at 0.5
    assert money["requests"] == 0.25 + 1.0  # 1000 GETs at 0.25/1k, 2000 files at 0.5/1k
    assert money["total"] == 8.0 + 7.0 + 1.0 + 1.25
    assert money["prices"] == {"gpu_hour": 2.0, "gpus": 4.0, "egress_gb": 0.5, "get_1k": 0.25,
                               "put_1k": 0.5}  # fmt: skip
    assert money["currency_note"] == "in the units of the given prices"


def test_cost_defaults_gpus_to_the_largest_attempt():
    money = cost(priced_report(ranks=2), {"gpu_hour": 1.0})
    assert money["prices"]["gpus"] == 2.0 and money["compute"]["productive"] == 2.0
    assert money["egress"] == 0.0 and money["requests"] == 0.0
    with pytest.raises(ValueError, match="'spot'"):
        cost(priced_report(), {"spot": 1.0})


def test_account_with_prices_fills_cost():
    records = job(attempt("a1", launch=100.0, steps=8, saves=(4,), commits=(4,)))
    report = account(records, prices={"gpu_hour": 3600.0})
    assert report["cost"]["prices"]["gpus"] == 1.0
    assert report["cost"]["compute"]["productive"] == 8.0  # one GPU-second costs 1
    assert report["cost"]["badput"] == 17.75 - 8.0
    assert report["cost"] == cost({**report, "cost": None}, {"gpu_hour": 3600.0})
