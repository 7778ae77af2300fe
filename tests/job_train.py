"""The README's training loop as a script for the job-accounting tests, with what those tests
need to inject and to check, and nothing else:

    python -m tests.job_train ROOT DATA [--kill-at STEP] [--kill-in-save STEP] ...

- `--kill-at STEP`: SIGKILL itself right after the training step STEP (before its save), once
  the save before it has committed (so where the kill falls is known);
- `--kill-in-save STEP`: the save of STEP stops in its upload (its writer thread blocks there,
  so it never commits); two steps later the script SIGKILLs itself, mid-save;
- `--hold-save STEP --hold-until FIFO`: the save of STEP stops in its upload until the FIFO is
  opened for writing (it prints `held STEP` there), then goes on and commits;
- `--delay S`: every sample's read sleeps S / batch seconds (a slow source), `--compute S`:
  every step sleeps S seconds more (a known compute time);
- `--measure PATH`: the script's own clock of what it waited for and computed, written as
  JSON at the end (the figures the account must match);
- `--slow-rank R`: under torchrun, only rank R's reads sleep (`--delay`); the others read at
  full speed (one rank with slow data);
- `--watchdog S`: the Checkpointer's `watchdog_seconds`; `--hang-at STEP` (`--hang-rank R`):
  that rank's step STEP blocks forever before its backward pass (the other ranks wait in its
  collective), once the save before has committed, in a launch's first start only
  (torchrun's restart count 0); it prints `hang STEP` first;
- `--slow-stage STEP` / `--slow-upload STEP`: the save of STEP takes `--slow-seconds` more in
  its stage (the training thread, inside `save()`) / its upload (the writer thread: the next
  save waits for it); `--first-batch-delay S`: the first batch's reads take S seconds more;
  `--validate S`: after each epoch, S seconds of "validation" in `ckpt.watchdog.paused`;
- `--pid-dir DIR`: each rank writes `rank-R.json` there (its pid and torchrun's restart count)
  before it prints `start rank R restart K step S` (S: the step it resumes from), and rank 0
  prints `committed S` once the checkpoint of step S is complete (its writer thread);
  `--weights-out PATH`: rank 0 writes its final parameters' bytes there;
- `--cache DIR` and `--storage-option k=v` (repeated) or `--storage-options-json JSON` (nested
  options such as s3fs's `client_kwargs`; merged under the `k=v` ones): a remote DATA through
  the node cache.

Under torchrun (RANK in the environment) it joins a gloo process group and trains a DDP model;
`batch_size` is per rank, as in the README.

It prints `step N` after each step and `done` at the end (flushed), so a test knows where a run
stands without a clock.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from shardloader import Dataset, Loader
from shardloader.checkpoint import Checkpointer


class SlowRead:
    """A transform that sleeps `seconds` per sample: the injected data delay; the first
    `first_samples` samples it transforms sleep `first_seconds` more."""

    uses_global_rng = False

    def __init__(self, seconds: float, first_seconds: float = 0.0, first_samples: int = 0) -> None:
        self.seconds, self.first_seconds, self.first_samples = seconds, first_seconds, first_samples

    def __call__(self, sample: dict) -> dict:
        if self.first_samples > 0:
            self.first_samples -= 1
            time.sleep(self.first_seconds)
        if self.seconds:
            time.sleep(self.seconds)
        return {"x": torch.as_tensor(np.asarray(sample["x"], dtype=np.float32)), "label": int(sample["label"])}


def write_data(path: str, samples: int = 640, shard_samples: int = 64) -> None:
    """The tests' dataset: `samples` rows of 16 floats and a label."""
    from shardloader import write_shards

    rng = np.random.default_rng(0)
    rows = ({"x": rng.standard_normal(16).astype(np.float32), "label": int(i % 4)} for i in range(samples))
    write_shards(rows, path, shard_samples=shard_samples)


class SayCommitted:
    """Telemetry that prints `committed S` after each commit (rank 0's writer thread)."""

    def log_metrics(self, metrics: dict, step: int) -> None:
        print(f"committed {step}\n", end="", flush=True)


def hang_in_step(step: int) -> None:
    """Block forever inside a training step: what the watchdog must find (its stack names this
    function)."""
    print(f"hang {step}\n", end="", flush=True)
    threading.Event().wait()


