"""torch.distributed.checkpoint (DCP), torchtitan-style, with shardloader's Loader
(examples/dcp_train.py), for real: two ranks under torchrun (gloo, CPU), SIGKILLed mid-epoch and
started again, resume from the last `dcp.save` and train on exactly the batches of a run that
was never interrupted (I4, I8, I10).

Each step appends a line per rank: the batch's global sample indices, a SHA-256 of its bytes
(the augmented images and labels) and the loss as a float's hex. A run to be killed stops
after step KILL (`--wait-after`, so that no later checkpoint can complete); the test then
SIGKILLs its whole process tree (torchrun's ranks run in sessions of their own; each rank has a
process worker), checks that no process is left, and compares the lines of the killed runs up
to their last complete checkpoints plus those of the last run with the reference, rank by
rank, in order. The checkpoint itself is read back to check that each rank's
loader state sits under its own key.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from torch.distributed.checkpoint import FileSystemReader

from shardloader.ingest.writer import write_shards
from shardloader.synthetic import make_image_samples
from tests.proctree import descendants, wait_gone, with_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "dcp_train.py")
RANKS, SAMPLES, BATCH = 2, 48, 4  # 6 steps an epoch
STEPS, EVERY = 18, 4
MARKER = "SHARDLOADER_TEST_RUN"  # in every process of a run, orphans included
ORPHAN_DEADLINE = 10.0


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("dcp-data"))
    write_shards(make_image_samples(SAMPLES, min_size=20, max_size=28, seed=4), out, shard_samples=12)
    return out


def _command(data: str, out: str, name: str, wait_after: int = 0) -> list[str]:
    # --standalone: torchrun's store binds a free port itself (a port picked here beforehand
    # could be taken by another test's torchrun before it binds).
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
            EXAMPLE, "--data", data, "--checkpoint-dir", os.path.join(out, "ckpt"), "--steps", str(STEPS),
            "--every", str(EVERY), "--batch-size", str(BATCH), "--workers", "1",
            "--wait-after", str(wait_after), "--record", os.path.join(out, name + "-{rank}.jsonl")]


def _env(marker: str = "") -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]),
            "OMP_NUM_THREADS": "1", MARKER: marker}


def _run(cmd: list[str], out: str) -> None:
    with open(os.path.join(out, "stderr.txt"), "w") as stderr:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=stderr,
                              text=True, timeout=300)
    assert proc.returncode == 0, open(os.path.join(out, "stderr.txt")).read()[-4000:]


def _run_and_kill(cmd: list[str], out: str, kill_step: int) -> None:
    """Start the run, which stops after step `kill_step` (every rank waits there, so no
    further checkpoint can complete); when rank 0 says so, SIGKILL every process of the run;
    then none may be left within seconds."""
    marker = uuid.uuid4().hex
    with open(os.path.join(out, "killed-stderr.txt"), "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(marker), stdout=subprocess.PIPE, stderr=stderr,
                                text=True, start_new_session=True)
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        deadline, want = time.monotonic() + 240, f"STEP {kill_step}"
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no {want!r} within 240 s (rc={proc.poll()})")
            if line.strip() == want:
                break
        tree = descendants(proc.pid)
        assert len(tree) >= 2 * RANKS, [p.describe() for p in tree]  # the ranks and their workers
        for p in tree:  # torchrun's ranks are in sessions of their own: kill the whole tree
            os.kill(p.pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        left = wait_gone(tree + with_env(MARKER, marker), ORPHAN_DEADLINE)
        assert not left, "alive after the SIGKILL: " + "; ".join(p.describe() for p in left)
    finally:
        for p in with_env(MARKER, marker):
            os.kill(p.pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


def _lines(path: str) -> list[dict]:
    """The complete lines of a record file (a SIGKILL may cut the last one short)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _complete_steps(out: str) -> list[int]:
    names = os.listdir(os.path.join(out, "ckpt"))
    return sorted(int(n[5:]) for n in names if n.startswith("step-") and not n.endswith(".partial"))


def assert_same_lines(got: list[dict], want: list[dict], what: str) -> None:
    """The same per-step lines, in order; the message names the first step and field that differ."""
    for g, w in zip(got, want):
        differ = [key for key in w if g.get(key) != w[key]]
        assert not differ, f"{what}: step {w['step']} differs in {differ}: {g} vs {w}"
    assert len(got) == len(want), f"{what}: {len(got)} steps, expected {len(want)}"


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> list[list[dict]]:
    out = str(tmp_path_factory.mktemp("dcp-ref"))
    _run(_command(data, out, "run"), out)
    lines = [_lines(os.path.join(out, f"run-{r}.jsonl")) for r in range(RANKS)]
    for rank_lines in lines:
        assert [line["step"] for line in rank_lines] == list(range(1, STEPS + 1))
    return lines


def test_killed_ranks_resume_with_the_uninterrupted_batches(data, reference, tmp_path):
    # Killed at step 10: resumes from 8, the middle of epoch 1; killed again at 14: resumes
    # from 12, saved on epoch 1's last batch, into epoch 2.
    kills = [(10, 8), (14, 12)]
    out = str(tmp_path)
    for segment, (kill_step, saved) in enumerate(kills):
        _run_and_kill(_command(data, out, f"segment{segment}", kill_step), out, kill_step)
        assert _complete_steps(out) == list(range(EVERY, saved + 1, EVERY))
        metadata = FileSystemReader(os.path.join(out, "ckpt", f"step-{saved:06d}")).read_metadata()
        keys = set(metadata.state_dict_metadata)
        assert {f"app.loader.dp_rank_{r}" for r in range(RANKS)} <= keys  # one per rank, none dropped
        assert {"app.model.weight", "app.optim.state.weight.momentum_buffer"} <= keys
    _run(_command(data, out, f"segment{len(kills)}"), out)  # the same command each time

    bounds = [0] + [saved for _, saved in kills] + [STEPS]
    for rank in range(RANKS):
        got: list[dict] = []
        for segment in range(len(kills) + 1):
            lines = _lines(os.path.join(out, f"segment{segment}-{rank}.jsonl"))
            kept = [line for line in lines if line["step"] <= bounds[segment + 1]]
            assert [line["step"] for line in kept] == list(range(bounds[segment] + 1, bounds[segment + 1] + 1)), (
                f"rank {rank}, segment {segment}: did not run from step {bounds[segment] + 1}")
            got.extend(kept)
        assert_same_lines(got, reference[rank], f"rank {rank}")
