"""Asynchronous, verified checkpoints of model, optimizer, loader and RNG state.

See `Checkpointer` and docs/checkpoint.md (commit protocol, what "complete" means).
"""

from shardloader.checkpoint.catalog import CheckpointWarning
from shardloader.checkpoint.checkpointer import Checkpointer
from shardloader.checkpoint.handle import CheckpointHandle
from shardloader.checkpoint.preemption import EXIT_PREEMPTED, EXIT_PREEMPTED_LOST, Preemption

__all__ = ["EXIT_PREEMPTED", "EXIT_PREEMPTED_LOST", "CheckpointHandle", "CheckpointWarning",
           "Checkpointer", "Preemption"]
