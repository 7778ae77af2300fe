"""Cluster resizing end to end (issue 40): a run on 4 ranks (two simulated nodes of 2 ranks, each
node with its own cache, one dataset on loopback S3; FSDP2 `fully_shard` over gloo on CPU) is
SIGKILLed, resumes on 2 ranks, is SIGKILLed again and resumes on 8, through the Checkpointer
(DCP: model and AdamW state sharded by FSDP2, resharded on load to the new world size).

What must hold (tests/dist/resize_train.py records it):

* the loader is exact: the global sequence of each step (rank r's i-th sample is global position
  r + W * i of the step) and the augmented crops equal an uninterrupted 4-rank run's, step by
  step, and each epoch reads every sample once (the global batch, 8, stays fixed);
* model and optimizer are resharded exactly: the full state each resumed run restored, gathered
  from its ranks, equals bitwise the one the killed run gathered when it saved that checkpoint;
* training goes on: the final model is close to the uninterrupted run's (not equal: gradients are
  averaged over 2 or 8 ranks instead of 4, which rounds differently).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from shardloader.ingest.writer import write_shards
from tests import integration_runs as runs
from tests.sample_transforms import make_samples

SCRIPT = os.path.join(runs.ROOT, "tests", "dist", "resize_train.py")
SAMPLES, GLOBAL_BATCH = 96, 8  # 12 steps an epoch
STEPS, EVERY = 24, 4
# (ranks, killed after step, the checkpoint the next run resumes from)
SEGMENTS = [(4, 10, 8), (2, 18, 16), (8, None, STEPS)]


def _command(ranks: int, name: str, url: str, endpoint: str, out: str, ckpt: str, wait_after: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            SCRIPT, "--url", url, "--endpoint", endpoint, "--cache-root", os.path.join(out, "caches"),
            "--ckpt", ckpt, "--out", out, "--name", name, "--steps", str(STEPS), "--every", str(EVERY),
            "--wait-after", str(wait_after)]


def _global_steps(out: str, name: str, ranks: int) -> list[dict]:
    """Per step: the epoch and the global sequence of (sample, crop), rank r's i-th sample at
    position r + ranks * i."""
    lines = [runs.records(os.path.join(out, f"{name}-{r}.jsonl")) for r in range(ranks)]
    steps = []
    for per_rank in zip(*lines, strict=True):
        assert len({line["step"] for line in per_rank}) == 1, per_rank
        merged: list = [None] * GLOBAL_BATCH
        for r, line in enumerate(per_rank):
            for i, pair in enumerate(zip(line["indices"], line["crops"], strict=True)):
                merged[r + ranks * i] = pair
        steps.append({"step": per_rank[0]["step"], "epoch": per_rank[0]["epoch"], "samples": merged})
    return steps


def _saved_by(ckpt: str, step: int) -> tuple[set[str], int]:
    """The per-rank part files of checkpoint `step` in `ckpt`, and the most chunks DCP keeps of
    one model weight (one per rank that holds a shard of it: FSDP2 saves each shard once)."""
    (folder,) = [n for n in os.listdir(ckpt) if n.startswith("step-") and int(n.split("-")[1]) == step
                 and os.path.exists(os.path.join(ckpt, n, "manifest.json"))]
    metadata = FileSystemReader(os.path.join(ckpt, folder)).read_metadata()
    chunks = max(len(item.chunks) for key, item in metadata.state_dict_metadata.items()
                 if key.startswith("model") and key.endswith("weight"))
    return {n for n in os.listdir(os.path.join(ckpt, folder)) if n.startswith("rank-")}, chunks


def _states_equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_states_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow  # ~3 min: four torchrun launches (4, 4, 2 and 8 ranks)
def test_resize_4_to_2_to_8_ranks_resumes_exactly(tmp_path, s3_server):
    data = str(tmp_path / "ds")
    write_shards(make_samples(SAMPLES), data, shard_samples=6)  # 16 shards
    url = s3_server.upload_dir(data, s3_server.create_bucket(), "ds")
    out = str(tmp_path / "out")
    os.makedirs(out)
    env = runs.env()

    runs.run(_command(4, "reference", url, s3_server.endpoint, out, str(tmp_path / "ckpt-reference")),
             cwd=runs.ROOT, env=env, stderr=os.path.join(out, "reference-stderr.txt"))
    reference = _global_steps(out, "reference", 4)
    assert [s["step"] for s in reference] == list(range(1, STEPS + 1))
    for epoch in (0, 1):  # every sample once an epoch
        seen = sorted(i for s in reference if s["epoch"] == epoch for i, _ in s["samples"])
        assert seen == list(range(SAMPLES))

    ckpt = str(tmp_path / "ckpt")
    got: list[dict] = []
    resumed_from = 0
    for segment, (ranks, kill_after, saved) in enumerate(SEGMENTS):
        name = f"segment{segment}"
        cmd = _command(ranks, name, url, s3_server.endpoint, out, ckpt, wait_after=kill_after or 0)
        if kill_after is None:
            runs.run(cmd, cwd=runs.ROOT, env=env, stderr=os.path.join(out, f"{name}-stderr.txt"))
        else:
            runs.run_and_kill(cmd, cwd=runs.ROOT, env=env, stderr=os.path.join(out, f"{name}-stderr.txt"),
                              announce=f"STEP {kill_after}", at_least=ranks)
        if segment:  # restored on `ranks` ranks what the previous run saved on its own
            loaded = torch.load(os.path.join(out, f"{name}-loaded.pt"), weights_only=True)
            saved_state = torch.load(os.path.join(out, f"segment{segment - 1}-saved-{resumed_from}.pt"),
                                     weights_only=True)
            assert loaded["step"] == resumed_from
            assert _states_equal(loaded, saved_state), f"{name}: the state restored on {ranks} ranks differs"
        if kill_after is not None:  # the checkpoint the next run resumes from, saved by `ranks` ranks
            parts, chunks = _saved_by(ckpt, saved)
            assert {f"rank-{r:05d}.json" for r in range(ranks)} <= parts and chunks == ranks, (parts, chunks)
        steps = _global_steps(out, name, ranks)
        kept = [s for s in steps if s["step"] <= saved]
        assert [s["step"] for s in kept] == list(range(resumed_from + 1, saved + 1)), name
        got.extend(kept)
        resumed_from = saved

    for g, want in zip(got, reference, strict=True):
        assert g == want, f"step {want['step']}: the resized runs read another global batch"

    final = torch.load(os.path.join(out, f"segment{len(SEGMENTS) - 1}-final.pt"), weights_only=True)
    expected = torch.load(os.path.join(out, "reference-final.pt"), weights_only=True)
    assert final["step"] == expected["step"] == STEPS
    for key, value in expected["model"].items():
        torch.testing.assert_close(final["model"][key], value, rtol=1e-3, atol=1e-5)
