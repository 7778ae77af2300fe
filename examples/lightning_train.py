"""Train a LightningModule on a shardloader Loader; kill it at any step and resume exactly.

The Loader goes straight to `trainer.fit(model, train_dataloaders=loader)`. Lightning sees it
has `state_dict`/`load_state_dict`, so every checkpoint carries the loader's cursor, and
`ckpt_path="last"` continues with exactly the batches an uninterrupted run trains on (same
samples, same augmented bytes), mid-epoch or at an epoch's end, on one or many processes. The
dataset (Arrow shards of small vectors) is written on the first run. docs/integrations.md says
what Lightning does with the Loader.

    python examples/lightning_train.py --data /tmp/vectors --ckpt-dir /tmp/ckpt --epochs 3
    # kill it (Ctrl-C, kill -9, a preemption) and run the same command again: it resumes
    python examples/lightning_train.py --data /tmp/vectors --ckpt-dir /tmp/ckpt --devices 2 --strategy ddp

`--record FILE` writes one JSON line per training step (the batch's sample indices and a hash of
its bytes) and `--crash-after-step N` SIGKILLs the process after step N: the resume test uses
both (tests/test_integration_lightning.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from shardloader import Dataset, Loader, write_shards

FEATURES = 8


def make_dataset(path: str, samples: int) -> None:
    """`samples` vectors in 4 classes (class centre + noise), as Arrow shards in `path`."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((4, FEATURES)).astype(np.float32)
    labels = rng.integers(0, 4, samples)
    rows = [{"x": centres[y] + 0.5 * rng.standard_normal(FEATURES).astype(np.float32), "y": int(y)}
            for y in labels]
    write_shards(rows, path, shard_samples=max(1, samples // 4))


def jitter(sample: dict[str, Any], generator: torch.Generator) -> dict[str, Any]:
    """Augmentation: noise drawn from the generator the Loader keys to (seed, epoch, sample)."""
    x = torch.as_tensor(sample["x"])
    return {"x": x + 0.1 * torch.randn(x.shape, generator=generator), "y": sample["y"]}


class Classifier(L.LightningModule):
    def __init__(self, record: str | None = None, crash_after_step: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.record_path = record
        self.crash_after_step = crash_after_step
        self._record = None

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self.net(batch["x"]), batch["y"])
        self.log("loss", loss, prog_bar=True)
        digest = hashlib.sha256()
        for key in sorted(batch):
            digest.update(key.encode() + batch[key].numpy().tobytes())
        self.write({"kind": "step", "step": self.global_step + 1, "epoch": self.current_epoch,
                    "batch_idx": batch_idx, "loader_epoch": self.loader.epoch,
                    "indices": batch["__index__"].tolist(), "sha256": digest.hexdigest(),
                    "loss": float(loss.detach()).hex()})
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Runs after the callbacks' hook: ModelCheckpoint has saved this step (if it saves it).
        if self.crash_after_step is not None and self.global_step == self.crash_after_step:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no cleanup, no atexit, no flush

    def on_train_start(self) -> None:
        self.write({"kind": "start", "loader_is_ours": self.trainer.train_dataloader is self.loader,
                    "sampler": type(getattr(self.loader, "sampler", None)).__name__,
                    "rank": self.loader.rank, "world_size": self.loader.world_size,
                    "len": len(self.loader), "num_training_batches": self.trainer.num_training_batches})

    def on_train_epoch_start(self) -> None:
        self.write({"kind": "epoch_start", "epoch": self.current_epoch, "loader_epoch": self.loader.epoch})

    def on_train_epoch_end(self) -> None:
        self.write({"kind": "epoch_end", "epoch": self.current_epoch, "loader_epoch": self.loader.epoch})

    @property
    def loader(self) -> Loader:
        return self.trainer.train_dataloader

    def write(self, event: dict[str, Any]) -> None:
        """One JSON line per event, on disk before training goes on (a SIGKILL loses none)."""
        if self.record_path is None:
            return
        if self._record is None:
            self._record = open(self.record_path.format(rank=self.global_rank), "a")
        self._record.write(json.dumps(event) + "\n")
        self._record.flush()
        os.fsync(self._record.fileno())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="dataset folder (written if it has no index.json)")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--every", type=int, default=4, help="checkpoint every N steps (0: each epoch's end)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--record", help="per-step JSON lines; {rank} is replaced by the global rank")
    p.add_argument("--crash-after-step", type=int, help="SIGKILL this process after that step")
    args = p.parse_args()

    # Under DDP, Lightning starts rank 1.. by running this script again, inside fit(), after
    # rank 0 got here: the dataset exists by then.
    if not os.path.exists(os.path.join(args.data, "index.json")):
        make_dataset(args.data, args.samples)

    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=args.strategy, max_epochs=args.epochs,
        callbacks=[ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, every_n_train_steps=args.every or None)],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    # The process group does not exist yet (fit() starts it), so rank and world size come from
    # the trainer; batch_size is per process, as with a DataLoader.
    loader = Loader(Dataset(args.data), batch_size=args.batch_size, shuffle=True, seed=0,
                    transform=jitter, num_workers=args.workers,
                    rank=trainer.global_rank, world_size=trainer.world_size)
    model = Classifier(args.record, args.crash_after_step)
    # "last": resume from ckpt-dir/last.ckpt if it exists, else start fresh.
    trainer.fit(model, train_dataloaders=loader, ckpt_path="last")
    loader.close()


if __name__ == "__main__":
    main()
