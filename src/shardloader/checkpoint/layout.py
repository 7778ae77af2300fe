"""Layouts: how a checkpoint's files are made and read, behind one small interface.

The commit protocol (`commit`) and choosing and restoring a checkpoint (`restore`) own everything
a layout does not: the staging pool, the writer thread, placing files at the destination, the
manifest, retention, choosing a checkpoint and falling back from a damaged one. A layout only

- `stage`s the states at a step boundary (training thread: capture, refuse what is not plain
  data, copy tensors into the pool),
- `write`s the staged states as files into a local directory (writer thread),
- `verify`s a checkpoint beyond what the manifest's checksums say (it decodes as data), and
- `restore`s a checkpoint into the live objects.

Two layouts exist, named in the manifest: "single" (`single_layout.SingleFileLayout`, one
process: `state.json` + `state.safetensors`) and "dcp" (`dcp_layout.DcpLayout`,
torch.distributed: DCP files for model and optimizer plus a part per rank). Either can be loaded
by any world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardloader.checkpoint.catalog import CatalogEntry
from shardloader.checkpoint.group import DistGroup, LocalGroup
from shardloader.checkpoint.manifest import FileEntry
from shardloader.checkpoint.parts import Staged, read_part, verify_part_file
from shardloader.checkpoint.staging import StagingPool
from shardloader.checkpoint.storage import Store
from shardloader.errors import CheckpointError


class DamagedCheckpoint(CheckpointError):
    """Raised by `CheckpointLayout.restore` when the checkpoint's bytes, not the caller, are at
    fault: `checkpoint.restore` falls back to the previous checkpoint, as for a failed `verify`."""


@dataclass
class LayoutContext:
    """What every layout of one checkpointer works with."""

    store: Store
    storage_options: dict[str, Any] | None
    group: LocalGroup | DistGroup
    pool: StagingPool


class CheckpointLayout:
    """The interface (see the module doc). Subclasses set `name`, the manifest's "layout"."""

    name = ""

    def __init__(self, ctx: LayoutContext) -> None:
        self.ctx = ctx

    def stage(self, ckpt_id: str, step: int, model: Any, optimizer: Any, loader: Any,
              extra: dict[str, Any]) -> Staged:
        raise NotImplementedError

    def write(self, staged: Staged, directory: str) -> dict[str, FileEntry]:
        raise NotImplementedError

    def verify(self, entry: CatalogEntry, names: list[str] | None = None) -> None:
        """Raise CheckpointError unless the files (all, or `names`) match the manifest and
        decode as `restore` decodes them."""
        for name in sorted(entry.manifest.files) if names is None else names:
            verify_part_file(self.ctx.store, entry, name)

    def restore(self, entry: CatalogEntry, name: str, model: Any, optimizer: Any, loader: Any,
                extra: dict[str, Any]) -> dict[str, Any]:
        """Restore loader, model and optimizer; return this rank's part (extras, RNG)."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what the layout holds (staging buffers)."""

    def read(self, entry: CatalogEntry, base: str) -> dict[str, Any]:
        """One part's state tree; bad bytes are a DamagedCheckpoint."""
        try:
            return read_part(self.ctx.store, entry, base)
        except DamagedCheckpoint:
            raise
        except CheckpointError as exc:
            raise DamagedCheckpoint(str(exc)) from None
