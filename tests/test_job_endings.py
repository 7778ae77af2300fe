"""Why each attempt ended (issue 39): the endings resolved from every rank's `end` event, and
`record_ending` writing one through a real recorder. Records are hand-built as in
tests/test_job_account.py; the real runs are in tests/test_preemption.py."""

from __future__ import annotations

import json
import os

import pytest

from shardloader.telemetry.job import layout
from shardloader.telemetry.job.account import account
from shardloader.telemetry.job.endings import ENDINGS, record_ending
from shardloader.telemetry.job.read import read_job_dir
from shardloader.telemetry.job.recorder import open_attempt
from shardloader.telemetry.job.render import plot_job, render_job_text
from tests.test_job_account import attempt, job

GLOO = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"


def two_ranks(**kwargs) -> dict:
    return attempt("a1", launch=100.0, steps=6, saves=(4,), commits=(4,), waits={0: 0.5, 1: 0.5},
                   **kwargs)


def end_of(record: dict, rank: int, **end) -> None:
    """Make rank `rank` end with `end` (None: vanish, its heartbeat `beat` seconds earlier)."""
    events = record["ranks"][rank]["events"]
    last = events.pop()
    assert last["event"] == "end"
    if end.get("how") is None:
        record["ranks"][rank]["counters"]["heartbeat_time"] = last["time"] + end.get("beat", 0.0)
        return
    events.append({"event": "end", "time": last["time"] + end.pop("at", 0.0), "error": None, **end})


def test_a_rank_killed_under_torchrun_is_the_cause_not_the_peers_gloo_error():
    record = two_ranks()
    end_of(record, 1, how=None, beat=-0.6)  # SIGKILLed: no end event, last heartbeat before
    end_of(record, 0, how="failed", error=GLOO)  # then the peer's collective failed
    a = account(job(record))["attempts"][0]
    assert (a["ended"], a["error"], a["lost_steps"]) == ("killed", None, 2)
    assert a["reason"].startswith("rank 1 killed: it ended without recording an ending")
    assert "then rank 0 failed: " + GLOO in a["reason"]


def test_a_real_failure_first_is_the_cause_even_when_a_rank_then_vanished():
    record = two_ranks()
    end_of(record, 0, how="failed", error="ValueError: loss is nan", at=-3.0)
    end_of(record, 1, how=None)  # the launcher SIGTERMed it 3 s after rank 0 failed
    a = account(job(record))["attempts"][0]
    assert (a["ended"], a["error"]) == ("failed", "ValueError: loss is nan")
    assert a["reason"] == "rank 0 failed: ValueError: loss is nan"


def test_a_failure_long_after_a_rank_fell_silent_is_the_kills_consequence():
    record = two_ranks()
    end_of(record, 1, how=None, beat=-5.0)  # silent 5 s before rank 0's error: gone first
    end_of(record, 0, how="failed", error="RuntimeError: a collective gave up")
    assert account(job(record))["attempts"][0]["ended"] == "killed"
    record = two_ranks()
    end_of(record, 1, how=None, beat=-1.0)  # within a heartbeat: the error is taken as the cause
    end_of(record, 0, how="failed", error="RuntimeError: CUDA error: out of memory")
    assert account(job(record))["attempts"][0]["ended"] == "failed"


@pytest.mark.parametrize("hows, ended", [
    (("preempted_saved", "preempted_saved"), "preempted_saved"),
    (("preempted_saved", "preempted_lost"), "preempted_lost"),  # one rank's save lost: lost
    (("hung", None), "hung"),
    (("finished", "finished"), "finished"),
])
def test_endings_precedence(hows, ended):
    record = two_ranks()
    for rank, how in enumerate(hows):
        end_of(record, rank, how=how, error=None if how == "finished" else f"why {rank}")
    a = account(job(record))["attempts"][0]
    assert a["ended"] == ended
    if ended != "finished":
        which = hows.index(ended)
        assert a["reason"] == f"rank {which}: why {which}"


def test_record_ending_writes_the_end_event_the_account_reads(tmp_path):
    job_dir = str(tmp_path / layout.JOB_DIR)
    os.makedirs(job_dir)
    with open(os.path.join(job_dir, layout.JOB_FILE), "w") as f:
        json.dump({"job_id": "ab" * 16, "name": "t", "created": 0.0}, f)
    recorder = open_attempt(job_dir, job_id="ab" * 16, job_name="t",
                            attempt_id="20270101T000000-0000abcd", rank=0, world_size=1)
    with pytest.raises(ValueError, match="how must be one of"):
        record_ending("stuck", "no")
    assert record_ending("hung", "no step for 60 s; waits in: dist.all_reduce", rank=1,
                         stack="File train.py, line 9")
    assert not record_ending("finished")  # the first ending stands
    assert recorder.ended
    report = account(read_job_dir(str(tmp_path)))
    a = report["attempts"][0]
    assert (a["ended"], a["reason"]) == ("hung", "rank 1: no step for 60 s; waits in: dist.all_reduce")
    text = render_job_text(report)
    assert "attempts           1 (1 hung)" in text
    assert "20270101T000000-0000abcd hung: rank 1: no step for 60 s" in text
    assert os.path.getsize(plot_job(report, tmp_path / "job.png")) > 0


def test_every_ending_is_listed_and_drawn(tmp_path):
    attempts = []
    for i, how in enumerate(ENDINGS):
        record = attempt(f"a{i}", launch=100.0 * i, steps=6, saves=(4,), commits=(4,),
                         end=how, error=None if how == "finished" else f"why {how}")
        attempts.append(record)
    report = account(job(*attempts))
    assert [a["ended"] for a in report["attempts"]] == list(ENDINGS)
    assert [a["lost_steps"] for a in report["attempts"]] == [2] * len(ENDINGS)  # none the last finished
    text = render_job_text(report)
    assert ("attempts           6 (1 finished, 1 preempted saved, 1 preempted lost, 1 killed, "
            "1 failed, 1 hung)") in text
    lines = text.splitlines()
    for i, how in enumerate(ENDINGS[1:], 1):
        line = next(x for x in lines if x.startswith(f"  a{i} {how.replace('_', ' ')}: "))
        assert line.endswith(f"why {how}"), line
    assert os.path.getsize(plot_job(report, tmp_path / "job.png")) > 0


def test_a_save_without_a_loader_is_accounted(tmp_path):
    """A Checkpointer that saves only a model (no loader: no cursor) writes a `save` event whose
    cursor is None; the account reads it and counts the attempt (it once refused the job)."""
    import torch

    from shardloader.checkpoint import Checkpointer

    root = str(tmp_path / "ckpt")
    with Checkpointer(root) as ckpt:
        model = torch.nn.Linear(2, 2)
        ckpt.save(1, model=model)
        ckpt.wait()
    report = account(read_job_dir(root))
    (only,) = report["attempts"]
    assert only["ended"] == "finished" and only["lost_steps"] == 0
