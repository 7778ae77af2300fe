"""Train with Hugging Face Accelerate and shardloader's Loader; a killed run resumes exactly.

The model and optimizer go through `accelerator.prepare`; the Loader does not (it is not a torch
DataLoader, so `prepare` would hand it back unchanged: it already takes its rank and world size
from the process group). `accelerator.register_for_checkpointing(loader)` puts the loader's
cursor into every `accelerator.save_state(...)` and restores it in `load_state(...)`, next to
the weights, the optimizer and each process's RNG states.

Accelerate writes a custom object's state from the main process only and every process loads
that one file. That is enough for the Loader: its state is the global cursor (epoch, global
position), the same on every rank. A checkpoint is written into `step-N.partial` and renamed
to `step-N` once every process has written its part, so a run killed during a save never
leaves a folder that looks complete. Rerun the same command after a kill: it continues from
the newest `step-N` with exactly the batches the uninterrupted run would have trained on.

    python examples/accelerate_train.py --data shards --generate 256 --checkpoint-dir ckpt
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --data shards ...
    torchrun --nproc_per_node 2 examples/accelerate_train.py --data shards ...  # the same

(`--multi_gpu` makes `accelerate launch` start the processes through torchrun; add the script's
`--cpu` to train on CPUs with gloo. The launcher's own `--cpu` starts a single process.)

`--record FILE` appends one JSON line per step: the step, the batch's global sample indices,
a SHA-256 of its bytes and the loss (`{rank}` in FILE is replaced by the process index).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import threading

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from shardloader import Dataset, Loader
from shardloader.transforms import Compose, DecodeCropFlip, ToTensor, transform_version

COMPLETE = re.compile(r"step-(\d+)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="dataset root (local path or fsspec URL)")
    p.add_argument("--generate", type=int, default=0, help="write N synthetic images into --data first")
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help="save a checkpoint every N steps")
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--crop", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", default=None, help="append one JSON line per step here")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even where a GPU exists")
    p.add_argument("--wait-after", type=int, default=0,
                   help="after step N, print STEP <N> and wait to be killed (for tests)")
    return p.parse_args()


def generate(path: str, count: int, seed: int) -> None:
    from shardloader import write_shards
    from shardloader.synthetic import make_image_samples

    if not os.path.exists(os.path.join(path, "index.json")):
        write_shards(make_image_samples(count, min_size=20, max_size=32, seed=seed), path, shard_samples=64)


def latest_checkpoint(root: str) -> tuple[int, str | None]:
    """(step, folder) of the newest complete checkpoint, or (0, None)."""
    steps = [int(m.group(1)) for name in os.listdir(root) if (m := COMPLETE.fullmatch(name))]
    return (max(steps), os.path.join(root, f"step-{max(steps):06d}")) if steps else (0, None)


def save(accelerator: Accelerator, root: str, step: int) -> None:
    """Every process writes its part into `step-N.partial`; the main process renames it to
    `step-N` once all have finished (a crash before the rename leaves only a `.partial`)."""
    partial = os.path.join(root, f"step-{step:06d}.partial")
    accelerator.save_state(partial)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name in os.listdir(partial):  # durable before it is listed, also against power loss
            with open(os.path.join(partial, name), "rb") as f:
                os.fsync(f.fileno())
        os.replace(partial, os.path.join(root, f"step-{step:06d}"))


def batch_digest(batch: dict) -> str:
    digest = hashlib.sha256()
    for key in ("image", "label"):
        digest.update(batch[key].contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    args = parse_args()
    torch.use_deterministic_algorithms(True)
    accelerator = Accelerator(cpu=args.cpu)  # starts the process group under a launcher
    if accelerator.is_main_process:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        for name in os.listdir(args.checkpoint_dir):  # what a killed save left behind
            if name.endswith(".partial"):
                shutil.rmtree(os.path.join(args.checkpoint_dir, name))
        if args.generate:
            generate(args.data, args.generate, args.seed)
    accelerator.wait_for_everyone()

    transform = Compose([DecodeCropFlip(args.crop), ToTensor()])
    loader = Loader(Dataset(args.data), batch_size=args.batch_size, shuffle=True, seed=args.seed,
                    num_workers=args.workers, transform=transform,
                    transform_version=transform_version(transform))
    torch.manual_seed(args.seed)
    model = torch.nn.Linear(3 * args.crop * args.crop, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loader (see above)
    accelerator.register_for_checkpointing(loader)

    step, folder = latest_checkpoint(args.checkpoint_dir)
    if folder is not None:
        accelerator.load_state(folder)  # model, optimizer, RNG states and the loader's cursor
        accelerator.print(f"resumed from {folder}")

    record = None
    if args.record:
        record = open(args.record.format(rank=accelerator.process_index), "a", buffering=1)  # noqa: SIM115
    epochs = -(-args.steps // len(loader))
    for epoch in range(loader.epoch, epochs):  # the same loop for a fresh and a resumed run
        if step >= args.steps:
            break
        loader.set_epoch(epoch)
        for batch in loader:
            images = batch["image"].to(accelerator.device).flatten(1).float() / 255
            loss = F.cross_entropy(model(images), batch["label"].to(accelerator.device))
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            step += 1
            if record is not None:
                record.write(json.dumps({"step": step, "epoch": epoch, "indices": batch["__index__"].tolist(),
                                         "sha256": batch_digest(batch), "loss": loss.item().hex()}) + "\n")
            if step % args.every == 0:
                save(accelerator, args.checkpoint_dir, step)
            if step == args.wait_after:  # tests: stop here until killed
                if accelerator.is_main_process:
                    print(f"STEP {step}", flush=True)
                threading.Event().wait()
            if step >= args.steps:
                break
    if record is not None:
        record.close()
    loader.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
