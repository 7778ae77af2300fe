"""`runtime.liveness.alive_after` (what `telemetry.job.live` waits with): waiting for a live writer on this host to exit works whatever the
descriptor numbers of the waiting process (a training process may hold thousands)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from shardloader.runtime.liveness import alive_after, identity_of
from shardloader.telemetry.job import layout
from shardloader.telemetry.job.counters import Counters
from shardloader.telemetry.job.live import running_elsewhere


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds and /proc")
def test_the_exit_wait_takes_descriptors_past_1024():
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # select() stops at 1024
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        who = identity_of(child.pid)
        assert who.start is not None
        assert alive_after(who, 0.05)  # alive: the wait runs out
        child.stdin.close()  # the child exits on end of input
        assert not alive_after(who, 60.0)  # returns when it exits
    finally:
        child.kill()
        child.wait()
        for fd in held:
            os.close(fd)


def _attempt_of(job_dir, pid: int, **start_fields) -> None:
    """The records of a rank-0 attempt with a fresh heartbeat, not ended, written by `pid`."""
    directory = os.path.join(job_dir, layout.ATTEMPTS_DIR, layout.new_attempt_id(time.time(), "0badcafe"))
    os.makedirs(directory)
    counters = Counters(os.path.join(directory, layout.rank_file(0, layout.COUNTERS_SUFFIX)),
                        {"heartbeat_time": time.time()})
    counters.publish()
    counters.close()
    start = {"event": "start", "host": socket.gethostname(), "pid": pid, **start_fields}
    with open(os.path.join(directory, layout.rank_file(0, layout.EVENTS_SUFFIX)), "w") as f:
        f.write(json.dumps(start) + "\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds and /proc")
@pytest.mark.parametrize("recorded", ["its start", "another start", "no start (older records)"])
def test_a_writer_here_is_its_pid_with_the_start_its_record_names(tmp_path, recorded):
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        who = identity_of(child.pid)
        start = {"its start": {"process_start": who.start},
                 "another start": {"process_start": who.start + 1},  # the pid was reused
                 "no start (older records)": {}}[recorded]
        _attempt_of(tmp_path, child.pid, launch_time=time.time(), **start)
        writer = running_elsewhere(str(tmp_path))
        if recorded == "another start":
            assert writer is None
        else:  # alive through the exit grace: a writer (without a start, the pid alone is asked)
            assert writer is not None and writer.pid == child.pid
    finally:
        child.kill()
        child.wait()
    assert running_elsewhere(str(tmp_path)) is None  # gone
