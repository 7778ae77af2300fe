"""Asynchronous, verified checkpoints of model, optimizer, loader and RNG state.

See `Checkpointer` and docs/checkpoint.md (commit protocol, what "complete" means).
"""

from shardloader.checkpoint.catalog import CheckpointWarning
from shardloader.checkpoint.checkpointer import Checkpointer
from shardloader.checkpoint.handle import CheckpointHandle

__all__ = ["CheckpointHandle", "CheckpointWarning", "Checkpointer"]
