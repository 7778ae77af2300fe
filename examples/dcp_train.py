"""Checkpoint with torch.distributed.checkpoint (DCP), torchtitan-style, and shardloader's Loader.

One `Stateful` app state holds the model, the optimizer and the loader. Its `state_dict()` is
what torchtitan's checkpointer builds: the model's and the optimizer's states from
`torch.distributed.checkpoint.state_dict` (plain FQN keys, the same whether the model is DDP,
FSDP or neither), and the loader's state under a key of this rank's own, `dp_rank_<r>`, as a
JSON string. DCP keeps one copy of a value that several ranks save under the same key, so a
per-rank key is what keeps every rank's data-loader state; the Loader's state is the global
cursor, the same on every rank, so any rank's copy would do. `dcp.save` writes the checkpoint
into `step-N.partial`; rank 0 renames it to `step-N` after the save returned on every rank (DCP
writes `.metadata` last, before any rank returns), so a run killed during a save never leaves
a folder that looks complete. Rerun the same command after a kill: `dcp.load` restores the
newest `step-N` and training continues with exactly the uninterrupted run's batches.

    torchrun --nproc_per_node 2 examples/dcp_train.py --data shards --generate 256 --checkpoint-dir ckpt

`--record FILE` appends one JSON line per step: the step, the batch's global sample indices,
a SHA-256 of its bytes and the loss (`{rank}` in FILE is replaced by the rank).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from shardloader import Dataset, Loader
from shardloader.transforms import Compose, DecodeCropFlip, ToTensor, transform_version

COMPLETE = re.compile(r"step-(\d+)")


class AppState(Stateful):
    """Model, optimizer and loader: what one DCP checkpoint saves and restores together."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: Loader,
                 rank: int) -> None:
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.loader_key = f"dp_rank_{rank}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer),
            "loader": {self.loader_key: json.dumps(self.loader.state_dict())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        self.loader.load_state_dict(json.loads(state["loader"][self.loader_key]))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="dataset root (local path or fsspec URL)")
    p.add_argument("--generate", type=int, default=0, help="write N synthetic images into --data first")
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="save a checkpoint every N steps")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--crop", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", default=None, help="append one JSON line per step here")
    p.add_argument("--wait-after", type=int, default=0,
                   help="after step N, print STEP <N> and wait to be killed (for tests)")
    return p.parse_args()


def latest_checkpoint(root: str) -> tuple[int, str | None]:
    """(step, folder) of the newest complete checkpoint, or (0, None)."""
    steps = [int(m.group(1)) for name in os.listdir(root) if (m := COMPLETE.fullmatch(name))]
    return (max(steps), os.path.join(root, f"step-{max(steps):06d}")) if steps else (0, None)


def save(app: AppState, root: str, step: int, rank: int) -> None:
    """Every rank writes its part into `step-N.partial`; rank 0 then renames it to `step-N`."""
    partial = os.path.join(root, f"step-{step:06d}.partial")
    dcp.save({"app": app}, checkpoint_id=partial)  # fsyncs its files; returns once .metadata is written
    if rank == 0:
        os.replace(partial, os.path.join(root, f"step-{step:06d}"))


def batch_digest(batch: dict) -> str:
    digest = hashlib.sha256()
    for key in ("image", "label"):
        digest.update(batch[key].contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    args = parse_args()
    torch.use_deterministic_algorithms(True)
    distributed = "RANK" in os.environ  # under torchrun
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    if rank == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        for name in os.listdir(args.checkpoint_dir):  # what a killed save left behind
            if name.endswith(".partial"):
                shutil.rmtree(os.path.join(args.checkpoint_dir, name))
        if args.generate and not os.path.exists(os.path.join(args.data, "index.json")):
            from shardloader import write_shards
            from shardloader.synthetic import make_image_samples

            write_shards(make_image_samples(args.generate, min_size=20, max_size=32, seed=args.seed),
                         args.data, shard_samples=64)
    if distributed:
        dist.barrier()

    transform = Compose([DecodeCropFlip(args.crop), ToTensor()])
    loader = Loader(Dataset(args.data), batch_size=args.batch_size, shuffle=True, seed=args.seed,
                    num_workers=args.workers, transform=transform,
                    transform_version=transform_version(transform))  # rank and world from the group
    torch.manual_seed(args.seed)
    model: torch.nn.Module = torch.nn.Linear(3 * args.crop * args.crop, 10)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    app = AppState(model, optimizer, loader, rank)

    step, folder = latest_checkpoint(args.checkpoint_dir)
    if folder is not None:
        dcp.load({"app": app}, checkpoint_id=folder)  # calls app.load_state_dict on every rank
        print(f"[rank {rank}] resumed from {folder}", flush=True)

    record = open(args.record.format(rank=rank), "a", buffering=1) if args.record else None  # noqa: SIM115
    epochs = -(-args.steps // len(loader))
    for epoch in range(loader.epoch, epochs):  # the same loop for a fresh and a resumed run
        if step >= args.steps:
            break
        loader.set_epoch(epoch)
        for batch in loader:
            loss = F.cross_entropy(model(batch["image"].flatten(1).float() / 255), batch["label"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if record is not None:
                record.write(json.dumps({"step": step, "epoch": epoch, "indices": batch["__index__"].tolist(),
                                         "sha256": batch_digest(batch), "loss": loss.item().hex()}) + "\n")
            if step % args.every == 0:
                save(app, args.checkpoint_dir, step, rank)
            if step == args.wait_after:  # tests: stop here until killed
                if rank == 0:
                    print(f"STEP {step}", flush=True)
                threading.Event().wait()
            if step >= args.steps:
                break
    if record is not None:
        record.close()
    loader.close()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
