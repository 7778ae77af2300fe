"""Processes shardloader starts die with the training process (invariant I11).

A training process can die by any signal, SIGKILL included (preemption, the OOM killer,
`kill -9`), and then runs no cleanup at all. Its children must notice on their own. A child
watches the training process itself, never merely "its parent": under multiprocessing's
"forkserver" start method a worker's parent is the fork server, a process that outlives the
training process for as long as any of its children holds the server's "alive" pipe (each
of them does). The training process names itself with `liveness.this_process()` (its pid and
its start time, so that a pid recycled after its death is never taken for it) and the child calls
`die_with(that)` first thing:

- Linux 5.3 and later: a pidfd of the training process (`os.pidfd_open`), opened first and
  then checked to be that process (same start time, or still this child's parent). A pidfd
  names one process for good and becomes readable when it ends (a zombie counts as ended), so
  a daemon thread blocked on it exits the child without polling and without any pid race.
- Where there is no pidfd (older kernels, a seccomp filter that refuses it, other systems), a
  daemon thread checks every `PARENT_POLL_SECONDS` that the process is still there
  (`shardloader.runtime.liveness.is_alive`: the pid, with the same start time, no zombie),
  and for a parent that it still is this child's parent (`os.getppid()`).
- And where the training process is the child's parent (fork, spawn, subprocess), the kernel
  kills the child at once when it dies (`prctl(PR_SET_PDEATHSIG)`). The kernel ties that
  signal to the *thread* that forked the child: a worker pool forked by a short-lived thread
  would be killed when that thread ends. So children are started through `start_children`:
  from the main thread directly, from any other thread on one lasting thread of this process
  (`shardloader-child-starter`, which ends only with the process), and the signal is armed for
  every one of them. Under forkserver the parent is the fork server, so it is not armed there.

Why the signal matters even with the watch thread: a thread of the child needs the GIL to act
on the training process's end, and a child busy in C code that holds the GIL (a big-int power,
a regular expression, many C extensions) does not give it up until that call returns (tests/
test_worker_startup.py: a worker in such a call outlived its SIGKILLed trainer by as long as
the call ran). The kernel's signal needs nothing from the child.

`die_with_parent(pid)` is the same for a child that was handed its parent's pid (a script
started with `subprocess`): there the identity is "this process's parent".
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import os
import queue
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from shardloader.runtime.liveness import ProcessIdentity, is_alive

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
PARENT_POLL_SECONDS = 0.5


def _still_there(process: ProcessIdentity, parent: bool) -> bool:
    """Whether the watched `process` still runs (`shardloader.runtime.liveness.is_alive`);
    `parent`: it was this child's parent when the watch began, and is watched through
    `os.getppid()` as well, which is exact: a re-parented child never gets that pid back."""
    return is_alive(process) and (not parent or os.getppid() == process.pid)


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


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of `pid`; None where pidfds are not available. Exits this process when `pid`
    no longer exists."""
    pidfd_open = getattr(os, "pidfd_open", None)  # Linux, Python 3.9+
    if pidfd_open is None:
        return None
    try:
        return pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)  # already gone
    except OSError:  # ENOSYS (kernel < 5.3), EPERM (seccomp), ...
        return None


def _wait_for_end(pidfd: int, process: ProcessIdentity, parent: bool, poll_seconds: float) -> None:
    """Block until the pidfd's process ends, then exit this process."""
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        while not poller.poll():  # no timeout: wakes only when the process has ended
            pass
    except OSError:  # pragma: no cover - a pidfd that cannot be waited on: poll instead
        _poll_until_gone(process, parent, poll_seconds)
    os._exit(1)  # the training process is gone; nobody is left to read what we would produce


def _poll_until_gone(process: ProcessIdentity, parent: bool, poll_seconds: float) -> None:
    while _still_there(process, parent):
        time.sleep(poll_seconds)
    os._exit(1)


def die_with(process: ProcessIdentity, *, use_signal: bool = True,
             poll_seconds: float = PARENT_POLL_SECONDS) -> None:
    """Make this (child) process exit when `process` dies, by any signal; exit at once when it
    already has. Call it first thing in the child.

    `use_signal=False` skips the kernel's parent-death signal (for children started from a
    thread other than the parent's main thread); it is armed only where `process` is this
    process's parent anyway."""
    parent = os.getppid() == process.pid
    if use_signal and parent:
        set_parent_death_signal(signal.SIGKILL)
    pidfd = _open_pidfd(process.pid)
    # After the signal was armed and the pidfd opened: the process (still) is the one named,
    # so the pidfd names it, and a death before the signal was armed is seen here.
    if not _still_there(process, parent):
        os._exit(1)
    if pidfd is not None:
        target, args = _wait_for_end, (pidfd, process, parent, poll_seconds)
    else:
        target, args = _poll_until_gone, (process, parent, poll_seconds)
    threading.Thread(target=target, args=args, name="shardloader-parent-watch", daemon=True).start()


def die_with_parent(parent_pid: int, *, use_signal: bool = True,
                    poll_seconds: float = PARENT_POLL_SECONDS) -> None:
    """`die_with` the parent `parent_pid` (the pid the parent had before it started this
    child, e.g. passed on the command line); exits at once when this process's parent is no
    longer `parent_pid` (it died before the call)."""
    die_with(ProcessIdentity(parent_pid, None), use_signal=use_signal, poll_seconds=poll_seconds)


def started_from_main_thread() -> bool:
    """Whether a child started now from this thread may rely on the parent-death signal (see
    module doc; children started through `start_children` always may)."""
    return threading.current_thread() is threading.main_thread()


class _Starter:
    """The lasting thread `start_children` runs its work on: a daemon blocked on its queue
    between jobs, so that it ends only when this process does (never joined: interpreter exit
    does not wait for it)."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # a forked child has no such thread: it makes its own
        self.jobs: queue.SimpleQueue[tuple[concurrent.futures.Future, Callable[[], object]]] = \
            queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="shardloader-child-starter", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            future, function = self.jobs.get()
            if not future.set_running_or_notify_cancel():  # its caller gave up before it began
                continue
            try:
                future.set_result(function())
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                future.set_exception(e)


_starter: _Starter | None = None
_starter_lock = threading.Lock()


def _forget_starter_in_child() -> None:
    """A forked child has no starter thread, and another thread may have held the lock."""
    global _starter, _starter_lock
    _starter, _starter_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_starter_in_child)


def start_children(function: Callable[[], T], *, timeout: float) -> T:
    """`function()`, which starts child processes, run on a thread that lasts as long as this
    process, so that each child may arm the parent-death signal (see the module doc): on the
    main thread, at once; from any other thread, on the lasting starter thread, waited for up
    to `timeout` seconds (TimeoutError after that; the job still runs when it has begun).
    What `function` raises is raised here."""
    global _starter
    if started_from_main_thread():
        return function()
    with _starter_lock:
        if _starter is None or _starter.pid != os.getpid():
            _starter = _Starter()
        starter = _starter
    future: concurrent.futures.Future = concurrent.futures.Future()
    starter.jobs.put((future, function))
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"starting child processes took longer than {timeout} s") from None
