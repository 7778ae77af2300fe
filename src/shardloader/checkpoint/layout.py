"""Layouts: how a checkpoint's files are made and read, behind one small interface.

The `Checkpointer` owns everything a layout does not: the staging pool, the writer thread,
placing files at the destination, the manifest, retention, choosing a checkpoint and falling
back from a damaged one. A layout only

- `stage`s the states at a step boundary (training thread: capture, refuse what is not plain
  data, copy tensors into the pool),
- `write`s the staged states as files into a local directory (writer thread),
- `verify`s a checkpoint beyond what the manifest's checksums say (it decodes as data), and
- `restore`s a checkpoint into the live objects.

Two layouts exist, named in the manifest: "single" (`SingleLayout`, one process: `state.json`
+ `state.safetensors`) and "dcp" (`dcp_layout.DcpLayout`, torch.distributed: DCP files for model
and optimizer plus a part per rank). Either can be loaded by any world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardloader.checkpoint import capture
from shardloader.checkpoint.catalog import Entry, warn
from shardloader.checkpoint.group import DistGroup, LocalGroup
from shardloader.checkpoint.manifest import FileEntry
from shardloader.checkpoint.parts import Staged, read_part, stage_part, verify_part_file
from shardloader.checkpoint.staging import StagingPool
from shardloader.checkpoint.storage import Store
from shardloader.checkpoint.writer import write_part
from shardloader.errors import CheckpointError

SINGLE_BASE = "state"


class DamagedCheckpoint(CheckpointError):
    """Raised by `Layout.restore` when the checkpoint's bytes, not the caller, are at fault:
    the checkpointer falls back to the previous checkpoint, as for a failed `verify`."""


@dataclass
class LayoutContext:
    store: Store
    storage_options: dict[str, Any] | None
    group: LocalGroup | DistGroup
    pool: StagingPool


class Layout:
    """The interface (see the module doc). Subclasses set `name`."""

    name = ""

    def __init__(self, ctx: LayoutContext) -> None:
        self.ctx = ctx

    def stage(self, ckpt_id: str, step: int, model: Any, optimizer: Any, loader: Any,
              extra: dict[str, Any]) -> Staged:
        raise NotImplementedError

    def write(self, staged: Staged, directory: str) -> dict[str, FileEntry]:
        raise NotImplementedError

    def verify(self, entry: Entry, names: list[str] | None = None) -> None:
        """Raise CheckpointError unless the files (all, or `names`) match the manifest and
        decode as `restore` decodes them."""
        for name in sorted(entry.manifest.files) if names is None else names:
            verify_part_file(self.ctx.store, entry, name)

    def restore(self, entry: Entry, name: str, model: Any, optimizer: Any, loader: Any,
                extra: dict[str, Any]) -> dict[str, Any]:
        """Restore loader, model and optimizer; return this rank's part (extras, RNG)."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what the layout holds (staging buffers)."""

    def read(self, entry: Entry, base: str) -> dict[str, Any]:
        """One part's state tree; bad bytes are a DamagedCheckpoint."""
        try:
            return read_part(self.ctx.store, entry, base)
        except DamagedCheckpoint:
            raise
        except CheckpointError as exc:
            raise DamagedCheckpoint(str(exc)) from None


class SingleLayout(Layout):
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

    def restore(self, entry: Entry, name: str, model: Any, optimizer: Any, loader: Any,
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
