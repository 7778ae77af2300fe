"""Processes shardloader starts die with the process that started them (invariant I11).

A training process can die by any signal, SIGKILL included (preemption, the OOM killer,
`kill -9`), and then runs no cleanup at all. Its children must notice on their own:

- On Linux the kernel delivers a signal to a child when its parent dies
  (`prctl(PR_SET_PDEATHSIG)`). The kernel ties that signal to the *thread* that forked the
  child, so it is armed only for children started from the parent's main thread; otherwise a
  worker pool created from a short-lived thread would be killed when that thread ends.
- Everywhere (and for the window between fork and `prctl`), a daemon thread in the child polls
  the parent's pid and exits the child when the parent is gone (re-parented to init or a
  subreaper).

Call `die_with_parent(parent_pid)` first thing in the child, with the pid the parent had
before it started the child.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
PARENT_POLL_SECONDS = 0.5


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread exits.

    Returns False where that is not available (not Linux, or libc without prctl)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, poll_seconds: float) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)  # the parent is gone; nobody is left to read what we would produce
        time.sleep(poll_seconds)


def die_with_parent(parent_pid: int, *, use_signal: bool = True,
                    poll_seconds: float = PARENT_POLL_SECONDS) -> None:
    """Make this (child) process exit when `parent_pid` dies, by any signal.

    `use_signal=False` skips the kernel's parent-death signal and relies on polling only (for
    children started from a thread other than the parent's main thread)."""
    if use_signal:
        set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid, poll_seconds),
                     name="shardloader-parent-watch", daemon=True).start()


def started_from_main_thread() -> bool:
    """Whether a child started now may rely on the parent-death signal (see module doc)."""
    return threading.current_thread() is threading.main_thread()
