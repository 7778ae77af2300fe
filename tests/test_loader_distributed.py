"""Multi-rank exact resume under real torchrun (gloo): the global sample sequence and the
augmented bytes of a run resumed with another world size equal the uninterrupted run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardloader import Dataset, Loader
from shardloader.ingest.writer import write_shards
from tests.sample_transforms import make_samples, noisy_crop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL_BATCH = 12


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist-ds")
    write_shards(make_samples(290), str(out), shard_samples=23)
    return str(out)


def _torchrun(nproc: int, out: str, data: str, batches: int, state_in: str | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "tests.dist.loader_segment", "--data", data, "--global-batch", str(GLOBAL_BATCH),
           "--batches", str(batches), "--out", out, "--workers", "1"]
    if state_in:
        cmd += ["--state-in", state_in]
    # ROOT/src first: the ranks must import the sources under test, not an installed copy.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _global_sequence(out: str, world: int) -> list[tuple[int, str]]:
    """Interleave the ranks' batches back into the global order: position p went to rank p mod W."""
    per_rank = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            per_rank.append(json.load(f))
    sequence = []
    for step in range(len(per_rank[0])):
        merged = [None] * GLOBAL_BATCH
        for r in range(world):
            batch = per_rank[r][step]
            for i, (index, crop) in enumerate(zip(batch["indices"], batch["crops"])):
                merged[r + i * world] = (index, crop)
        sequence.extend(merged)
    return sequence


def _reference(data: str, batches: int) -> list[tuple[int, str]]:
    loader = Loader(Dataset(data), batch_size=GLOBAL_BATCH, seed=5, transform=noisy_crop,
                    partitions=4, window=2, rank=0, world_size=1, shuffle=True, tail="pad")
    sequence = []
    while len(sequence) < batches * GLOBAL_BATCH:
        for batch in loader:
            sequence.extend(zip(batch["__index__"].tolist(),
                                [c.numpy().tobytes().hex() for c in batch["crop"]]))
            if len(sequence) == batches * GLOBAL_BATCH:
                break
    return sequence


@pytest.mark.parametrize("before,after", [(2, 3), (3, 1)])
def test_resume_with_another_world_size(tmp_path, dataset_dir, before, after):
    steps_per_epoch = -(-290 // GLOBAL_BATCH)  # 25: the tail is padded
    cut, total = 9, steps_per_epoch + 4  # the second segment crosses the epoch boundary
    reference = _reference(dataset_dir, total)
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    _torchrun(before, first, dataset_dir, cut)
    _torchrun(after, second, dataset_dir, total - cut, state_in=os.path.join(first, "state.json"))
    resumed = _global_sequence(first, before) + _global_sequence(second, after)
    assert [i for i, _ in resumed] == [i for i, _ in reference]
    assert resumed == reference


def test_a_loader_made_before_the_process_group_refuses_to_iterate(tmp_path):
    """Made before init_process_group, a Loader takes rank 0 of 1; iterating it once a group of
    two is active would give every rank every sample. It refuses, saying how to fix it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}
    store = str(tmp_path / "store")
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.dist.early_loader", str(r), store],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outputs = [p.communicate(timeout=120) for p in ranks]
    both = "\n".join(f"rank {r} (rc {p.returncode}): {err[-1500:]}"
                      for r, (p, (_, err)) in enumerate(zip(ranks, outputs)))
    for proc, (out, err) in zip(ranks, outputs):
        assert proc.returncode == 0, both  # one rank's failure often starts in the other's
        assert out.startswith("REFUSED this Loader was made for rank 0 of 1, but torch.distributed "
                              "now runs rank"), out + err[-2000:]
        assert "rank= and world_size=" in out
