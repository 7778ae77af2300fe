"""Real runs of the scripts the trainer-integration tests drive (examples/*.py, the imagenet
recorder): started in subprocesses on this checkout's code, run to their end or SIGKILLed with
every process they started once they print a given line, and what they recorded read back.

Every process of a run carries MARKER=<token> in its environment (children inherit it), so that
tests/proctree.py's `with_env` finds it after a kill, orphans included: "no process is left"
is checked against the tree snapshotted before the kill and against that token. A run says on
stdout where it stands; the test waits for that line with a deadline, never for a time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from queue import Empty, SimpleQueue

import pytest

from tests.proctree import Proc, alive, descendants, wait_gone, with_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "SHARDLOADER_TEST_RUN"  # in every process of a run, orphans included
ORPHAN_DEADLINE = 10.0  # seconds for the processes of a killed run to be gone
RUN_TIMEOUT = 300.0
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def env(marker: str = "", **extra: str) -> dict[str, str]:
    """The environment of a run: this process's, with src/ and the root on PYTHONPATH, one
    OpenMP thread, MARKER=`marker` and `extra`; without the variables a launcher around the
    tests may have set (RANK, WORLD_SIZE, ...): each run is launched on its own."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    return {**base, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]),
            "OMP_NUM_THREADS": "1", MARKER: marker, **extra}


def _tail(path: str, chars: int = 4000) -> str:
    with open(path) as f:
        return f.read()[-chars:]


def run(cmd: list[str], *, cwd: str, env: dict[str, str], stderr: str,
        timeout: float = RUN_TIMEOUT) -> None:
    """Run `cmd` to its end (bounded by `timeout`), its stderr into the file `stderr`; it must
    exit with status 0 (the failure shows that file's tail)."""
    with open(stderr, "w") as err:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=err, timeout=timeout)
    assert proc.returncode == 0, _tail(stderr)


def readline(proc: subprocess.Popen, timeout: float) -> str:
    """The next line of proc's stdout, or "" when none comes within `timeout` (never hangs)."""
    lines: SimpleQueue[str] = SimpleQueue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except Empty:
        return ""


def read_to_end(proc: subprocess.Popen, timeout: float) -> str:
    """The rest of proc's stdout, to its end, read through the stream that `readline` reads.

    Not `proc.communicate(timeout=...)`: with a timeout it reads the pipe's descriptor itself,
    so the lines an earlier `readline()` pulled into the stream's buffer but did not return were
    lost (a preemption run's steps 18 and 19, printed after the line the test waited for). Past
    `timeout` the process is killed and the test fails; it never hangs."""
    rest: SimpleQueue[str] = SimpleQueue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: rest.put(proc.stdout.read()), daemon=True).start()
    try:
        out = rest.get(timeout=timeout)
    except Empty:
        proc.kill()
        proc.wait()
        pytest.fail(f"pid {proc.pid}: its output did not end within {timeout:g} s")
    proc.wait(timeout)
    return out


def _sigkill(procs: Iterable[Proc]) -> None:
    for p in procs:
        if alive(p):  # (pid, start time): never a recycled pid
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def kill_marked(marker: str) -> None:
    """SIGKILL every live process that carries MARKER=`marker`."""
    _sigkill(with_env(MARKER, marker))


def survivors(marker: str, procs: Sequence[Proc] = (), timeout: float = ORPHAN_DEADLINE) -> list[Proc]:
    """Those of `procs` and of the processes carrying MARKER=`marker` still alive `timeout`
    seconds on (polled until all are gone). They are SIGKILLed so as not to leak into later
    tests; the caller asserts that there are none."""
    left = wait_gone([*procs, *with_env(MARKER, marker)], timeout)
    _sigkill(left)
    return left


def describe(procs: Iterable[Proc]) -> str:
    return "; ".join(p.describe() for p in procs)


def run_and_kill(cmd: list[str], *, cwd: str, env: dict[str, str], stderr: str, announce: str,
                 at_least: int, deadline: float = 240.0) -> None:
    """Start `cmd` in a session of its own, its stderr into the file `stderr`, its processes
    marked with a fresh token; once a line of its stdout ends with `announce` (another rank's
    output may precede it on that line), SIGKILL every process below it and then its group
    (torchrun's ranks run in sessions of their own: the whole tree, not just the group). At
    least `at_least` processes must be below it then; it must end by that SIGKILL, and no
    process of the run may be left within ORPHAN_DEADLINE seconds.

    Its stdin is a pipe the test never writes to, closed at the end: a script parked on it
    waits there for the kill, and reads end of file should the test be gone."""
    marker = uuid.uuid4().hex
    with open(stderr, "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env={**env, MARKER: marker}, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    try:
        end = time.monotonic() + deadline
        while True:
            line = readline(proc, max(0.0, end - time.monotonic()))
            if not line:  # end of file, or the deadline passed
                why = "timed out" if time.monotonic() >= end else "its output ended"
                pytest.fail(f"no {announce!r} ({why}, rc={proc.poll()}): " + _tail(stderr, 3000))
            if line.rstrip("\n").endswith(announce):
                break
        tree = descendants(proc.pid)
        assert len(tree) >= at_least, [p.describe() for p in tree]
        _sigkill(tree)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        left = survivors(marker, tree)
        assert not left, "alive after the SIGKILL: " + describe(left)
    finally:
        kill_marked(marker)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        assert proc.stdin is not None
        proc.stdin.close()


def records(path: str) -> list[dict]:
    """The complete lines of a JSONL record, parsed (a SIGKILL may cut the last one short)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def complete_steps(checkpoint_dir: str) -> list[int]:
    """The steps of the complete `step-NNNNNN` checkpoints in `checkpoint_dir` (not `.partial`)."""
    names = os.listdir(checkpoint_dir)
    return sorted(int(n[5:]) for n in names if n.startswith("step-") and not n.endswith(".partial"))


def stitched(template: str, bounds: list[int], rank: int) -> list[dict]:
    """Rank `rank`'s per-step lines of a chain of runs, segment i's read from
    `template.format(segment=i, rank=rank)`: segment i resumed from the checkpoint at step
    bounds[i] and must have trained steps bounds[i]+1 .. bounds[i+1]; its lines after
    bounds[i+1] (past the checkpoint the next segment resumed from) are left out."""
    got: list[dict] = []
    for segment in range(len(bounds) - 1):
        lines = records(template.format(segment=segment, rank=rank))
        kept = [line for line in lines if line["step"] <= bounds[segment + 1]]
        assert [line["step"] for line in kept] == list(range(bounds[segment] + 1, bounds[segment + 1] + 1)), (
            f"rank {rank}, segment {segment}: did not run from step {bounds[segment] + 1}")
        got.extend(kept)
    return got


def assert_same_lines(got: list[dict], want: list[dict], what: str) -> None:
    """The same per-step lines, in order; the message names the first step and field that differ."""
    for g, w in zip(got, want):
        differ = [key for key in w if g.get(key) != w[key]]
        assert not differ, f"{what}: step {w['step']} differs in {differ}: {g} vs {w}"
    assert len(got) == len(want), f"{what}: {len(got)} steps, expected {len(want)}"
