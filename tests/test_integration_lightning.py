"""PyTorch Lightning: a Loader passed to `trainer.fit` resumes exactly after a SIGKILL.

Real runs of examples/lightning_train.py (a real Trainer, real loader workers, real DDP over
gloo with the second process started by Lightning itself). Each run records, for every training
step, the batch's sample indices and a hash of its bytes (and the step's loss); a run told to
crash SIGKILLs itself after a given step (after Lightning's own hooks for it, so a checkpoint
due at that step is on disk), and the next run resumes with `ckpt_path="last"`. The steps the
checkpoints kept, followed by the resumed run's steps, must equal an uninterrupted run's, in
order and bit for bit. The kills cover a checkpoint mid-epoch, one taken on an epoch's last batch
(the loader's state is then "epoch e, at its end") and the one Lightning rewrites at an epoch's
end. Every record also checks that Lightning's epoch is the loader's, that the loader is the
object Lightning iterates (no DistributedSampler injected, no wrapper) and that each rank's
samples are the ones the Loader's plan gives it. After every run no process is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from shardloader import Dataset, Loader
from tests.integration_runs import ROOT, describe, env, kill_marked, survivors
from tests.resume import RecordedBatch, assert_same_batches, take

lightning_data = pytest.importorskip("lightning.fabric.utilities.data")

EXAMPLE = os.path.join(ROOT, "examples", "lightning_train.py")
SAMPLES, BATCH, EVERY, EPOCHS = 48, 8, 2, 3  # the example's settings for these runs
RUN_SECONDS = 240


@dataclass
class Run:
    """What one run recorded, per rank: its events (JSON lines) in order."""

    events: dict[int, list[dict[str, Any]]]

    def steps(self, rank: int = 0) -> list[dict[str, Any]]:
        return [e for e in self.events[rank] if e["kind"] == "step"]


@dataclass
class Started:
    """A run of the example in progress."""

    name: str
    proc: subprocess.Popen
    token: str  # its MARKER value: in every process it starts (inherited), orphans included
    record: str  # the record path, with {rank}
    log: str
    devices: int
    crash_after: int | None


def _start(work: str, name: str, *, crash_after: int | None = None, devices: int = 1,
           every: int = EVERY) -> Started:
    """Start the example once (it resumes from work/ckpt/last.ckpt if there is one)."""
    record = os.path.join(work, f"{name}-rank{{rank}}.jsonl")
    cmd = [sys.executable, EXAMPLE, "--data", os.path.join(work, "data"), "--ckpt-dir",
           os.path.join(work, "ckpt"), "--epochs", str(EPOCHS), "--samples", str(SAMPLES),
           "--batch-size", str(BATCH), "--every", str(every), "--workers", "1",
           "--devices", str(devices), "--strategy", "ddp" if devices > 1 else "auto",
           "--record", record]
    if crash_after is not None:
        cmd += ["--crash-after-step", str(crash_after)]
    token = uuid.uuid4().hex
    log = os.path.join(work, f"{name}.log")
    # Output to a file, not a pipe: a surviving rank must not keep the test waiting on the pipe.
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=work, env=env(token), stdout=out, stderr=subprocess.STDOUT)
    return Started(name, proc, token, record, log, devices, crash_after)


def _finish(run: Started) -> Run:
    """Wait for `run` (bounded), check its exit code and that no process it started is alive."""
    try:
        rc = run.proc.wait(timeout=RUN_SECONDS)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        run.proc.wait(10)
        rc = None
    left = survivors(run.token, timeout=20)  # SIGKILLed: no leak into later tests; still a failure
    with open(run.log) as f:
        tail = f.read()[-4000:]
    assert not left, f"{run.name}: processes left after the run: {describe(left)}"
    expected = -signal.SIGKILL if run.crash_after is not None else 0
    assert rc == expected, f"{run.name}: exit code {rc}, expected {expected}\n{tail}"
    events = {}
    for rank in range(run.devices):
        with open(run.record.format(rank=rank)) as f:
            events[rank] = [json.loads(line) for line in f]
    return Run(events)


def _run(work: str, name: str, **kwargs: Any) -> Run:
    return _finish(_start(work, name, **kwargs))


def _finish_all(started: list[Started]) -> list[Run]:
    """`_finish` each; if one fails, the others are killed (with all they started) first."""
    try:
        return [_finish(run) for run in started]
    except BaseException:
        for run in started:
            kill_marked(run.token)
            run.proc.kill()
            run.proc.wait(10)
        raise


def _checkpoint(work: str) -> dict[str, Any]:
    """last.ckpt: the step it was taken at and the loader state Lightning stored in it."""
    ckpt = torch.load(os.path.join(work, "ckpt", "last.ckpt"), map_location="cpu", weights_only=True)
    fit_loop = ckpt["loops"]["fit_loop"]
    states = fit_loop["state_dict"].get("combined_loader", [])
    assert len(states) == 1, f"last.ckpt holds {len(states)} loader states, expected the Loader's one"
    return {"step": ckpt["global_step"], "epoch": ckpt["epoch"], "loader": states[0],
            "epoch_progress": fit_loop["epoch_progress"]["current"]}


def _batches(steps: list[dict[str, Any]]) -> list[RecordedBatch]:
    return [RecordedBatch(tuple(s["indices"]), (("batch", "sha256", (), bytes.fromhex(s["sha256"])),))
            for s in steps]


def _assert_same_training(steps: list[dict[str, Any]], reference: list[dict[str, Any]], what: str) -> None:
    """Same batches (indices, bytes), at the same (step, epoch, batch index), with the same loss."""
    assert_same_batches(_batches(steps), _batches(reference), what)
    where = [(s["step"], s["epoch"], s["batch_idx"]) for s in steps]
    assert where == [(s["step"], s["epoch"], s["batch_idx"]) for s in reference], what
    assert [s["loss"] for s in steps] == [s["loss"] for s in reference], f"{what}: losses differ"


def _check_run(run: Run, world: int, data: str) -> None:
    """Lightning iterated our Loader itself, its epochs are the loader's, and every rank's
    batches are the ones the Loader plans for that rank (disjoint across ranks)."""
    steps_per_epoch = SAMPLES // (BATCH * world)
    plans = [Loader(Dataset(data), batch_size=BATCH, shuffle=True, seed=0, rank=r, world_size=world)
             for r in range(world)]
    for rank in range(world):
        start = run.events[rank][0]
        assert start["kind"] == "start", start
        assert start["loader_is_ours"] and start["sampler"] != "DistributedSampler", start
        assert (start["rank"], start["world_size"]) == (rank, world), start
        assert start["len"] == start["num_training_batches"] == steps_per_epoch, start
        for event in run.events[rank]:
            if event["kind"] != "start":
                assert event["loader_epoch"] == event["epoch"], f"rank {rank}: {event}"
        for s in run.steps(rank):
            planned = plans[rank].step_samples(s["epoch"], s["batch_idx"], rank).tolist()
            assert s["indices"] == planned, f"rank {rank} step {s['step']}: {s['indices']} vs plan {planned}"
    for p in plans:
        p.close()
    if world > 1:
        per_step = list(zip(*(run.steps(r) for r in range(world))))
        for same in per_step:
            assert len({s["step"] for s in same}) == 1
            taken = [i for s in same for i in s["indices"]]
            assert len(taken) == len(set(taken)), f"step {same[0]['step']}: ranks share samples"


def _keep(trained: list[dict[str, Any]], run: Run, rank: int, checkpoint_step: int) -> list[dict[str, Any]]:
    """The steps trained so far, plus `run`'s, that the checkpoint at `checkpoint_step` keeps
    (the later ones are lost with the kill and trained again by the next run)."""
    kept = [s for s in trained + run.steps(rank) if s["step"] <= checkpoint_step]
    assert kept and kept[-1]["step"] == checkpoint_step, f"rank {rank}: step {checkpoint_step} was not recorded"
    return kept


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[str, Run]:
    """An uninterrupted single-process run (it also writes the dataset the others read)."""
    work = str(tmp_path_factory.mktemp("lightning-reference"))
    run = _run(work, "reference")
    assert len(run.steps()) == EPOCHS * SAMPLES // BATCH
    return os.path.join(work, "data"), run


def _workdir(path, data: str) -> str:
    """A fresh folder for a chain of runs (its own checkpoints), reading the shared dataset."""
    os.makedirs(path)
    os.symlink(data, os.path.join(path, "data"))
    return str(path)


def test_seed_everything_workers_may_set_worker_init_fn(arrow_dataset, monkeypatch):
    """`seed_everything(workers=True)` makes Lightning assign `loader.worker_init_fn` (as it
    does to a DataLoader's) in fit(); the assignment must work and change no batch (the
    Loader keys every sample's random draws itself)."""
    def make() -> Loader:
        return Loader(Dataset(arrow_dataset), batch_size=16, shuffle=True, seed=3, num_workers=1)

    with make() as plain:
        expected = take(plain, 5)
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    with make() as loader:
        lightning_data._auto_add_worker_init_fn(loader, 0)  # what fit() does with each train loader
        assert loader.worker_init_fn is not None
        assert_same_batches(take(loader, 5), expected, "with Lightning's worker_init_fn")


def test_single_process_resumes_exactly_after_kills_mid_epoch_and_on_an_epochs_last_batch(
        tmp_path, reference):
    data, ref = reference
    _check_run(ref, 1, data)
    per_epoch = SAMPLES // BATCH  # 6 steps per epoch, a checkpoint every 2
    work = _workdir(tmp_path / "chain", data)

    # 1. Killed after step 3: the checkpoint is step 2's, mid-epoch 0.
    killed = _run(work, "kill-mid-epoch", crash_after=3)
    ckpt = _checkpoint(work)
    assert (ckpt["step"], ckpt["loader"]["epoch"], ckpt["loader"]["position"]) == (2, 0, 2 * BATCH)
    trained = _keep([], killed, 0, 2)

    # 2. Resumed; killed after step 12, epoch 1's last batch, right after its checkpoint and
    # before the epoch's end hooks: the loader's state is "epoch 1, at its end".
    killed = _run(work, "kill-on-last-batch", crash_after=2 * per_epoch)
    _check_run(killed, 1, data)
    ckpt = _checkpoint(work)
    assert (ckpt["step"], ckpt["loader"]["epoch"], ckpt["loader"]["position"]) == (2 * per_epoch, 1, SAMPLES)
    assert ckpt["epoch_progress"]["processed"] == 1, ckpt  # epoch 1 not processed yet
    trained = _keep(trained, killed, 0, 2 * per_epoch)

    # 3. Resumed from there to the end.
    last = _run(work, "finish")
    _check_run(last, 1, data)
    _assert_same_training(trained + last.steps(), ref.steps(), "killed twice and resumed")


def test_single_process_resumes_exactly_from_an_epoch_end_checkpoint(tmp_path, reference):
    """ModelCheckpoint's default: a checkpoint at each epoch's end. Lightning then restores no
    loader state (the epoch is complete) and calls set_epoch(next epoch) after iter()."""
    data, ref = reference
    per_epoch = SAMPLES // BATCH
    work = _workdir(tmp_path / "chain", data)
    # Killed after step 8, in epoch 1: last.ckpt was written at epoch 0's end (step 6).
    killed = _run(work, "kill-after-epoch-end", crash_after=per_epoch + 2, every=0)
    _check_run(killed, 1, data)
    ckpt = _checkpoint(work)
    assert (ckpt["step"], ckpt["loader"]["epoch"], ckpt["loader"]["position"]) == (per_epoch, 0, SAMPLES)
    assert ckpt["epoch_progress"]["processed"] == 1, ckpt  # taken in epoch 0's end hooks
    trained = _keep([], killed, 0, per_epoch)
    last = _run(work, "finish", every=0)
    _check_run(last, 1, data)
    _assert_same_training(trained + last.steps(), ref.steps(), "killed after an epoch-end checkpoint")


def test_ddp_two_processes_resume_exactly_per_rank(tmp_path, reference):
    data, _ = reference
    world = 2
    per_epoch = SAMPLES // (BATCH * world)  # 3 steps per epoch, a checkpoint every 2
    crash = per_epoch + 2  # step 5: epoch 1's second batch; the checkpoint is step 4's (mid-epoch)
    work = _workdir(tmp_path / "chain", data)
    # The uninterrupted run and the one to kill side by side (their own checkpoint folders).
    started = [_start(_workdir(tmp_path / "reference", data), "ddp-reference", devices=world),
               _start(work, "ddp-kill", crash_after=crash, devices=world)]
    ref, killed = _finish_all(started)
    _check_run(ref, world, data)
    for epoch in range(EPOCHS):  # the ranks' batches of an epoch are the epoch, each sample once
        taken = sorted(i for r in range(world) for s in ref.steps(r) if s["epoch"] == epoch
                       for i in s["indices"])
        assert taken == list(range(SAMPLES)), f"epoch {epoch}"

    ckpt = _checkpoint(work)
    # The global cursor (the same on every rank): epoch 1, one global batch in.
    assert (ckpt["step"], ckpt["loader"]["epoch"], ckpt["loader"]["position"]) == (4, 1, BATCH * world)
    resumed = _run(work, "ddp-resume", devices=world)
    _check_run(resumed, world, data)
    for rank in range(world):
        trained = _keep([], killed, rank, 4) + resumed.steps(rank)
        _assert_same_training(trained, ref.steps(rank), f"rank {rank}, killed after step {crash}")
