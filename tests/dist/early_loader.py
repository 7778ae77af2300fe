"""`python -m tests.dist.early_loader RANK STORE_FILE`: one of two ranks that make a Loader
BEFORE joining the process group (as a script does that builds it before Lightning's `fit()`),
then iterate it. Prints what iterating raised."""

from __future__ import annotations

import sys

import torch.distributed as dist

from shardloader import Loader


def main(rank: int, store: str) -> None:
    loader = Loader(list(range(12)), batch_size=2)  # made for rank 0 of 1: no group yet
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    # Neither rank may leave while the other still connects: gloo's init returns on one rank
    # once its side of the pair is up, and a rank that exits then fails the other's handshake
    # ("Connection closed by peer", seen in CI). A barrier needs both sides.
    dist.barrier()
    try:
        next(iter(loader))
        print("ITERATED", flush=True)
    except RuntimeError as e:
        print(f"REFUSED {e}", flush=True)
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
