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


#: Set by torchrun (torch.distributed.elastic) in every rank it starts.
LAUNCHER_VARIABLE = "TORCHELASTIC_RUN_ID"
_watching_launcher: int | None = None  # the pid that watches its launcher (a fork does not)


def end_with_launcher() -> bool:
    """In a rank that torchrun started, end this process when the torchrun agent (its parent)
    dies: a killed agent must not leave ranks that go on training and committing checkpoints
    into a root the next launch will use. Watched by a pidfd (or by polling its pid and start
    time), never by the parent-death signal, which follows the thread that started us.
    Returns whether a watch runs; safe to call any number of times."""
    global _watching_launcher
    if LAUNCHER_VARIABLE not in os.environ:
        return False
    if _watching_launcher == os.getpid():
        return True
    from shardloader.runtime.child_process import die_with
    from shardloader.runtime.liveness import identity_of

    die_with(identity_of(os.getppid()), use_signal=False)
    _watching_launcher = os.getpid()
    return True


#: Set by torchrun in every rank: whether the ranks use the agent's TCPStore, and how many
#: times the agent may restart them.
AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"
MAX_RESTARTS_VARIABLE = "TORCHELASTIC_MAX_RESTARTS"


def restart_hazard() -> str | None:
    """Why torchrun's restarts of this job would not form the process group again, or None.

    torch's agent hands its ranks its own TCPStore (`TORCHELASTIC_USE_AGENT_STORE`) and, in the
    versions tried (2.13), keeps that one store for every restart: a restarted group reads the
    old group's addresses and fails to connect ("Connection refused", pytorch/pytorch#135712),
    so each restart fails at once until none is left. With `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`
    in torchrun's environment the ranks host a new store each start and restarts work."""
    try:
        restarts = int(os.environ.get(MAX_RESTARTS_VARIABLE, "0"))
    except ValueError:
        return None
    if restarts <= 0 or os.environ.get(AGENT_STORE_VARIABLE) != "True":
        return None
    return (f"torchrun --max-restarts={restarts} with the agent's shared TCPStore "
            f"({AGENT_STORE_VARIABLE}=True): a restarted process group may read the previous "
            "group's addresses and fail to connect (pytorch/pytorch#135712); set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment")
