"""Recovery without a human under torchrun (issue 39, parts 2 and 3; 2 ranks, gloo, CPU).

The README's loop (`tests/job_train.py`) under `torchrun --max-restarts`:

- ranks SIGKILLed at 3 random moments (seeded: which rank, and how many steps after the start's
  first commit of its own the test looks for its pid), the pids read from the files the ranks write; the agent
  restarts the group by itself each time, the group resumes from its newest checkpoint and the
  job ends with the weights of an uninterrupted run, bit for bit, no process left, one attempt
  in the job account per start. Before that, the agent itself is SIGTERMed once: the launch ends
  with its ranks, and a rerun resumes (what SIGTERM saves is the preemption work's);
- a rank that hangs inside a step (its peer then waits in the step's collective): its watchdog
  (`--watchdog 2`) ends it, the agent restarts the group and the job finishes, with the same
  weights; the job account says the first attempt "hung", naming the rank and its stack.

The test waits for lines the ranks print (`start ...`, `step N`, `committed N`, `hang N`),
never for a time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid

import pytest

from shardloader.telemetry.job.account import account
from shardloader.telemetry.job.read import read_job_dir
from tests.fixtures.checkpoint import free_port
from tests.integration_runs import ROOT, env, readline, survivors
from tests.job_train import write_data
from tests.proctree import Proc, descendants, wait_gone

WORLD, BATCH, SAMPLES, EPOCHS = 2, 8, 640, 2
STEPS = EPOCHS * SAMPLES // (BATCH * WORLD)  # 80
SAVE_EVERY = 4
DEADLINE = 240.0  # for one line of output: a loaded machine starts torch slowly
SEED = 39
#: torch 2.13's agent keeps one TCPStore for the ranks of every restart, so a restarted group
#: reads the old group's addresses and fails to connect (pytorch/pytorch#135712): the ranks
#: host their own store, as docs/checkpoint.md's torchrun recipe says.
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def launch(root: str, data: str, pid_dir: str, marker: str, restarts: int,
           *extra: str) -> subprocess.Popen:
    """torchrun of the training script, in a session of its own, its stdout a pipe."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}",
           "--nnodes=1", f"--max-restarts={restarts}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "tests.job_train", root, data,
           "--batch", str(BATCH), "--epochs", str(EPOCHS), "--save-every", str(SAVE_EVERY),
           "--workers", "1", "--pid-dir", pid_dir, *extra]
    with open(os.path.join(pid_dir, "stderr"), "a") as err:
        return subprocess.Popen(cmd, cwd=ROOT, env=env(marker, **RESTARTABLE), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)


class Lines:
    """The launch's stdout read line by line, each with the monotonic time it was read."""

    def __init__(self, proc: subprocess.Popen, pid_dir: str) -> None:
        self.proc, self.pid_dir, self.seen = proc, pid_dir, []

    def until(self, want, what: str) -> str:
        while True:
            line = readline(self.proc, DEADLINE).strip()
            if not line:
                with open(os.path.join(self.pid_dir, "stderr")) as f:
                    tail = f.read()[-3000:]
                pytest.fail(f"no {what} (rc={self.proc.poll()}); stderr: {tail}")
            self.seen.append((time.monotonic(), line))
            if want(line):
                return line

    def started(self, restart: int) -> int:
        """Wait until every rank of start `restart` said so; the step they resume from."""
        steps = set()
        for _ in range(WORLD):
            line = self.until(lambda s: s.split()[:1] == ["start"] and s.split()[4] == str(restart),
                              f"start of restart {restart}")
            steps.add(int(line.rsplit(" ", 1)[-1]))
        assert len(steps) == 1, f"the ranks resumed from different steps: {steps}"
        return steps.pop()

    def step_at_least(self, step: int) -> None:
        self.until(lambda s: s.startswith("step ") and int(s.split()[1]) >= step, f"step {step}")

    def committed_after(self, step: int) -> int:
        """Wait until a checkpoint after `step` is complete; its step."""
        line = self.until(lambda s: s.startswith("committed ") and int(s.split()[1]) > step,
                          f"a commit after step {step}")
        return int(line.split()[1])


def pid_of(pid_dir: str, rank: int, restart: int) -> int:
    with open(os.path.join(pid_dir, f"rank-{rank}.json")) as f:
        record = json.load(f)
    assert record["restart"] == restart, record  # the file of this start, not an older one
    return record["pid"]


def finish(proc: subprocess.Popen, lines: Lines, marker: str, tree: dict[int, Proc]) -> None:
    """Read the launch to its end; it must exit 0, every rank saying `done`, and leave nothing."""
    done = 0
    while done < WORLD:
        done += lines.until(lambda s: s == "done", "done") == "done"
    assert proc.wait(DEADLINE) == 0
    assert wait_gone(list(tree.values()), 10.0) == [], "a process of the launch outlived it"
    assert survivors(marker) == []


def snapshot(proc: subprocess.Popen, tree: dict[int, Proc]) -> None:
    for p in descendants(proc.pid):  # the ranks and their loader workers, of every start
        tree[p.pid] = p


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("restarts") / "data")
    write_data(path, samples=SAMPLES)
    return path


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> bytes:
    """The final weights of the same job, uninterrupted."""
    base = tmp_path_factory.mktemp("reference")
    marker, weights = uuid.uuid4().hex, str(base / "weights")
    proc = launch(str(base / "ckpt"), data, str(base), marker, 0, "--weights-out", weights)
    finish(proc, Lines(proc, str(base)), marker, {})
    with open(weights, "rb") as f:
        return f.read()


