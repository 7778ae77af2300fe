"""One rank of a multi-node run over S3, under torchrun: read one epoch through this node's
cache and write what the rank received and what its node's cache downloaded. Used by
tests/test_cache_nodes.py."""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist

from shardloader import Dataset, Loader
from tests.sample_transforms import noisy_crop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    options = {
        "key": "testing", "secret": "testing",
        "client_kwargs": {"endpoint_url": args.endpoint, "region_name": "us-east-1"},
    }
    dataset = Dataset(args.url, cache_dir=args.cache, cache_limit="1GB", storage_options=options)
    loader = Loader(dataset, batch_size=args.global_batch // world, shuffle=True, seed=5, transform=noisy_crop,
                    partitions=4, window=2, num_workers=args.workers)
    assert loader.rank == rank and loader.world_size == world  # taken from torch.distributed
    received = [
        {"indices": batch["__index__"].tolist(), "crops": [c.numpy().tobytes().hex() for c in batch["crop"]]}
        for batch in loader
    ]
    node = dataset.source.node_counters()
    loader.close()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"batches": received, "node": node}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
