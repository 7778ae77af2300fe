"""Is process P alive, and is it still the process we mean? The one answer, for every caller.

A pid alone does not name a process for good: once it has ended, the kernel hands the pid to
the next process it starts. So a process is named by its `ProcessIdentity`: its pid and its
start time (clock ticks after boot, field 22 of /proc/<pid>/stat), and it counts as alive only
while that pid exists, is not a zombie (ended, not yet reaped) and started at that time.

Who asks: a worker watching its training process (`shardloader.runtime.child_process`), the
MLflow logger asking whether a RUNNING run's owner is gone (`telemetry.mlflow.owner`), and a
Checkpointer asking whether another attempt still writes its root (`telemetry.job.live`, which
also waits a moment for a killed writer to finish exiting: `alive_after`).

Without /proc (not Linux) a start time is unknown (None) and only the pid can be asked
(`os.kill(pid, 0)`): there a zombie counts as alive until it is reaped, and a pid that exists
but belongs to another user (PermissionError) counts as alive, since it does exist.
"""

from __future__ import annotations

import os
import select
import time
from dataclasses import dataclass

#: How often `alive_after` looks where there is no pidfd to wait on.
_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class ProcessIdentity:
    """One process: its pid and its start time (clock ticks after boot, field 22 of
    /proc/<pid>/stat; None where unknown: no /proc, or a pid known without its start)."""

    pid: int
    start: int | None


def _has_proc() -> bool:
    return os.path.exists("/proc/self/stat")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of `pid` from /proc, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    rest = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and ')'
    return rest[0], int(rest[19])


def identity_of(pid: int) -> ProcessIdentity:
    """The identity of process `pid` now (its start None when /proc does not know it)."""
    stat = _stat(pid) if _has_proc() else None
    return ProcessIdentity(pid, None if stat is None else stat[1])


def this_process() -> ProcessIdentity:
    """This process's identity (for the children it starts, for the records it writes)."""
    return identity_of(os.getpid())


def is_alive(process: ProcessIdentity) -> bool:
    """Whether `process` still runs: its pid exists, is no zombie and, when its start time is
    known, started then (a recycled pid is another process: not alive)."""
    if _has_proc():
        stat = _stat(process.pid)
        if stat is None or stat[0] in ("Z", "X"):
            return False
        return process.start is None or stat[1] == process.start
    try:  # no /proc: only whether the pid exists (a zombie still does, until it is reaped)
        os.kill(process.pid, 0)
    except PermissionError:  # it exists, as another user's process
        return True
    except OSError:
        return False
    return True


def alive_after(process: ProcessIdentity, grace: float) -> bool:
    """Whether `process` is still alive `grace` seconds from now; returns as soon as it ends.
    Waits on a pidfd of it, which becomes readable when it exits (polls `is_alive` where there
    is no pidfd: an old kernel, a seccomp filter, not Linux)."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not is_alive(process):
                return False
            time.sleep(_POLL_SECONDS)
        return is_alive(process)
    try:
        if not is_alive(process):  # the pid was reused before the pidfd was taken
            return False
        # poll, not select: select refuses a descriptor number past 1024, which a training
        # process with many open files (shards, sockets, a big DataLoader) reaches
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return not poller.poll(grace * 1000) and is_alive(process)
    finally:
        os.close(pidfd)


def launch_time(pid: int | None = None) -> float | None:
    """When process `pid` (default: this one) started, in unix seconds, or None without /proc
    or without that process: its start time in /proc (clock ticks after boot) against the time
    since boot now (/proc/uptime), both to 10 ms. For this process it counts the interpreter's
    start and the imports, which a clock read in the program misses."""
    stat = _stat(os.getpid() if pid is None else pid) if _has_proc() else None
    if stat is None or stat[0] in ("Z", "X"):  # gone, or exited and not reaped yet
        return None
    try:
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - stat[1] / os.sysconf("SC_CLK_TCK"))