@pytest.mark.slow  # five torchrun starts and the reference run: minutes on a busy machine
def test_torchrun_restarts_ranks_killed_at_random_moments_and_ends_with_the_same_weights(
        tmp_path, data, reference):
    rng = random.Random(SEED)
    root, weights = str(tmp_path / "ckpt"), str(tmp_path / "weights")
    pid_dir = str(tmp_path)
    tree: dict[int, Proc] = {}

    # 1. The agent SIGTERMed: the launch ends with its ranks; the rerun below resumes.
    marker = uuid.uuid4().hex
    proc = launch(root, data, pid_dir, marker, 3)
    lines = Lines(proc, pid_dir)
    lines.started(0)
    lines.step_at_least(lines.committed_after(0) + rng.randint(0, 2 * SAVE_EVERY))
    snapshot(proc, tree)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(DEADLINE) != 0
    assert wait_gone(list(tree.values()), 10.0) == [], "ranks outlived their SIGTERMed agent"
    assert survivors(marker) == []

    # 2. The rerun, its ranks SIGKILLed at 3 random moments; the agent restarts them each time.
    marker = uuid.uuid4().hex
    proc = launch(root, data, pid_dir, marker, 3, "--weights-out", weights)
    lines = Lines(proc, pid_dir)
    resumed, timings, killed_at = [], [], 0.0
    for restart in range(3):
        resumed.append(lines.started(restart))
        if restart:
            timings.append(lines.seen[-1][0] - killed_at)
        # a moment after this start committed progress of its own: a step, a save, a wait
        lines.step_at_least(lines.committed_after(resumed[-1]) + rng.randint(0, 2 * SAVE_EVERY))
        victim = rng.randrange(WORLD)
        snapshot(proc, tree)
        os.kill(pid_of(pid_dir, victim, restart), signal.SIGKILL)
        killed_at = time.monotonic()
    resumed.append(lines.started(3))
    timings.append(lines.seen[-1][0] - killed_at)
    finish(proc, lines, marker, tree)
    assert resumed[0] > 0 and all(a < b for a, b in zip(resumed, resumed[1:])), resumed
    with open(weights, "rb") as f:
        assert f.read() == reference, "the restarted job's weights differ from the uninterrupted run's"

    report = account(read_job_dir(root))
    endings = [a["ended"] for a in report["attempts"]]
    assert len(endings) == 5, endings  # the SIGTERMed launch, then 4 starts of the rerun
    assert endings[-1] == "finished" and "finished" not in endings[:-1], endings
    assert report["steps"]["trained"] - report["steps"]["recomputed"] == STEPS  # each once in the weights
    assert report["samples"]["trained_twice"] == report["samples"]["never_trained"] == 0
    print(f"resumed from steps {resumed}; kill -> every rank started again: "
          f"{', '.join(f'{t:.1f} s' for t in timings)}; endings {endings}")


@pytest.mark.slow
def test_a_hung_rank_ends_its_attempt_and_torchrun_restarts_the_group(tmp_path, data, reference):
    root, weights, pid_dir = str(tmp_path / "ckpt"), str(tmp_path / "weights"), str(tmp_path)
    hang_at, bound = 2 * SAVE_EVERY + 3, 2.0
    marker = uuid.uuid4().hex
    proc = launch(root, data, pid_dir, marker, 1, "--weights-out", weights, "--watchdog", str(bound),
                  "--hang-at", str(hang_at), "--hang-rank", "1")
    lines = Lines(proc, pid_dir)
    lines.started(0)
    lines.until(lambda s: s == f"hang {hang_at}", "hang")
    hung_at = lines.seen[-1][0]
    tree: dict[int, Proc] = {}
    snapshot(proc, tree)
    resumed = lines.started(1)
    restarted = lines.seen[-1][0] - hung_at
    finish(proc, lines, marker, tree)
    assert resumed == 2 * SAVE_EVERY
    with open(weights, "rb") as f:
        assert f.read() == reference

    records = read_job_dir(root)
    report = account(records)
    assert [a["ended"] for a in report["attempts"]] == ["hung", "finished"]
    first = records["attempts"][0]["ranks"]
    ends = {int(r): next(e for e in v["events"] if e["event"] == "end") for r, v in first.items()}
    hung = ends[1]  # the rank stuck in its step said so, with its stack
    assert hung["how"] == "hung", ends
    assert hung["error"].startswith("rank 1 made no step progress for "), hung["error"]
    assert "in hang_in_step" in hung["error"]
    assert hung["error"] in report["attempts"][0]["reason"]  # the report shows the stuck rank's stack
    stalled = float(hung["error"].split("for ")[1].split(" s ")[0])
    assert bound <= stalled < bound + 1.0
    print(f"hung rank seen after {stalled:.2f} s (bound {bound} s); hang -> every rank started "
          f"again: {restarted:.1f} s; rank 0 ended {ends[0]['how']!r}")


def test_restarts_through_the_agents_shared_store_are_named_as_a_hazard(monkeypatch):
    """What rank 0's Checkpointer warns of: torchrun's restart variables as torch sets them."""
    from shardloader.runtime.distenv import restart_hazard

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_hazard()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # the ranks host their store
    assert restart_hazard() is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # no restart to fail
    assert restart_hazard() is None
