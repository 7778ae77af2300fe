"""A checkpoint root has one writer (I14, issue 25 item 1): a second job started while the
first still writes the root is refused before it touches anything, on this host (by pid) and
from another host (by the first one's heartbeat); a restart after a kill is not refused; a job
of another name is refused even when the first has ended (tests/test_job_accounting.py).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest

from shardloader.checkpoint import Checkpointer
from shardloader.errors import CheckpointError
from tests.integration_runs import env, readline

# A job that saves step 1 and then keeps training (waits) until told to stop. `host` makes it
# record another host name, as a rank on another node would.
RUNNING_JOB = """
import socket, sys
host = sys.argv[2]
if host:
    socket.gethostname = lambda: host
from shardloader.checkpoint import Checkpointer
ckpt = Checkpointer(sys.argv[1], keep=2)
ckpt.save(1, state={"w": 1}).wait()
print("ready", flush=True)
sys.stdin.readline()
"""


def start_job(root, host: str = "") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", RUNNING_JOB, str(root), host], env=env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert readline(proc, 120).strip() == "ready"
    return proc


def snapshot(root) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if ".job" not in p.parts)


@pytest.mark.parametrize("host", ["", "node-b"], ids=["same-host", "other-host"])
def test_a_second_job_is_refused_while_the_first_writes_and_a_restart_after_a_kill_is_not(tmp_path, host):
    root = tmp_path / "ckpt"
    first = start_job(root, host)
    try:
        before = snapshot(root)
        with pytest.raises(CheckpointError, match=r"another job is writing this checkpoint root now: "
                                                  r"attempt \S+ \(rank 0, host " + (host or r"\S+") + r", pid "
                                                  + str(first.pid)):
            Checkpointer(root)
        assert snapshot(root) == before  # nothing written, nothing deleted
    finally:
        # Restarted at once, as `kill -9 $pid; python train.py` does: the killed process may
        # still be exiting when the restart looks.
        first.send_signal(signal.SIGKILL)
    try:
        with Checkpointer(root) as restarted:  # the first is dead: this is its next attempt
            assert restarted.steps() == [1]
            assert restarted.latest() == 1
    finally:
        first.wait(30)


def test_a_job_that_ended_leaves_the_root_to_its_next_attempt(tmp_path):
    root = tmp_path / "ckpt"
    first = start_job(root)
    first.communicate("stop\n", timeout=60)
    assert first.returncode == 0
    with Checkpointer(root) as again:
        assert again.steps() == [1]


def test_a_second_checkpointer_on_one_root_in_one_process_takes_over(tmp_path):
    """A notebook cell that makes a Checkpointer, run twice: the first was never closed. The
    second takes over the root; the first writes and deletes nothing from then on (its next
    save is a clear error), so its retention (keep=1) never deletes the second's checkpoints."""
    root = tmp_path / "ck"
    first = Checkpointer(root, keep=1)
    first.save(1, state={"w": 1}).wait()
    second = Checkpointer(root, keep=3)  # the cell, run again
    second.save(10, state={"w": 10}).wait()
    second.save(11, state={"w": 11}).wait()
    with pytest.raises(CheckpointError, match=rf"^{re.escape(first.root)}: this Checkpointer was closed: "
                                              r"a newer Checkpointer of this root in this process took over"):
        first.save(2, state={"w": 2})  # interleaved with the second's saves
    second.save(12, state={"w": 12}).wait()
    assert second.steps() == [10, 11, 12]  # keep=3 of the second's own, none deleted by the first
    with pytest.raises(CheckpointError, match="took over"):
        first.load()
    assert second.load() == 12
    second.close()
    first.close()  # closing the stood-down one is harmless
    assert Checkpointer(root, keep=3).steps() == [10, 11, 12]


def test_a_garbage_collected_checkpointer_deletes_nothing_of_the_one_that_took_over(tmp_path):
    """The first object was dropped (its cell's variable rebound) while its save was still in
    flight: that save commits, but its retention, which runs after the second has saved, deletes
    nothing."""
    import gc
    import threading
    import weakref

    root = tmp_path / "ck"
    at_retention, go_on = threading.Event(), threading.Event()

    def hold_retention(phase, ckpt_id, step):
        if phase == "retention":
            at_retention.set()
            assert go_on.wait(60)

    first = Checkpointer(root, keep=1, _phase_hook=hold_retention)
    handle = first.save(1, state={"w": 1})
    assert at_retention.wait(60)  # committed; its retention waits
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None  # garbage-collected, never closed
    second = Checkpointer(root, keep=3)
    second.save(10, state={"w": 10}).wait()
    second.save(11, state={"w": 11}).wait()
    go_on.set()  # the first's retention (keep=1) runs now
    handle.wait()
    assert second.steps() == [1, 10, 11]
    second.close()
