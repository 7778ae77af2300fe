"""Train a small CNN on a map-style torch Dataset of (image, label) tuples, then evaluate it.

A typical DataLoader script, ported to shardloader's Loader (see docs/migration.md; `git log -p`
on this file shows the port): the dataset decodes and augments in __getitem__ with torch's
global RNG (now keyed per sample), no DistributedSampler under torchrun, an evaluation loop
that counts every validation sample once.

    python examples/train_torch_dataset.py --epochs 2
    torchrun --nproc_per_node 2 examples/train_torch_dataset.py --epochs 2
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from shardloader import Loader


class Shapes(Dataset):
    """Synthetic 3x32x32 images of 10 classes; training samples get a random crop and flip."""

    def __init__(self, n: int, train: bool, seed: int = 0) -> None:
        self.base = torch.randn(10, 3, 36, 36, generator=torch.Generator().manual_seed(0))
        self.labels = torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(seed + 1))
        self.noise_seed = seed
        self.train = train

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        label = int(self.labels[i])
        g = torch.Generator().manual_seed(self.noise_seed * 100_003 + i)
        image = self.base[label] + 0.8 * torch.randn(3, 36, 36, generator=g)
        if self.train:  # augmentation from the global RNG, as torchvision transforms do
            top, left = torch.randint(0, 5, (2,)).tolist()
            image = image[:, top:top + 32, left:left + 32]
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
        else:
            image = image[:, 2:34, 2:34]
        return image, label


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    distributed = "RANK" in os.environ  # under torchrun
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(0)

    train_set, val_set = Shapes(2000, train=True), Shapes(333, train=False, seed=1)
    train_loader = Loader(train_set, batch_size=args.batch_size, shuffle=True,
                          num_workers=args.workers, drop_last=True)
    val_loader = Loader(val_set, batch_size=args.batch_size, num_workers=args.workers, rank=0, world_size=1)

    model = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)
        model.train()
        for images, labels in train_loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        model.eval()
        correct = seen = 0
        with torch.no_grad():
            for images, labels in val_loader:
                correct += int((model(images).argmax(1) == labels).sum())
                seen += len(labels)
        print(f"epoch {epoch}: loss {loss.item():.3f}, val acc@1 {100 * correct / seen:.2f} "
              f"on {seen} samples", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
