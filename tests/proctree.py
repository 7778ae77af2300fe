"""Process trees from /proc: which processes descend from a pid, and whether they still live.

A test snapshots the tree before it kills a process (after the kill, orphans are re-parented
and no longer findable from it), then polls with a deadline until every snapshotted process is
gone. A process is identified by (pid, start time) so that a recycled pid is never mistaken
for a survivor; a zombie (exited, not yet reaped) counts as gone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Proc:
    pid: int
    start: int  # clock ticks after boot (field 22 of /proc/<pid>/stat)
    cmdline: str

    def describe(self) -> str:
        return f"pid {self.pid}: {self.cmdline[:160]}"


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of `pid`, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and ')'
    return rest[0], int(rest[1]), int(rest[19])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def descendants(root: int) -> list[Proc]:
    """Every live process below `root` (not `root` itself), found through parent pids."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[0] != "Z":
                children.setdefault(stat[1], []).append(int(name))
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        stat = _stat(pid)
        if stat is not None:
            found.append(Proc(pid, stat[2], _cmdline(pid)))
        todo.extend(children.get(pid, ()))
    return found


def alive(proc: Proc) -> bool:
    stat = _stat(proc.pid)
    return stat is not None and stat[2] == proc.start and stat[0] != "Z"


def wait_gone(procs: list[Proc], timeout: float) -> list[Proc]:
    """Poll until none of `procs` is alive or `timeout` passes; returns the survivors."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def kill_group(proc: subprocess.Popen, tree: Sequence[Proc] = ()) -> None:
    """Clean up after a test (in its `finally`): the snapshotted tree's survivors (torchrun's
    ranks run in sessions of their own), what is below the trainer now, and the trainer's
    session (`proc` must have been started with `start_new_session=True`)."""
    for p in [*tree, *descendants(proc.pid)]:
        if alive(p):
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def with_env(name: str, value: str) -> list[Proc]:
    """Live processes whose environment holds `name=value`. Children inherit the environment,
    so a marker set for a script finds every process it started, orphans included."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
        except OSError:
            continue
        stat = _stat(int(entry))
        if stat is not None and stat[0] != "Z":
            found.append(Proc(int(entry), stat[2], _cmdline(int(entry))))
    return found


def answer_from_fork(target: Callable[..., None], *args: Any, timeout: float = 30) -> tuple[int, Any]:
    """(pid, answer): `target(*args, conn)` run in a forked child, which sends its answer on
    `conn`; waits up to `timeout` for it, and for the child to end."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(*args, child))
    process.start()
    child.close()  # the child's end lives in the child only: its death is end-of-file here
    try:
        assert parent.poll(timeout), f"the forked child ({target.__name__}) did not answer"
        try:
            return process.pid, parent.recv()
        except EOFError:
            process.join(10)
            raise AssertionError(f"the forked child ({target.__name__}) ended (exit code "
                                 f"{process.exitcode}) without answering") from None
    finally:
        process.join(10)
