"""`runtime.liveness`: the one answer to "is process P alive, and still the process we mean?",
asked of real processes: a live one, a zombie, a reaped one, a recycled pid (same pid, another
start time), a pid known without its start, and the wait for a process to end."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shardloader.runtime.liveness import (
    ProcessIdentity,
    alive_after,
    identity_of,
    is_alive,
    launch_time,
    this_process,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _sleeper() -> subprocess.Popen:
    """A child that runs until its stdin closes."""
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)


def test_this_process_is_alive_and_a_recycled_pid_is_another_process():
    me = this_process()
    assert me.pid == os.getpid() and me.start is not None
    assert is_alive(me)
    assert is_alive(ProcessIdentity(me.pid, None))  # the pid alone: it exists
    assert not is_alive(ProcessIdentity(me.pid, me.start + 1))  # same pid, another start


def test_a_zombie_is_dead_before_it_is_reaped_and_a_reaped_pid_is_too():
    child = _sleeper()
    try:
        who = identity_of(child.pid)
        assert who.start is not None and is_alive(who)
        child.stdin.close()  # it exits on end of input
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        assert not is_alive(who)
        assert not is_alive(ProcessIdentity(child.pid, None))
        assert identity_of(child.pid).start == who.start  # /proc still knows the zombie
    finally:
        child.kill()
        child.wait()
    assert not is_alive(who)
    assert identity_of(child.pid).start is None  # reaped: gone from /proc


def test_without_proc_only_the_pid_is_asked(monkeypatch):
    import shardloader.runtime.liveness as liveness

    monkeypatch.setattr(liveness, "_has_proc", lambda: False)
    me = os.getpid()
    assert identity_of(me) == ProcessIdentity(me, None)
    assert is_alive(ProcessIdentity(me, 12345))  # no start time to compare: the pid exists
    assert is_alive(ProcessIdentity(1, None))  # init: exists as another user's (or ours)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid exists no more
    assert not is_alive(ProcessIdentity(child.pid, None))


def test_alive_after_waits_for_the_end_and_returns_when_it_comes():
    child = _sleeper()
    try:
        who = identity_of(child.pid)
        assert alive_after(who, 0.05)  # alive: the wait runs out
        assert not alive_after(ProcessIdentity(who.pid, who.start + 1), 60.0)  # not that process
        child.stdin.close()
        began = time.monotonic()
        assert not alive_after(who, 60.0)  # returns when it exits, not after the grace
        assert time.monotonic() - began < 30.0
    finally:
        child.kill()
        child.wait()


def test_alive_after_polls_where_there_is_no_pidfd(monkeypatch):
    monkeypatch.delattr(os, "pidfd_open")  # as on a kernel without pidfds
    child = _sleeper()
    try:
        who = identity_of(child.pid)
        assert alive_after(who, 0.1)
        child.stdin.close()
        assert not alive_after(who, 60.0)
    finally:
        child.kill()
        child.wait()


def test_launch_time_is_when_the_process_started():
    before = time.time()
    child = _sleeper()
    try:
        launched = launch_time(child.pid)
        assert launched is not None and before - 0.5 < launched < time.time() + 0.5
    finally:
        child.kill()
        child.wait()
    assert launch_time(child.pid) is None  # gone
