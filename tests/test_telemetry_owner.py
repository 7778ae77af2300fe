"""Run ownership: a run's owner process is "gone" only when it was on this machine and that
process (not a recycled pid) no longer exists."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardloader.telemetry.mlflow.owner import TAG_OWNER, owner_is_gone, owner_tags

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_live_process_is_not_gone():
    assert not owner_is_gone(owner_tags())
    assert owner_tags()["shardloader.pid"] == str(os.getpid())


def test_a_dead_process_is_gone_also_before_it_is_reaped():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    tags = owner_tags(child.pid)
    try:
        child_ended = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # a zombie now
        assert child_ended is not None
        assert owner_is_gone(tags)
    finally:
        child.wait()
    assert owner_is_gone(tags)


def test_a_recycled_pid_is_gone_and_other_machines_are_left_alone():
    mine = owner_tags()
    recycled = dict(mine, **{TAG_OWNER: mine[TAG_OWNER].replace("start=", "start=1")})
    assert owner_is_gone(recycled)
    elsewhere = dict(mine, **{TAG_OWNER: mine[TAG_OWNER].replace("host=", "host=other-")})
    assert not owner_is_gone(dict(elsewhere, **{TAG_OWNER: elsewhere[TAG_OWNER].replace(
        f"pid={os.getpid()}", "pid=999999999")}))
    assert not owner_is_gone({})  # a run not created by shardloader
