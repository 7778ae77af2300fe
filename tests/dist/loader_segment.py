"""One segment of a multi-rank run, under torchrun: load a state (optional), consume batches,
write what each rank received and (rank 0) the state. Used by tests/test_loader_distributed.py."""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist

from shardloader import Dataset, Loader
from tests.sample_transforms import noisy_crop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--batches", type=int, required=True)
    parser.add_argument("--state-in")
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = Loader(Dataset(args.data), batch_size=args.global_batch // world, seed=5,
                    transform=noisy_crop, partitions=4, window=2, num_workers=args.workers,
                    shuffle=True, tail="pad", persistent_workers=True)
    assert loader.rank == rank and loader.world_size == world  # taken from torch.distributed
    if args.state_in:
        with open(args.state_in) as f:
            loader.load_state_dict(json.load(f))
    received = []
    while len(received) < args.batches:
        for batch in loader:
            received.append({
                "indices": batch["__index__"].tolist(),
                "crops": [c.numpy().tobytes().hex() for c in batch["crop"]],
            })
            if len(received) == args.batches:
                break
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(received, f)
    if rank == 0:
        with open(os.path.join(args.out, "state.json"), "w") as f:
            json.dump(loader.state_dict(), f)
    loader.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
