"""The README's training loop with `Checkpointer(..., preemption=...)`, as a script the
preemption tests send real signals to:

    python -m tests.preempt_train ROOT DATA [--hold WHAT=FIFO ...] [--deadline S] ...

It trains `tests.job_train`'s data (a linear model; under torchrun a DDP model over gloo) with
the README's loop: `if ckpt.preempted() or step % save_every == 0: ckpt.save(...)`.

`--hold WHAT=FIFO` (repeatable) parks the run at one moment until the test opens FIFO for
writing, after printing `held WHAT` (flushed), so that a test signals it exactly there:

- `first-batch`: inside the run's first batch (its first sample's transform; no workers);
- `restore`: inside `ckpt.load()` (an extra object's `load_state_dict`);
- `step:N`: in the middle of step N (after backward, before the optimizer's step);
- `epoch-end`: after the run's first epoch ended, before the next one starts;
- `stage:N`, `upload:N`, `commit:N`: the save of step N entering that phase (stage on the
  training thread; upload and commit on the writer thread: the save is in flight).

`--hold-rank R`: under torchrun, only rank R holds. It prints `ready` once its Checkpointer is
made, `resumed N` after a restore, `step N <digest of the batch>` after each step, `weights
<digest>` and `done` at the end; under torchrun every line starts with `rank R `, and with
$PREEMPT_LINES_DIR set each rank also appends its lines to `rank-R.txt` there (torchrun
relays its ranks' output, and the last lines of a run it shuts down can be lost).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal

import numpy as np
import torch
import torch.distributed as dist

from shardloader import Dataset, Loader
from shardloader.checkpoint import Checkpointer, Preemption

LINES_DIR = os.environ.get("PREEMPT_LINES_DIR")  # each rank's lines also in a file of its own


def say(text: str) -> None:
    prefix = f"rank {dist.get_rank()} " if dist.is_initialized() else ""
    print(f"{prefix}{text}\n", end="", flush=True)  # one write: ranks share stdout
    if LINES_DIR and dist.is_initialized():  # torchrun relays stdout: its last lines may be lost
        with open(os.path.join(LINES_DIR, f"rank-{dist.get_rank()}.txt"), "a") as f:
            f.write(f"{prefix}{text}\n")


class Holds:
    """The moments this run parks at (see the module doc)."""

    def __init__(self, specs: list[str], active: bool) -> None:
        self.fifos = dict(spec.split("=", 1) for spec in specs) if active else {}

    def __call__(self, what: str) -> None:
        fifo = self.fifos.pop(what, None)
        if fifo is not None:
            say(f"held {what}")
            with open(fifo):  # opens once the test opens it for writing
                pass


class Gate:
    """An extra state saved with the model: its restore is where `restore` holds."""

    def __init__(self, holds: Holds) -> None:
        self.holds = holds

    def state_dict(self) -> dict:
        return {"gate": 1}

    def load_state_dict(self, state: dict) -> None:
        self.holds("restore")


class ToTensors:
    uses_global_rng = False

    def __init__(self, holds: Holds) -> None:
        self.holds = holds

    def __call__(self, sample: dict) -> dict:
        self.holds("first-batch")
        return {"x": torch.as_tensor(np.asarray(sample["x"], dtype=np.float32)), "label": int(sample["label"])}


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("data")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=25.0)
    parser.add_argument("--notice-signals", default="SIGTERM")  # not --signals: torchrun would take it for its --signals-to-handle
    parser.add_argument("--hold", action="append", default=[])
    parser.add_argument("--hold-rank", type=int, default=-1)
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    holds = Holds(args.hold, args.hold_rank < 0 or args.hold_rank == rank)
    say(f"pid {os.getpid()}")

    def hook(phase: str, ckpt_id: str, step: int) -> None:
        holds(f"{phase}:{step}")

    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Linear(16, 4)
    if dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = Loader(Dataset(args.data), batch_size=args.batch, shuffle=True,
                    num_workers=args.workers, seed=0, transform=ToTensors(holds))
    gate = Gate(holds)
    ckpt = Checkpointer(args.root, keep=3, _phase_hook=hook, preemption=Preemption(
        signals=tuple(args.notice_signals.split(",")), deadline=args.deadline))
    say("ready")
    step = 0
    if ckpt.latest() is not None:
        step = ckpt.load(model=model, optimizer=opt, loader=loader, gate=gate)
        say(f"resumed {step}")
    for epoch in range(loader.epoch, args.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            holds(f"step:{step + 1}")
            opt.step()
            step += 1
            say(f"step {step} {digest(batch['__index__'], batch['x'])}")
            if ckpt.preempted() or step % args.save_every == 0:
                ckpt.save(step, model=model, optimizer=opt, loader=loader, gate=gate)
        holds("epoch-end")
    ckpt.close()
    loader.close()
    module = model.module if dist.is_initialized() else model
    say(f"weights {digest(*module.state_dict().values())}")
    if dist.is_initialized():
        dist.destroy_process_group()
    say("done")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    main()
