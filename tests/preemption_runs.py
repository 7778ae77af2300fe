"""Runs of `tests/preempt_train.py` that a test signals at a chosen moment.

A run is started in a session of its own with its processes marked (`integration_runs.env`),
parks at `--hold WHAT=FIFO` moments, and says on stdout where it stands; the test reads those
lines with a deadline (never a sleep), signals the run, opens the FIFO to let it go on, and
times the run from the signal to its exit.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

import pytest

from tests.integration_runs import env, read_to_end, readline, survivors

LINE_TIMEOUT = 120.0


@dataclass
class Run:
    proc: subprocess.Popen
    marker: str
    stderr: str
    lines_dir: str
    lines: list[str] = field(default_factory=list)
    signalled_at: float | None = None

    def expect(self, ending: str, timeout: float = LINE_TIMEOUT) -> str:
        """Read lines until one ends with `ending` (returned); fail at end of output or timeout."""
        end = time.monotonic() + timeout
        while True:
            line = readline(self.proc, max(0.0, end - time.monotonic()))
            if not line:
                pytest.fail(f"no {ending!r} (rc={self.proc.poll()}); seen {self.lines[-5:]}; "
                            f"stderr: {open(self.stderr).read()[-3000:]}")
            self.lines.append(line.rstrip("\n"))
            if self.lines[-1].endswith(ending):
                return self.lines[-1]

    def pid_of(self, rank: int | None = None) -> int:
        head = "pid " if rank is None else f"rank {rank} pid "
        return int(next(line for line in self.lines if line.startswith(head)).split()[-1])

    def signal(self, pid: int, sig: int = signal.SIGTERM, *, group: bool = False) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()
        (os.killpg if group else os.kill)(pid, sig)

    def finish(self, timeout: float = 240.0) -> tuple[int, float | None]:
        """(exit status, seconds from the first signal to the exit); the rest of its output is
        read into `lines`, and no process of the run may be left."""
        out = read_to_end(self.proc, timeout)  # with what expect()'s reads left buffered
        exited = time.monotonic()
        self.lines += out.splitlines()
        assert survivors(self.marker) == [], "a process of the run outlived it"
        took = None if self.signalled_at is None else exited - self.signalled_at
        return self.proc.returncode, took

    def steps(self, rank: int | None = None) -> list[tuple[int, str]]:
        """(step, batch digest) of every step the run (or rank `rank`, from its own file)
        printed."""
        head = "step " if rank is None else f"rank {rank} step "
        lines = self.lines
        if rank is not None:
            with open(os.path.join(self.lines_dir, f"rank-{rank}.txt")) as f:
                lines = f.read().splitlines()
        return [(int(p[-2]), p[-1]) for p in (line.split() for line in lines
                                                if line.startswith(head))]


def start(cmd: list[str], cwd: str) -> Run:
    marker = uuid.uuid4().hex
    stderr = os.path.join(cwd, f"stderr-{marker}")
    lines_dir = os.path.join(cwd, f"lines-{marker}")
    os.makedirs(lines_dir)
    with open(stderr, "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env(marker, PREEMPT_LINES_DIR=lines_dir),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                text=True, start_new_session=True)
    return Run(proc, marker, stderr, lines_dir)


def train_cmd(root: str, data: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "tests.preempt_train", root, data, *args]


def torchrun_cmd(root: str, data: str, *args: str, ranks: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "--max-restarts=0", "-m", "tests.preempt_train",
            root, data, *args]


def fifo(directory: str) -> str:
    path = os.path.join(directory, f"hold-{uuid.uuid4().hex[:8]}")
    os.mkfifo(path)
    return path


def release(path: str, run: Run, timeout: float = LINE_TIMEOUT) -> None:
    """Open the FIFO `path` for writing: the run parked on it goes on. The run printed `held`
    just before it opens its end; until it has, opening ours fails (ENXIO) and is retried."""
    end = time.monotonic() + timeout
    while True:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            return
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > end or run.proc.poll() is not None:
                raise
            time.sleep(0.001)  # the reader is between its print and its open
