"""Hugging Face Accelerate with shardloader's Loader (examples/accelerate_train.py), for real: a
run SIGKILLed mid-epoch and started again resumes from its last `accelerator.save_state` and
trains on exactly the batches of a run that was never interrupted (I4, I8, I10).

The example runs in subprocesses, in one process and in two under real torchrun (gloo, CPU),
with a process worker per rank. Each step appends a line per rank: the batch's global sample
indices, a SHA-256 of its bytes (the augmented images and labels) and the loss as a float's
hex, so equal lines mean the same samples, the same bytes and the same weights before the step.
A run to be killed stops after step KILL (`--wait-after`, so that no later checkpoint can
complete); the test then SIGKILLs its whole process tree, checks that no process is left
(torchrun's ranks run in sessions of their own), and compares the lines of the killed runs up
to their last complete checkpoints plus those of the last run with the reference, rank by
rank, in order.
"""

from __future__ import annotations

import os
import sys

import pytest

from shardloader.ingest.writer import write_shards
from shardloader.synthetic import make_image_samples
from tests import integration_runs as runs

pytest.importorskip("accelerate")

EXAMPLE = os.path.join(runs.ROOT, "examples", "accelerate_train.py")
SAMPLES, BATCH = 48, 4  # 12 steps an epoch in one process, 6 in two
STEPS, EVERY = 18, 4


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("accelerate-data"))
    write_shards(make_image_samples(SAMPLES, min_size=20, max_size=28, seed=2), out, shard_samples=12)
    return out


def _command(nproc: int, data: str, out: str, name: str, wait_after: int = 0) -> list[str]:
    # --standalone: torchrun's store binds a free port itself (a port picked here beforehand
    # could be taken by another test's torchrun before it binds).
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, EXAMPLE, "--data", data, "--checkpoint-dir", os.path.join(out, "ckpt"),
            "--steps", str(STEPS), "--every", str(EVERY), "--batch-size", str(BATCH), "--workers", "1",
            "--cpu", "--wait-after", str(wait_after), "--record", os.path.join(out, name + "-{rank}.jsonl")]


def _run(cmd: list[str], out: str) -> None:
    runs.run(cmd, cwd=runs.ROOT, env=runs.env(), stderr=os.path.join(out, "stderr.txt"))


def _run_and_kill(cmd: list[str], out: str, kill_step: int, nproc: int) -> None:
    """Start the run, which stops after step `kill_step` (every process waits there, so no
    further checkpoint can complete); when its main process says so, SIGKILL every process of
    the run; then none may be left within seconds."""
    # Below the process started: its loader worker; under torchrun, the ranks and theirs.
    runs.run_and_kill(cmd, cwd=runs.ROOT, env=runs.env(), announce=f"STEP {kill_step}",
                      at_least=1 if nproc == 1 else 2 * nproc,
                      stderr=os.path.join(out, "killed-stderr.txt"))


@pytest.fixture(scope="module")
def references(data, tmp_path_factory):
    """The uninterrupted run's lines, per rank, for each process count (computed once)."""
    found: dict[int, list[list[dict]]] = {}

    def get(nproc: int) -> list[list[dict]]:
        if nproc not in found:
            out = str(tmp_path_factory.mktemp(f"accelerate-ref-{nproc}"))
            _run(_command(nproc, data, out, "run"), out)
            found[nproc] = [runs.records(os.path.join(out, f"run-{r}.jsonl")) for r in range(nproc)]
            for lines in found[nproc]:
                assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
        return found[nproc]

    return get


@pytest.mark.parametrize("nproc,kills", [
    (1, [(10, 8)]),  # killed at step 10, resumes from step 8: the middle of epoch 0 (12 steps)
    # Two processes, 6 steps an epoch: killed at 10, resumes from 8 (the middle of epoch 1);
    # killed again at 14, resumes from 12, saved on epoch 1's last batch, into epoch 2.
    (2, [(10, 8), (14, 12)]),
], ids=["1-process", "2-processes"])
def test_killed_run_resumes_with_the_uninterrupted_batches(data, references, tmp_path, nproc, kills):
    reference = references(nproc)
    out = str(tmp_path)
    for segment, (kill_step, saved) in enumerate(kills):
        _run_and_kill(_command(nproc, data, out, f"segment{segment}", kill_step), out, kill_step, nproc)
        assert runs.complete_steps(os.path.join(out, "ckpt")) == list(range(EVERY, saved + 1, EVERY))
        files = set(os.listdir(os.path.join(out, "ckpt", f"step-{saved:06d}")))
        # Accelerate's files; the loader's cursor is the one registered custom object.
        assert {"model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl"} <= files
        assert {f"random_states_{r}.pkl" for r in range(nproc)} <= files
    _run(_command(nproc, data, out, f"segment{len(kills)}"), out)  # the same command each time

    bounds = [0] + [saved for _, saved in kills] + [STEPS]
    for rank in range(nproc):
        got = runs.stitched(os.path.join(out, "segment{segment}-{rank}.jsonl"), bounds, rank)
        runs.assert_same_lines(got, reference[rank], f"rank {rank}")
