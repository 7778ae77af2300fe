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

import os
import sys

import pytest
from torch.distributed.checkpoint import FileSystemReader

from shardloader.ingest.writer import write_shards
from shardloader.synthetic import make_image_samples
from tests import integration_runs as runs

EXAMPLE = os.path.join(runs.ROOT, "examples", "dcp_train.py")
RANKS, SAMPLES, BATCH = 2, 48, 4  # 6 steps an epoch
STEPS, EVERY = 18, 4


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


def _run(cmd: list[str], out: str) -> None:
    runs.run(cmd, cwd=runs.ROOT, env=runs.env(), stderr=os.path.join(out, "stderr.txt"))


def _run_and_kill(cmd: list[str], out: str, kill_step: int) -> None:
    """Start the run, which stops after step `kill_step` (every rank waits there, so no
    further checkpoint can complete); when rank 0 says so, SIGKILL every process of the run;
    then none may be left within seconds."""
    runs.run_and_kill(cmd, cwd=runs.ROOT, env=runs.env(), announce=f"STEP {kill_step}",
                      at_least=2 * RANKS,  # the ranks and their workers
                      stderr=os.path.join(out, "killed-stderr.txt"))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> list[list[dict]]:
    out = str(tmp_path_factory.mktemp("dcp-ref"))
    _run(_command(data, out, "run"), out)
    lines = [runs.records(os.path.join(out, f"run-{r}.jsonl")) for r in range(RANKS)]
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
        assert runs.complete_steps(os.path.join(out, "ckpt")) == list(range(EVERY, saved + 1, EVERY))
        metadata = FileSystemReader(os.path.join(out, "ckpt", f"step-{saved:06d}")).read_metadata()
        keys = set(metadata.state_dict_metadata)
        assert {f"app.loader.dp_rank_{r}" for r in range(RANKS)} <= keys  # one per rank, none dropped
        assert {"app.model.weight", "app.optim.state.weight.momentum_buffer"} <= keys
    _run(_command(data, out, f"segment{len(kills)}"), out)  # the same command each time

    bounds = [0] + [saved for _, saved in kills] + [STEPS]
    for rank in range(RANKS):
        got = runs.stitched(os.path.join(out, "segment{segment}-{rank}.jsonl"), bounds, rank)
        runs.assert_same_lines(got, reference[rank], f"rank {rank}")