def announce_start(pid_dir: str, rank: int, restart: int, step: int) -> None:
    """Write this rank's pid for a test to signal (replaced whole: never read half-written),
    then say that it started."""
    path = os.path.join(pid_dir, f"rank-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "restart": restart}, f)
    os.replace(path + ".tmp", path)
    print(f"start rank {rank} restart {restart} step {step}\n", end="", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("data")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--kill-in-save", type=int, default=-1)
    parser.add_argument("--hold-save", type=int, default=-1)
    parser.add_argument("--hold-until", default=None)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--compute", type=float, default=0.0)
    parser.add_argument("--measure", default=None)
    parser.add_argument("--cache", default=None)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--storage-option", action="append", default=[])
    parser.add_argument("--storage-options-json", default=None)
    parser.add_argument("--watchdog", type=float, default=None)
    parser.add_argument("--hang-at", type=int, default=-1)
    parser.add_argument("--hang-rank", type=int, default=0)
    parser.add_argument("--slow-stage", type=int, default=-1)
    parser.add_argument("--slow-upload", type=int, default=-1)
    parser.add_argument("--slow-seconds", type=float, default=0.0)
    parser.add_argument("--first-batch-delay", type=float, default=0.0)
    parser.add_argument("--validate", type=float, default=0.0)
    parser.add_argument("--pid-dir", default=None)
    parser.add_argument("--weights-out", default=None)
    args = parser.parse_args()
    options = {**json.loads(args.storage_options_json or "{}"),
               **dict(o.split("=", 1) for o in args.storage_option)} or None
    distributed = "RANK" in os.environ  # under torchrun
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    delay = args.delay if args.slow_rank < 0 or rank == args.slow_rank else 0.0
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    stuck = threading.Event()

    def hook(phase: str, ckpt_id: str, step: int) -> None:
        if phase == "upload" and step == args.kill_in_save:
            stuck.set()
            threading.Event().wait()  # this save never reaches its destination
        if phase == "upload" and step == args.hold_save:
            print(f"held {step}\n", end="", flush=True)
            with open(args.hold_until):  # a FIFO: opens once the test opens it for writing
                pass
        if (phase, step) in (("stage", args.slow_stage), ("upload", args.slow_upload)):
            time.sleep(args.slow_seconds)  # a slow save: the work the watchdog must not mistake

    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Linear(16, 4)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = Dataset(args.data, cache_dir=args.cache, storage_options=options) if args.cache \
        else Dataset(args.data)
    loader = Loader(dataset, batch_size=args.batch, shuffle=True, num_workers=args.workers, seed=0,
                    transform=SlowRead(delay / args.batch, args.first_batch_delay / args.batch,
                                       args.batch if args.first_batch_delay else 0))
    root_options = options if "://" in args.root else None  # an s3:// root takes the same options
    ckpt = Checkpointer(args.root, keep=3, _phase_hook=hook, storage_options=root_options,
                        watchdog_seconds=args.watchdog,
                        telemetry=SayCommitted() if args.pid_dir else None)
    step = 0
    waited = first_wait = computed = 0.0
    first_of_attempt = True  # the attempt's first next() starts the workers: startup, not data wait
    if ckpt.latest() is not None:
        step = ckpt.load(model=model, optimizer=opt, loader=loader)
    if args.pid_dir:
        announce_start(args.pid_dir, rank, restart, step)
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)
        batches = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                waited += time.perf_counter() - t0
                break
            if first_of_attempt:
                first_wait, first_of_attempt = time.perf_counter() - t0, False
            else:
                waited += time.perf_counter() - t0
            t1 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["label"])
            if step + 1 == args.hang_at and rank == args.hang_rank and restart == 0:
                ckpt.wait()  # the save before has committed: where the restart resumes is known
                hang_in_step(step + 1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if args.compute:
                time.sleep(args.compute)
            step += 1
            computed += time.perf_counter() - t1
            print(f"step {step}\n", end="", flush=True)  # one write: ranks share stdout
            if step == args.kill_at:
                ckpt.wait()  # the save before has committed: the kill falls between saves
                os.kill(os.getpid(), signal.SIGKILL)
            if args.kill_in_save > 0 and step == args.kill_in_save + 2:
                assert stuck.wait(60), "the save never reached its upload"
                os.kill(os.getpid(), signal.SIGKILL)
            if step % args.save_every == 0:
                ckpt.save(step, model=model, optimizer=opt, loader=loader)
        if args.validate:
            with ckpt.watchdog.paused("validation"):
                time.sleep(args.validate)  # the work of a validation pass, no step made
    ckpt.close()
    if args.weights_out and rank == 0:
        params = (model.module if distributed else model).state_dict()
        with open(args.weights_out, "wb") as f:
            f.write(b"".join(t.numpy().tobytes() for t in params.values()))
    loader.close()
    if distributed:
        dist.destroy_process_group()
    if args.measure:
        with open(args.measure, "w") as f:
            json.dump({"data_wait": waited, "first_wait": first_wait, "compute": computed}, f)
    print("done\n", end="", flush=True)


if __name__ == "__main__":
    main()
