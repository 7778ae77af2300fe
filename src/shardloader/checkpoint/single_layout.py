"""The "single" layout: one process writes its whole state as one part, `state.*`.

`state.safetensors` holds every tensor, `state.json` the state tree referring to them by index
(`parts`). Loaded under torch.distributed, every rank reads the whole state (plain and DDP
models; RNG state and extras are the one process's).
"""

from __future__ import annotations

from typing import Any

import shardloader.checkpoint.capture as capture
from shardloader.checkpoint.catalog import CatalogEntry, warn
from shardloader.checkpoint.layout import CheckpointLayout
from shardloader.checkpoint.manifest import FileEntry
from shardloader.checkpoint.parts import Staged, stage_part
from shardloader.checkpoint.writer import write_part

SINGLE_BASE = "state"


class SingleFileLayout(CheckpointLayout):
    """One process: the whole state as `state.safetensors` + `state.json`."""

    name = "single"

    def stage(self, ckpt_id: str, step: int, model: Any, optimizer: Any, loader: Any,
              extra: dict[str, Any]) -> Staged:
        state = capture.capture_local(loader, extra)
        if model is not None:
            state["model"] = unwrap(model).state_dict()
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        return stage_part(self.ctx.pool, SINGLE_BASE, ckpt_id, step, state,
                          capture.loader_fingerprint(state))

    def write(self, staged: Staged, directory: str) -> dict[str, FileEntry]:
        return write_part(directory, staged.part, self.ctx.pool, staged.handoff)

    def restore(self, entry: CatalogEntry, name: str, model: Any, optimizer: Any, loader: Any,
                extra: dict[str, Any]) -> dict[str, Any]:
        state = self.read(entry, SINGLE_BASE)
        group = self.ctx.group
        if group.world_size > 1 and group.rank == 0:
            warn(f"{name} was saved by one process: all {group.world_size} ranks restore "
                 "its single RNG state and extras")
        capture.check_restorable(state, name, loader=loader, extra=extra,
                                 wants={"model": model, "optimizer": optimizer})
        capture.restore_loader(loader, state, name)
        if model is not None:
            capture.restore_module(unwrap(model), state["model"], name)
        if optimizer is not None:
            capture.restore_optimizer(optimizer, state["optimizer"], name)
        return state


def unwrap(model: Any) -> Any:
    """The module inside DistributedDataParallel / DataParallel (whose keys lack 'module.')."""
    return getattr(model, "module", model) if type(model).__name__ in (
        "DistributedDataParallel", "DataParallel") else model
