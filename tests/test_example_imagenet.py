"""examples/imagenet: the port of an ImageNet-style script to shardloader (issue 22), for real.

`main_dataloader.py` is the DataLoader baseline (pytorch/examples' imagenet/main.py's shape);
`main.py` is its port. The tests check that the port stays small (its changed-line count, stated
in its first line, is what difflib counts, and at most 40), that the baseline runs, and that the
port resumes exactly: real runs, in one process and under torchrun (2 ranks, gloo), SIGKILLed
with their worker processes mid-epoch, right after a save on an epoch's last batch, and during a
checkpoint's write, then started again with `--resume` — the same command each time — end with
the checkpoint (weights, optimizer, scheduler, best_acc1, loader state) of a run never
interrupted, bit for bit, after training on exactly its batches.

Run as a script (`python tests/test_example_imagenet.py ARGS`, or under torchrun), this file is the
recorder: it imports examples/imagenet/main.py, changes nothing in it, and appends one JSON line
per event to `$IMAGENET_RECORD` (`{rank}` replaced): every batch the port's Loaders hand out (its
global sample indices, a SHA-256 of its bytes — the augmented images and the targets — and, in
training, the step and the learning rate), every checkpoint saved, the samples validation reads
outside the Loader, and validation's sample counts after its all-reduce. `$IMAGENET_KILL` parks
rank 0 at one point and announces it on stdout, for the test to SIGKILL the whole process tree
there: `step:S` before training step S, `save:E:S` after the checkpoint of epoch E at step S is
written, `writing:E:S` with that checkpoint half written.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
import torch

from tests.fixtures.checkpoint import free_port
from tests.integration_runs import ROOT, env, records, run, run_and_kill
from tests.resume import assert_identical

EXAMPLES = os.path.join(ROOT, "examples", "imagenet")
BASELINE, PORT = os.path.join(EXAMPLES, "main_dataloader.py"), os.path.join(EXAMPLES, "main.py")
RECORDER = os.path.abspath(__file__)
RECORD_ENV, KILL_ENV = "IMAGENET_RECORD", "IMAGENET_KILL"
MAX_CHANGED_LINES = 40

TRAIN, VAL, EPOCHS, SAVE_EVERY, LR = 40, 21, 2, 5, 0.1
STEPS = 10  # per epoch: 40 samples, batch 4 in one process, 2 per rank under torchrun


# ------------------------------------------------------------------------------ the recorder
def _digest(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _recorded_main() -> None:
    """Run examples/imagenet/main.py's `main()` as it is, recording what it does (see above)."""
    spec = importlib.util.spec_from_file_location("imagenet_main", PORT)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rank = int(os.environ.get("RANK", "0"))
    out = open(os.environ[RECORD_ENV].format(rank=rank), "a", buffering=1)  # open until the run ends
    kill = os.environ.get(KILL_ENV, "") if rank == 0 else ""
    now: dict[str, Any] = {"epoch": None, "optimizer": None, "train_loader": None}

    def log(**event: Any) -> None:
        out.write(json.dumps(event) + "\n")

    def park(point: str) -> None:
        """Wait here for the test's SIGKILL. The test never writes to our stdin: end of file
        means the test is gone, and this run must not go on without it. One write: the other
        ranks print to the same pipe, and a print may write its text and its newline apart."""
        sys.stdout.flush()
        os.write(1, f"KILL {point}\n".encode())
        sys.stdin.read()
        os._exit(3)

    class RecordingLoader(example.Loader):
        def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(dataset, *args, **kwargs)
            if dataset.train:
                now["train_loader"] = self

        def __iter__(self):
            for images, target in super().__iter__():
                event = {"kind": "train" if self.dataset.train else "val", "epoch": now["epoch"],
                         "indices": self.last_indices.tolist(), "sha256": _digest(images, target)}
                if self.dataset.train:
                    event.update(step=self.step, lr=now["optimizer"].param_groups[0]["lr"])
                log(**event)
                if self.dataset.train and kill == f"step:{self.step}":
                    park(kill)
                yield images, target

    class RecordingSubset(example.Subset):
        def __init__(self, dataset: Any, indices: Any) -> None:
            log(kind="aux", epoch=now["epoch"], indices=list(indices))
            super().__init__(dataset, indices)

    train, save, summary = example.train, example.save_checkpoint, example.ProgressMeter.display_summary

    def recorded_train(*args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(train).bind(*args, **kwargs).arguments
        now.update(epoch=bound["epoch"], optimizer=bound["optimizer"])
        return train(*args, **kwargs)

    def recorded_save(state: dict, is_best: bool, *args: Any, **kwargs: Any) -> None:
        step = now["train_loader"].step  # batches trained on since epoch 0 began
        point = f"{state['epoch']}:{step}"
        real_save = torch.save
        if kill == f"writing:{point}":
            def half_written(obj: Any, path: str) -> None:
                buffer = io.BytesIO()
                real_save(obj, buffer)
                with open(path, "wb") as f:
                    f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                park(kill)

            torch.save = half_written
        save(state, is_best, *args, **kwargs)
        log(kind="save", epoch=state["epoch"], step=step, loader=state["loader"])
        if kill == f"save:{point}":
            park(kill)

    def recorded_summary(self: Any) -> None:
        log(kind="val_counts", epoch=now["epoch"],
            counts={m.name: m.count for m in self.meters if m.name.startswith("Acc")})
        summary(self)

    example.Loader, example.Subset = RecordingLoader, RecordingSubset
    example.train, example.save_checkpoint = recorded_train, recorded_save
    example.ProgressMeter.display_summary = recorded_summary
    example.main()
    out.close()


# ------------------------------------------------------------------------------ running it
def _arguments(batch_size: int) -> list[str]:
    return ["--train-size", str(TRAIN), "--val-size", str(VAL), "-b", str(batch_size), "-j", "1",
            "--epochs", str(EPOCHS), "--lr", str(LR), "--lr-step", "1", "--seed", "0",
            "--print-freq", "100", "--save-every", str(SAVE_EVERY), "--resume", "checkpoint.pth.tar"]


def _command(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, RECORDER, *_arguments(4)]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", RECORDER,
            *_arguments(4 // nproc)]


def _env(record: str, kill: str = "") -> dict[str, str]:
    return env(**{RECORD_ENV: record, KILL_ENV: kill})


def _run(nproc: int, out: str, name: str) -> None:
    """One run to its end, in `out` (where it keeps checkpoint.pth.tar), recording to `name`."""
    run(_command(nproc), cwd=out, env=_env(os.path.join(out, name + "-{rank}.jsonl")),
        stderr=os.path.join(out, f"{name}-stderr.txt"))


def _run_and_kill(nproc: int, out: str, name: str, kill: str) -> None:
    """Start a run; when rank 0 parks at `kill`, SIGKILL every process of it (torchrun's ranks
    run in sessions of their own, so the whole tree, not just the group); then no process of
    the run may be left within seconds."""
    # one process: its Loader's worker; under torchrun: the ranks (and the workers they run)
    run_and_kill(_command(nproc), cwd=out, env=_env(os.path.join(out, name + "-{rank}.jsonl"), kill),
                 stderr=os.path.join(out, f"{name}-stderr.txt"), announce=f"KILL {kill}",
                 at_least=nproc if nproc > 1 else 1)


def _events(out: str, name: str, rank: int) -> list[dict]:
    """The complete lines of a record (a SIGKILL may cut the last one short)."""
    return records(os.path.join(out, f"{name}-{rank}.jsonl"))


def _checkpoint(out: str, name: str = "checkpoint.pth.tar") -> dict:
    return torch.load(os.path.join(out, name), weights_only=True)


def _kill(nproc: int, out: str, name: str, kill: str) -> tuple[dict, list[list[dict]]]:
    """Kill a run at `kill`: (the newest checkpoint it left on disk, and per rank the events that
    checkpoint keeps: training batches up to its step, validation of the epochs before its
    epoch, the saves up to it). A run resumed from it must produce exactly what followed them."""
    _run_and_kill(nproc, out, name, kill)
    checkpoint = _checkpoint(out)
    saves = [e for e in _events(out, name, 0) if e["kind"] == "save"]
    assert saves, f"{name}: killed before its first checkpoint"
    last = saves[-1]  # logged once the save returned; the one being written at a kill is not
    assert (last["epoch"], last["loader"]) == (checkpoint["epoch"], checkpoint["loader"]), (
        f"{name}: the checkpoint on disk is epoch {checkpoint['epoch']} {checkpoint['loader']}, "
        f"the last save was {last}")
    kept = [[e for e in _events(out, name, rank)
             if (e["kind"] == "train" and e["step"] <= last["step"]) or e["kind"] == "save"
             or (e["kind"] in ("val", "aux", "val_counts") and e["epoch"] < last["epoch"])]
            for rank in range(nproc)]
    return checkpoint, kept


def assert_same_events(got: list[dict], want: list[dict], what: str) -> None:
    """The same events in the same order; the message names the first that differs."""
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{what}: event {i} differs:\n  got  {g}\n  want {w}"
    assert len(got) == len(want), f"{what}: {len(got)} events, expected {len(want)}"


def assert_resumed_equals_reference(out: str, kept: list[list[list[dict]]], last: str, reference: str,
                                    nproc: int) -> None:
    """The killed segments' kept events + the last, complete segment's = the reference's, on
    every rank and in order; the final checkpoint and best model are the reference's, bit for bit."""
    for rank in range(nproc):
        got = [e for segment in kept for e in segment[rank]] + _events(out, last, rank)
        assert_same_events(got, _events(reference, "run", rank), f"rank {rank}")
    for name in ("checkpoint.pth.tar", "model_best.pth.tar"):
        assert_identical(_checkpoint(out, name), _checkpoint(reference, name), name)


# ------------------------------------------------------------------------------ tests
def _changed_lines(a: str, b: str) -> int:
    """Lines removed from `a` plus lines added in `b`: the - and + lines of `diff -u a b`.
    (Without autojunk: difflib's heuristic for long files treats frequent lines such as blank
    ones as junk and then reports a longer diff than `diff` does.)"""
    with open(a) as f, open(b) as g:
        matcher = difflib.SequenceMatcher(None, f.read().splitlines(), g.read().splitlines(), autojunk=False)
    return sum(i2 - i1 + j2 - j1 for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal")


def test_the_port_changes_at_most_40_lines_and_says_how_many():
    with open(PORT) as f:
        stated = re.search(r"(\d+) changed lines", f.readline())
    assert stated is not None, "main.py's first line states its changed-line count"
    count = _changed_lines(BASELINE, PORT)
    assert count == int(stated.group(1)), f"main.py states {stated.group(1)} changed lines; difflib counts {count}"
    assert count <= MAX_CHANGED_LINES
    if shutil.which("diff"):
        diff = subprocess.run(["diff", "-u", BASELINE, PORT], capture_output=True, text=True, timeout=60).stdout
        lines = diff.splitlines()[2:]  # the two file headers
        assert sum(1 for line in lines if line[:1] in "+-") == count, diff


def test_the_baseline_runs(tmp_path):
    proc = subprocess.run([sys.executable, BASELINE, "--train-size", "16", "--val-size", "9", "-b", "4",
                           "-j", "1", "--epochs", "1", "--seed", "0"], cwd=tmp_path,
                          env=_env(""), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _checkpoint(str(tmp_path))["epoch"] == 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    """One process, never interrupted."""
    out = str(tmp_path_factory.mktemp("imagenet-reference"))
    _run(1, out, "run")
    events = _events(out, "run", 0)
    assert [e["step"] for e in events if e["kind"] == "train"] == list(range(1, EPOCHS * STEPS + 1))
    assert [(e["epoch"], e["step"]) for e in events if e["kind"] == "save"] == [
        (0, 5), (0, 10), (1, 10), (1, 15), (1, 20), (2, 20)]  # mid-epoch saves, and each epoch's end
    assert [e["counts"] for e in events if e["kind"] == "val_counts"] == [{"Acc@1": VAL, "Acc@5": VAL}] * EPOCHS
    return out


def test_killed_mid_epoch_and_during_a_write_resumes_exactly(reference, tmp_path):
    out = str(tmp_path)
    # killed at step 8: the newest checkpoint is step 5's, mid-epoch 0
    checkpoint, kept0 = _kill(1, out, "segment0", "step:8")
    assert (checkpoint["epoch"], checkpoint["loader"]["epoch"], checkpoint["loader"]["position"]) == (0, 0, 20)
    # resumed, then killed while writing step 15's checkpoint: step 10's epoch-end one stays whole
    checkpoint, kept1 = _kill(1, out, "segment1", "writing:1:15")
    assert (checkpoint["epoch"], checkpoint["loader"]["epoch"], checkpoint["loader"]["position"]) == (1, 1, 0)
    _run(1, out, "segment2")
    first = _events(out, "segment2", 0)[0]
    assert (first["kind"], first["step"]) == ("train", 11), first
    assert_resumed_equals_reference(out, [kept0, kept1], "segment2", reference, 1)


def test_killed_after_a_save_on_an_epochs_last_batch_resumes_into_that_epochs_end(reference, tmp_path):
    out = str(tmp_path)
    checkpoint, kept = _kill(1, out, "segment0", "save:0:10")
    assert (checkpoint["epoch"], checkpoint["loader"]["epoch"], checkpoint["loader"]["position"]) == (0, 0, TRAIN)
    _run(1, out, "segment1")
    resumed = _events(out, "segment1", 0)
    # epoch 0's loop yields nothing; its validation, scheduler step and epoch-end save follow
    assert resumed[0]["kind"] == "val" and resumed[0]["epoch"] == 0, resumed[0]
    assert not [e for e in resumed if e["kind"] == "train" and e["epoch"] == 0]
    assert_resumed_equals_reference(out, [kept], "segment1", reference, 1)
    lrs = {(e["epoch"], e["lr"]) for e in _events(reference, "run", 0) if e["kind"] == "train"}
    assert lrs == {(0, LR), (1, LR * 0.1)}, lrs  # StepLR stepped once per epoch, not more
    assert _checkpoint(out)["scheduler"]["last_epoch"] == EPOCHS


def test_two_ranks_killed_and_resumed_under_torchrun(tmp_path):
    ranks = 2
    reference, out = str(tmp_path / "reference"), str(tmp_path / "run")
    os.makedirs(reference)
    os.makedirs(out)
    _run(ranks, reference, "run")
    # killed at step 8: resumed from step 5's checkpoint, mid-epoch 0; then killed right after
    # the save on epoch 0's last batch: resumed into epoch 0's end (set_epoch(0) keeps it there)
    checkpoint, kept0 = _kill(ranks, out, "segment0", "step:8")
    assert (checkpoint["epoch"], checkpoint["loader"]["position"]) == (0, 20)
    checkpoint, kept1 = _kill(ranks, out, "segment1", "save:0:10")
    assert (checkpoint["epoch"], checkpoint["loader"]["epoch"], checkpoint["loader"]["position"]) == (0, 0, TRAIN)
    _run(ranks, out, "segment2")
    assert_resumed_equals_reference(out, [kept0, kept1], "segment2", reference, ranks)

    per_rank = [_events(reference, "run", rank) for rank in range(ranks)]
    for rank, events in enumerate(per_rank):
        steps = [e["step"] for e in events if e["kind"] == "train"]
        assert steps == list(range(1, EPOCHS * STEPS + 1)), f"rank {rank}: {steps}"
    for epoch in range(EPOCHS):
        # each rank validates its own share through the Loader, then every rank the samples
        # equal shares left out: every sample is counted exactly once in every rank's meters
        shares = [[i for e in events if e["kind"] == "val" and e["epoch"] == epoch for i in e["indices"]]
                  for events in per_rank]
        rest = [[i for e in events if e["kind"] == "aux" and e["epoch"] == epoch for i in e["indices"]]
                for events in per_rank]
        assert len(shares[0]) == len(shares[1]) and rest[0] == rest[1], (shares, rest)
        counted = Counter(i for share in shares for i in share) + Counter(rest[0])
        assert counted == Counter(range(VAL)), f"epoch {epoch}: {sorted(counted.items())}"
        for events in per_rank:
            assert [e["counts"] for e in events if e["kind"] == "val_counts" and e["epoch"] == epoch] == [
                {"Acc@1": VAL, "Acc@5": VAL}]


if __name__ == "__main__":
    _recorded_main()
