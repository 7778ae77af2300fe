"""End to end: an image-training run killed by SIGKILL and resumed ends with exactly the weights,
optimizer state and sample sequence of a run that was never interrupted (I4, I7, I8).

Each test runs `examples/train_images.py` in real subprocesses (real worker processes, a real
checkpoint directory, real torchrun with gloo for two ranks), kills it at a random step drawn
from a seeded generator, resumes with `--resume`, and compares bit for bit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from shardloader.ingest.writer import write_shards
from shardloader.synthetic import make_image_samples
from tests.proctree import descendants
from tests.resume import assert_identical

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_images.py")
STEPS, EVERY = 24, 4
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT]),
       "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e-images")
    write_shards(make_image_samples(300, min_size=40, max_size=64, seed=3), str(out), shard_samples=32)
    return str(out)


def _args(data: str, out: str, name: str, *, workers: int = 1, steps: int = STEPS) -> list[str]:
    return ["--data", data, "--steps", str(steps), "--batch-size", "8", "--crop", "32",
            "--workers", str(workers), "--checkpoint-every", str(EVERY),
            "--checkpoint-dir", os.path.join(out, "ckpt"), "--record", os.path.join(out, f"{name}.jsonl"),
            "--final", os.path.join(out, f"{name}.pt"), "--seed", "1"]


def _run(args: list[str], nproc: int = 1) -> None:
    cmd = [sys.executable, EXAMPLE, *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", EXAMPLE, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _run_and_kill(args: list[str], kill_on: str, nproc: int = 1) -> None:
    """Start the run and SIGKILL its whole process group as soon as it prints `kill_on`."""
    cmd = [sys.executable, EXAMPLE, *args, "--announce"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        EXAMPLE, *args, "--announce"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line.strip())
        if line.strip() == kill_on:
            # torchrun starts each rank in a session of its own: killing the group alone would
            # leave the ranks running (and writing into the run's folder). Kill the whole tree.
            for p in descendants(proc.pid):
                os.kill(p.pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert kill_on in seen, f"the run ended before printing {kill_on!r}: {seen[-5:]}"
    assert proc.returncode == -signal.SIGKILL


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _sequence(first: str, second: str, resumed_from: int) -> list[tuple[int, int, list[int]]]:
    """Steps the killed run completed up to the checkpoint it resumed from, then the resumed run's."""
    kept = [r for r in _records(first) if r["step"] <= resumed_from]
    return [(r["step"], r["rank"], r["indices"]) for r in kept + _records(second)]


def _latest_step(out: str) -> int:
    from shardloader.checkpoint import Checkpointer

    ckpt = Checkpointer(os.path.join(out, "ckpt"))
    try:
        step = ckpt.latest()
    finally:
        ckpt.close()
    assert step is not None
    return step


def _trained_state(path: str) -> dict:
    """The weights and optimizer state a run saved at its end (`--final`); a run that trained
    has optimizer state."""
    saved = torch.load(path, weights_only=True)
    assert len(saved["optimizer"]["state"]) > 0, f"{path}: no optimizer state"
    return {"model": saved["model"], "optimizer state": saved["optimizer"]["state"]}


@pytest.fixture(scope="module")
def reference(images, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("e2e-reference"))
    _run(_args(images, out, "run"))
    return out


@pytest.mark.parametrize("case", ["same-workers", "workers-changed"])
def test_killed_and_resumed_run_equals_uninterrupted(images, reference, tmp_path, case):
    rng = random.Random(f"e2e-{case}")
    kill_step = rng.randint(EVERY + 1, STEPS - 2)
    out = str(tmp_path)
    _run_and_kill(_args(images, out, "first"), f"STEP {kill_step}")
    resumed_from = _latest_step(out)
    assert EVERY <= resumed_from <= kill_step
    _run(_args(images, out, "second", workers=2 if case == "workers-changed" else 1) + ["--resume"])
    got = _sequence(os.path.join(out, "first.jsonl"), os.path.join(out, "second.jsonl"), resumed_from)
    expected = [(r["step"], r["rank"], r["indices"]) for r in _records(os.path.join(reference, "run.jsonl"))]
    assert got == expected
    assert_identical(_trained_state(os.path.join(reference, "run.pt")),
                     _trained_state(os.path.join(out, "second.pt")), "final")


def test_kill_during_checkpoint_write(images, reference, tmp_path):
    """SIGKILL right after save() returned, while the background writer is writing."""
    out = str(tmp_path)
    save_step = random.Random("e2e-save").choice([2 * EVERY, 3 * EVERY, 4 * EVERY])
    _run_and_kill(_args(images, out, "first"), f"SAVE {save_step}")
    resumed_from = _latest_step(out)
    assert resumed_from in (save_step - EVERY, save_step)  # the previous one, or this one if it completed
    _run(_args(images, out, "second") + ["--resume"])
    got = _sequence(os.path.join(out, "first.jsonl"), os.path.join(out, "second.jsonl"), resumed_from)
    expected = [(r["step"], r["rank"], r["indices"]) for r in _records(os.path.join(reference, "run.jsonl"))]
    assert got == expected
    assert_identical(_trained_state(os.path.join(reference, "run.pt")),
                     _trained_state(os.path.join(out, "second.pt")), "final")


def test_two_ranks_killed_and_resumed_under_torchrun(images, tmp_path):
    steps = 16
    ref, out = str(tmp_path / "ref"), str(tmp_path / "run")
    os.makedirs(ref)
    os.makedirs(out)
    _run(_args(images, ref, "run", steps=steps), nproc=2)
    kill_step = random.Random("e2e-ddp").randint(EVERY + 1, steps - 2)
    _run_and_kill(_args(images, out, "first", steps=steps), f"STEP {kill_step}", nproc=2)
    resumed_from = _latest_step(out)
    _run(_args(images, out, "second", steps=steps) + ["--resume"], nproc=2)
    # Both ranks append to one record file; order its lines by (step, rank). The indices inside
    # each batch keep their order, and interleaving ranks per step gives the global sequence.
    by_step_rank = lambda r: (r[0], r[1])  # noqa: E731
    got = sorted(_sequence(os.path.join(out, "first.jsonl"), os.path.join(out, "second.jsonl"), resumed_from),
                 key=by_step_rank)
    expected = sorted(((r["step"], r["rank"], r["indices"]) for r in _records(os.path.join(ref, "run.jsonl"))),
                      key=by_step_rank)
    assert [step for step, _, _ in expected] == [s for s in range(1, steps + 1) for _ in range(2)]
    assert got == expected
    assert_identical(_trained_state(os.path.join(ref, "run.pt")),
                     _trained_state(os.path.join(out, "second.pt")), "final")
