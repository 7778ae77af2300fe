"""Which checkpoints exist under a root, which are complete, in what order; retention; cleanup.

Complete means: the directory holds a manifest that parses and matches its own checksum.
Order is commit order (the manifest's `sequence`, one more than the largest sequence among
complete checkpoints at commit time), so "newest" is the checkpoint committed last, also after
a deliberate rollback to an older step. Content verification (every file's checksum, and that
it decodes) is the layouts' `verify`, which `latest()` and `load()` use.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

from shardloader.checkpoint.manifest import MANIFEST_NAME, Manifest
from shardloader.checkpoint.storage import Store
from shardloader.errors import CheckpointError, FetchError

log = logging.getLogger(__name__)


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped or could not be cleaned up; the message names it."""


@dataclass(frozen=True)
class CatalogEntry:
    """One complete checkpoint under a root: its directory name and its parsed manifest."""

    id: str
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step


def warn(message: str, *, stacklevel: int = 3) -> None:
    """Log `message` and issue it as a CheckpointWarning; `stacklevel` as for warnings.warn,
    counted from the caller of `warn` (the default: the caller's caller)."""
    log.warning(message)
    warnings.warn(message, CheckpointWarning, stacklevel=stacklevel)


def list_complete(store: Store, *, warn_damaged: bool = True) -> list[CatalogEntry]:
    """Complete checkpoints, oldest first (commit order). Damaged manifests are skipped."""
    entries = []
    for ckpt_id in store.list_ids():
        data = store.read_manifest_bytes(ckpt_id)
        if data is None:
            continue
        source = store.url_of(f"{ckpt_id}/{MANIFEST_NAME}")
        try:
            manifest = Manifest.from_json(data, source=source)
        except CheckpointError as exc:
            if warn_damaged:
                warn(f"skipping checkpoint {store.url_of(ckpt_id)}: {exc}")
            continue
        if manifest.id != ckpt_id:
            if warn_damaged:
                warn(f"skipping checkpoint {store.url_of(ckpt_id)}: its manifest names {manifest.id!r}")
            continue
        entries.append(CatalogEntry(ckpt_id, manifest))
    entries.sort(key=lambda e: (e.manifest.sequence, e.manifest.step, e.manifest.created_at, e.id))
    return entries


def next_sequence(store: Store) -> int:
    entries = list_complete(store, warn_damaged=False)
    return entries[-1].manifest.sequence + 1 if entries else 1


def apply_retention(store: Store, keep: int | None) -> list[str]:
    """Delete the oldest complete checkpoints beyond `keep`; never the newest. Returns ids."""
    if keep is None:
        return []
    entries = list_complete(store, warn_damaged=False)
    doomed = entries[: max(0, len(entries) - max(keep, 1))]
    for entry in doomed:
        store.delete(entry.id)
    return [e.id for e in doomed]


def clean_incomplete(store: Store) -> list[str]:
    """Delete checkpoint directories without a manifest (left by a crash). Returns their ids.

    Only one job may write to a root: another job's checkpoint in progress looks the same.
    """
    removed = []
    for ckpt_id in store.list_ids():
        if store.read_manifest_bytes(ckpt_id) is None:
            try:
                store.delete(ckpt_id)
                removed.append(ckpt_id)
            except (OSError, FetchError) as exc:  # FetchError: remote, after retries
                warn(f"could not remove incomplete checkpoint {store.url_of(ckpt_id)}: {exc}")
    return removed
