"""The hung-rank watchdog (issue 39 part 3), in one real training process (`tests/job_train.py`
with `--watchdog`): a step blocked forever is found within the bound, the process exits with
HUNG_EXIT_CODE and says where its training thread waits, and the job account says "hung"; long
saves (6 s against a bound of 2 s, standing in for a 60 s save against a bound of minutes: the
same code path, kept fast), the first batch's start-up and validation marked `paused` are not.
The torchrun case (the group restarted after a hang) is in tests/test_job_restarts.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace

import pytest

from shardloader.checkpoint import Checkpointer
from shardloader.telemetry.job.account import account
from shardloader.telemetry.job.endings import attempt_ending
from shardloader.telemetry.job.read import read_job_dir
from shardloader.telemetry.job.watchdog import HUNG_EXIT_CODE
from tests.integration_runs import ROOT, env, readline, survivors
from tests.job_train import write_data

BOUND = 2.0
SLOW = 6.0  # seconds a slow save takes: three bounds
DEADLINE = 240.0


def start(tmp_path, marker: str, *extra: str) -> subprocess.Popen:
    data = str(tmp_path / "data")
    write_data(data)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.job_train", str(tmp_path / "ckpt"), data, "--watchdog",
         str(BOUND), *extra], cwd=ROOT, env=env(marker), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=open(tmp_path / "stderr", "w"), text=True)


def test_a_step_that_hangs_ends_the_process_within_the_bound_naming_where_it_waits(tmp_path):
    marker = uuid.uuid4().hex
    proc = start(tmp_path, marker, "--hang-at", "7", "--workers", "1")
    while (line := readline(proc, DEADLINE)) != "hang 7\n":
        assert line, f"no hang (rc={proc.poll()}): {open(tmp_path / 'stderr').read()[-3000:]}"
    hung_at = time.monotonic()
    assert proc.wait(DEADLINE) == HUNG_EXIT_CODE
    latency = time.monotonic() - hung_at
    assert survivors(marker) == []  # its loader worker ended with it
    err = open(tmp_path / "stderr").read()
    first = err.splitlines()[0]
    assert first.startswith("shardloader watchdog: hung: rank 0 made no step progress for "), err[:2000]
    stalled = float(first.split(" for ")[1].split(" s ")[0])
    assert BOUND <= stalled < BOUND + 0.5, first
    assert "after its batch 7" in first
    assert "in hang_in_step" in err.split("all threads:")[0]  # the training thread's stack

    report = account(read_job_dir(str(tmp_path / "ckpt")))
    (attempt,) = report["attempts"]
    assert attempt["ended"] == "hung" and "in hang_in_step" in attempt["reason"]
    assert attempt["reason"].startswith("rank 0 made no step progress")
    assert latency < BOUND + 5.0  # detection, record, grace and exit, on a loaded machine
    print(f"stalled {stalled:.2f} s when found (bound {BOUND} s); hang -> exit seen {latency:.2f} s")


def test_slow_saves_the_first_batch_and_validation_are_no_hang(tmp_path):
    """A save that takes three bounds in its stage (on the training thread, inside `save()`)
    and one that takes three bounds in its upload (the writer thread: the next `save()` waits
    for it), a first batch that takes 2.5 bounds, and validation of 1.5 bounds an epoch in
    `ckpt.watchdog.paused("validation")`: the run ends normally."""
    marker = uuid.uuid4().hex
    t0 = time.monotonic()
    proc = start(tmp_path, marker, "--first-batch-delay", str(2.5 * BOUND), "--slow-stage", "8",
                 "--slow-upload", "12", "--slow-seconds", str(SLOW), "--validate", str(1.5 * BOUND))
    out, _ = proc.communicate(timeout=DEADLINE)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, open(tmp_path / "stderr").read()[-3000:]
    assert out.endswith("done\n") and survivors(marker) == []
    report = account(read_job_dir(str(tmp_path / "ckpt")))
    (attempt,) = report["attempts"]
    assert attempt["ended"] == "finished"
    # the slow parts did take their time: the test is not vacuous
    assert report["seconds"]["checkpoint"] >= 2 * SLOW
    assert report["seconds"]["startup"] >= 2.5 * BOUND  # to the first batch
    assert wall >= 2 * SLOW + 2.5 * BOUND + 2 * 1.5 * BOUND  # and the validation


def test_watchdog_seconds_is_checked_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="^watchdog_seconds must be a positive number"):
        Checkpointer(str(tmp_path / "ckpt"), watchdog_seconds=0)
    assert not os.path.exists(tmp_path / "ckpt")


def _ranks(*endings):
    """Ranks as the account parses them: (ending or None for a rank that recorded none, error)."""
    return [SimpleNamespace(rank=i, how=how, error=error, end_time=None if how is None else 10.0 + i,
                            end_fields={}, c={"heartbeat_time": 5.0})
            for i, (how, error) in enumerate(endings)]


def test_an_attempt_is_hung_when_any_rank_hung_and_its_reason_holds_every_hung_rank():
    assert attempt_ending(_ranks(("failed", "Connection closed by peer"), ("hung", "made no step"))) \
        == ("hung", None, "rank 1: made no step")
    assert attempt_ending(_ranks(("hung", "a"), ("hung", "b"))) == ("hung", None, "rank 0: a\nrank 1: b")
    assert attempt_ending(_ranks(("finished", None), (None, None)))[0] == "killed"
    assert attempt_ending(_ranks(("finished", None), ("finished", None))) == ("finished", None, None)
