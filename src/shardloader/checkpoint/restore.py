"""Choosing a checkpoint and restoring it, with fallback to the previous complete one.

`latest()` and `load()` agree on what is usable: a complete checkpoint (`catalog`) whose files
match the manifest and decode as data (the layout's `verify`). With no step asked for, a
damaged checkpoint is skipped with a CheckpointWarning naming it and the one committed before it
is tried; with an explicit step it is a CheckpointError. A checkpoint that verifies but does not
fit the objects passed in (another model, a missing state, another loader fingerprint) is an
error, not a fallback: the caller, not the checkpoint, is at fault.

Under torch.distributed every rank tries the same checkpoints in the same order (rank 0 lists
them and broadcasts their manifests), each rank verifies a share of the files, and every rank
learns every rank's verdict, so all ranks restore the same checkpoint or fall back together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import shardloader.checkpoint.capture as capture
import shardloader.checkpoint.catalog as catalog
import shardloader.checkpoint.rng as rng
from shardloader.checkpoint.catalog import CatalogEntry, warn
from shardloader.checkpoint.group import DistGroup, LocalGroup
from shardloader.checkpoint.layout import CheckpointLayout, DamagedCheckpoint
from shardloader.checkpoint.manifest import Manifest
from shardloader.checkpoint.storage import Store
from shardloader.errors import CheckpointError

#: The layout that reads checkpoints whose manifest names it ("single", "dcp").
LayoutNamed = Callable[[str], CheckpointLayout]


def newest_usable(store: Store, layout_named: LayoutNamed, *, verify: bool) -> int | None:
    """The step of the newest complete checkpoint (verified, with `verify`), or None; every
    checkpoint skipped on the way is a CheckpointWarning naming it. Not collective."""
    for entry in reversed(catalog.list_complete(store)):
        if not verify:
            return entry.step
        problem = _problem(layout_named, entry, None)
        if problem is None:
            return entry.step
        # stacklevel: attributed to the code that called Checkpointer.latest()
        warn(f"skipping checkpoint {store.url_of(entry.id)}: {problem}", stacklevel=4)
    return None


def load(store: Store, group: LocalGroup | DistGroup, layout_named: LayoutNamed,
         step: int | None, model: Any, optimizer: Any, loader: Any, extra: dict[str, Any]
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore every state from checkpoint `step` (None: the newest usable), on every rank.

    Returns what was loaded (`{"step", "id", "url"}`) and every saved extra.
    """
    offer: Any = None
    if group.rank == 0:
        try:
            offer = [(e.id, e.manifest.to_json()) for e in _candidates(store, step)]
        except CheckpointError as exc:
            offer = str(exc)
    offer = group.broadcast(offer)
    if isinstance(offer, str):
        raise CheckpointError(offer)
    for ckpt_id, manifest_bytes in offer:
        source = store.url_of(ckpt_id)
        entry = CatalogEntry(ckpt_id, Manifest.from_json(manifest_bytes, source=source))
        local = _restore_entry(store, group, layout_named, entry, step, model, optimizer,
                               loader, extra)
        if local is not None:
            name = _describe(store, entry)
            capture.restore_extra(extra, local, name)
            rng.restore(local["rng"], source=name)
            return {"step": entry.step, "id": entry.id, "url": source}, local.get("extra", {})
    raise CheckpointError(f"{store.url}: no complete checkpoint that verifies")


def _candidates(store: Store, step: int | None) -> list[CatalogEntry]:
    """Rank 0: the checkpoints to try, newest first (with `step`: the newest of that step)."""
    entries = list(reversed(catalog.list_complete(store)))
    if step is None:
        if not entries:
            raise CheckpointError(f"{store.url}: no complete checkpoint to load")
        return entries
    chosen = [e for e in entries if e.step == step]
    if not chosen:
        raise CheckpointError(
            f"{store.url}: no complete checkpoint of step {step} "
            f"(complete steps: {sorted({e.step for e in entries})})"
        )
    return chosen[:1]


def _restore_entry(store: Store, group: LocalGroup | DistGroup, layout_named: LayoutNamed,
                   entry: CatalogEntry, step: int | None, model: Any, optimizer: Any,
                   loader: Any, extra: dict[str, Any]) -> dict[str, Any] | None:
    """Restore loader, model and optimizer from `entry` on every rank and return this rank's
    part, or None (on all ranks) when it is damaged and the next one is to be tried."""
    source = store.url_of(entry.id)
    name = _describe(store, entry)
    names = sorted(entry.manifest.files)
    mine = names[group.rank :: group.world_size]  # each rank verifies a share
    problem = _problem(layout_named, entry, mine)
    problems = [p for p in group.all_gather(problem) if p is not None]
    if problems:
        _skip(source, step, problem, problems[0], group.rank)
        return None
    layout = layout_named(entry.manifest.layout)
    error: BaseException | None = None
    status: tuple[str, str] | None = None
    try:
        local = layout.restore(entry, name, model, optimizer, loader, extra)
    except DamagedCheckpoint as exc:
        error, status = exc, ("damaged", str(exc))
    except BaseException as exc:  # the caller's objects do not fit: not the checkpoint's fault
        error, status = exc, ("fatal", f"rank {group.rank}: {type(exc).__name__}: {exc}")
    statuses = [s for s in group.all_gather(status) if s is not None]
    fatal = [m for kind, m in statuses if kind == "fatal"]
    if error is not None and (status[0] == "fatal" or step is not None):
        raise error
    if fatal:
        raise CheckpointError(f"{name}: {fatal[0]}")
    if statuses:
        _skip(source, step, status and status[1], statuses[0][1], group.rank)
        return None
    return local


def _problem(layout_named: LayoutNamed, entry: CatalogEntry, names: list[str] | None) -> str | None:
    """Why `entry` is not usable (its files, or `names` of them), or None."""
    try:
        layout_named(entry.manifest.layout).verify(entry, names)
    except CheckpointError as exc:
        return str(exc)
    return None


def _skip(source: str, step: int | None, mine: str | None, first: str, rank: int) -> None:
    """A damaged checkpoint: an error when it was asked for, else a warning and fallback."""
    if step is not None:
        raise CheckpointError(f"cannot load checkpoint {source}: {mine or first}")
    if mine is not None or rank == 0:
        warn(f"skipping checkpoint {source}: {mine or 'another rank found damage: ' + first}")


def _describe(store: Store, entry: CatalogEntry) -> str:
    """How errors and warnings name a checkpoint."""
    return f"checkpoint {store.url_of(entry.id)} (step {entry.step})"
