"""Where this process stands in torch.distributed: the one place that asks.

The loader, the telemetry and the checkpointer all need "which rank am I, of how many"; they
ask here so that the answer (and the fallback when no process group is initialised) is the same
everywhere.
"""

from __future__ import annotations

import os


def process_group_active() -> bool:
    """Whether torch.distributed is available and its default process group initialised."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return dist.is_available() and dist.is_initialized()


def rank_and_world(rank: int | None = None, world_size: int | None = None, *,
                   env_fallback: bool = False) -> tuple[int, int]:
    """(rank, world size): the arguments where given, else the process group's, else
    $RANK/$WORLD_SIZE when `env_fallback` (torchrun sets them before the group exists), else
    (0, 1)."""
    if rank is not None and world_size is not None:
        return int(rank), int(world_size)
    if process_group_active():
        import torch.distributed as dist

        found = dist.get_rank(), dist.get_world_size()
    elif env_fallback:
        found = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    else:
        found = 0, 1
    return (found[0] if rank is None else int(rank)), (found[1] if world_size is None else int(world_size))
