"""`telemetry.job.live`: waiting for a live writer on this host to exit works whatever the
descriptor numbers of the waiting process (a training process may hold thousands)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardloader.telemetry.job.live import _still_alive_after, launch_time


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds and /proc")
def test_the_exit_wait_takes_descriptors_past_1024():
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # select() stops at 1024
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        launched = launch_time(child.pid)
        assert launched is not None
        assert _still_alive_after(child.pid, launched, 0.05)  # alive: the wait runs out
        child.stdin.close()  # the child exits on end of input
        assert not _still_alive_after(child.pid, launched, 60.0)  # returns when it exits
    finally:
        child.kill()
        child.wait()
        for fd in held:
            os.close(fd)
