"""Train a small residual CNN on sharded JPEGs with shardloader, resumably.

Everything a real run needs, end to end: the `Loader` with keyed augmentations, the async
`Checkpointer` every N steps (model, optimizer, loader and RNG state committed together),
telemetry to MLflow, deterministic torch settings, and `--resume` from the newest complete
checkpoint. Kill it at any instant (SIGKILL included) and rerun with `--resume`: it continues
with exactly the batches, dropout masks and weights an uninterrupted run would have produced.

    python examples/train_images.py --data demo-output/shards --generate 2000 --steps 200
    torchrun --nproc_per_node 2 examples/train_images.py --data ... --resume   # DDP, gloo

`--record FILE` appends one JSON line per step (step, sample indices) for exactness checks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardloader import Dataset, Loader
from shardloader.checkpoint import Checkpointer
from shardloader.transforms import Compose, DecodeCropFlip, ToTensor, transform_version


def announce(line: str) -> None:
    """Print `line` in one write: under torchrun the ranks share stdout, and print()'s separate
    write of the newline (with PYTHONUNBUFFERED set) lets another rank's line land between them."""
    print(line + "\n", end="", flush=True)


class Block(nn.Module):
    """A residual block: two 3x3 convolutions with batch norm, optional downsampling."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class SmallResNet(nn.Module):
    """A few residual blocks and dropout: the dropout's random stream is part of what a resume
    must restore for the weights to come out bit for bit the same."""

    def __init__(self, num_classes: int = 10, width: int = 16, dropout: float = 0.2) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(Block(width, width, 1), Block(width, 2 * width, 2), Block(2 * width, 4 * width, 2))
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(self.dropout(x.mean(dim=(2, 3))))


MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="dataset root (local path or fsspec URL)")
    p.add_argument("--generate", type=int, default=0, help="generate N synthetic images into --data first")
    p.add_argument("--image-min", type=int, default=128)
    p.add_argument("--image-max", type=int, default=256)
    p.add_argument("--crop", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--worker-type", default="process", choices=["process", "thread"])
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--mlflow", default=None, help="MLflow tracking URI (e.g. file:./mlruns); off if unset")
    p.add_argument("--experiment", default="shardloader-example")
    p.add_argument("--record", default=None, help="append per-step sample indices as JSON lines")
    p.add_argument("--final", default=None, help="save final model+optimizer state here (torch.save)")
    p.add_argument("--summary", default=None, help="write a JSON summary of the run here")
    p.add_argument("--announce", action="store_true", help="print STEP <n> after each step, SAVE <n> after each save")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--watchdog", type=float, default=None,
                   help="end a rank that makes no step progress for this many seconds (exit 124)")
    p.add_argument("--preemption", type=float, default=None,
                   help="on SIGTERM, save the current step on every rank within this many seconds, "
                        "then exit 75 (76 when it could not)")
    return p.parse_args(argv)


def setup_distributed() -> tuple[int, int]:
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def generate(path: str, count: int, args: argparse.Namespace, rank: int) -> None:
    from shardloader.format.index import INDEX_NAME
    from shardloader.ingest.writer import write_shards
    from shardloader.synthetic import make_image_samples

    if rank == 0 and not os.path.exists(os.path.join(path, INDEX_NAME)):
        samples = make_image_samples(count, min_size=args.image_min, max_size=args.image_max, seed=args.seed)
        write_shards(samples, path, shard_samples=max(64, count // 16))
    if dist.is_initialized():
        dist.barrier()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    rank, world = setup_distributed()
    if args.generate:
        generate(args.data, args.generate, args, rank)
    torch.manual_seed(args.seed)  # model init; the loader never draws from global RNGs

    transform = Compose([DecodeCropFlip(args.crop), ToTensor()])
    telemetry = None
    if args.mlflow and rank == 0:
        from shardloader.telemetry import MLflowLogger

        telemetry = MLflowLogger(tracking_uri=args.mlflow, experiment=args.experiment)
    loader = Loader(Dataset(args.data), batch_size=args.batch_size, seed=args.seed,
                    num_workers=args.workers, worker_type=args.worker_type, transform=transform,
                    transform_version=transform_version(transform), telemetry=telemetry,
                    shuffle=True, tail="pad", persistent_workers=args.workers > 0)  # equal steps on every rank
    model = SmallResNet()
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)

    ckpt = Checkpointer(args.checkpoint_dir, keep=args.keep, watchdog_seconds=args.watchdog,
                        preemption=args.preemption) if args.checkpoint_dir else None
    step = 0
    if args.resume and ckpt is not None and ckpt.latest() is not None:
        step = ckpt.load(model=model, optimizer=optimizer, loader=loader)
        print(f"[rank {rank}] resumed at step {step}", flush=True)

    record = open(args.record, "a", buffering=1) if args.record else None  # noqa: SIM115
    samples, loss = 0, None
    start = time.perf_counter()
    model.train()
    while step < args.steps:
        for batch in loader:
            images = (batch["image"].float() - MEAN) / STD
            loss = F.cross_entropy(model(images), batch["label"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            samples += batch["label"].numel()
            if record is not None:
                record.write(json.dumps({"step": step, "rank": rank, "indices": batch["__index__"].tolist()}) + "\n")
            preempted = ckpt is not None and ckpt.preempted()  # a SIGTERM came: save now (all ranks)
            if preempted and args.announce:
                announce(f"PREEMPTED {step}")  # the save below commits this step, then exits 75
            if ckpt is not None and (preempted or step % args.checkpoint_every == 0):
                ckpt.save(step, model=model, optimizer=optimizer, loader=loader)
                if args.announce:
                    announce(f"SAVE {step}")
            if args.announce:
                announce(f"STEP {step}")
            if step >= args.steps:
                break
    elapsed = time.perf_counter() - start
    summary = {"rank": rank, "steps": step, "loss": float(loss.detach()) if loss is not None else None,
               "samples_per_second": samples * world / elapsed if elapsed else 0.0,
               "loader": loader.stats()}
    if ckpt is not None:
        ckpt.wait()
        summary["checkpoint"] = ckpt.stats() if hasattr(ckpt, "stats") else {}
        ckpt.close()
    if telemetry is not None:
        telemetry.close()
        summary["mlflow_run_id"] = getattr(telemetry, "run_id", None)
    if args.final and rank == 0:
        core = model.module if world > 1 else model
        torch.save({"model": core.state_dict(), "optimizer": optimizer.state_dict()}, args.final)
    if args.summary and rank == 0:
        with open(args.summary, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    if record is not None:
        record.close()
    loader.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
