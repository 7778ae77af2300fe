"""The commit protocol: how one save becomes a complete checkpoint, or fails without a trace.

`commit()` is the whole protocol, one step after another (docs/checkpoint.md, "What a save does"
and "What complete means"), for every layout and world size:

training thread, inside `save()`:
  1. stage: capture every state and copy its tensors into the staging pool (the layout's
     `stage`); every rank learns whether every rank could, so none starts a background write
     whose collectives the others would never join;
  2. start the background commit, then stream the rounds of a state larger than the pool;
writer thread (`_commit_in_background`):
  3. write: the layout's files into local staging (fsynced, hashed from memory);
  4. upload: put them at the destination and seal its directory;
  5. commit: every rank reports its files (or its failure) to rank 0, which writes the manifest
     last, once every rank's files are in place: the commit point. The outcome is broadcast,
     so every rank's handle agrees; a failed checkpoint is discarded (it has no manifest);
  6. retention (rank 0): delete the oldest complete checkpoints beyond `keep`; a failure here
     warns and never fails the checkpoint just committed.

A failure in 3-5 becomes the handle's error, a CheckpointError naming the step, the URL and the
phase; the checkpointer raises it once, from the next call into it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import shardloader.checkpoint.catalog as catalog
from shardloader.checkpoint.catalog import warn
from shardloader.checkpoint.group import DistGroup, LocalGroup
from shardloader.checkpoint.handle import CheckpointHandle
from shardloader.checkpoint.layout import CheckpointLayout
from shardloader.checkpoint.manifest import FileEntry, Manifest
from shardloader.checkpoint.parts import Staged
from shardloader.checkpoint.staging import StagingPool
from shardloader.checkpoint.storage import Store
from shardloader.errors import CheckpointError

log = logging.getLogger(__name__)

#: Called with (phase, checkpoint id, step) as each phase of a save begins (tests: gates,
#: kills, faults). The phases, in order: stage, write, upload, commit, retention.
PhaseHook = Callable[[str, str, int], None]

#: What a rank reports to rank 0 in step 5: its error (None when it has none), whether it made
#: the checkpoint directory at the destination, and its files as {name: (bytes, checksum)}.
Report = tuple[str | None, bool, dict[str, tuple[int, str]]]


@dataclass
class CommitSetup:
    """What the protocol works with, fixed for one checkpointer's life."""

    store: Store
    group: LocalGroup | DistGroup
    layout: CheckpointLayout  # the layout this process writes
    pool: StagingPool
    staging: str  # this rank's local staging directory
    move: bool  # staged files can be renamed into place (same local file system)
    keep: int | None
    catalog_lock: threading.Lock  # held by retention, and by latest()/load() while they read
    telemetry: Any
    hook: PhaseHook | None
    stats: dict[str, Any]  # the checkpointer's counters, under stats_lock
    stats_lock: threading.Lock
    attempt: Any = None  # the job's AttemptRecorder: told of each commit and failure
    # set when a newer Checkpointer of the root in this process took over (`tenure`): from then
    # on retention deletes nothing, also for a save already in flight
    retired: threading.Event = field(default_factory=threading.Event)
    # set past a preemption deadline (`preemption.end_lost`): from then on no manifest is
    # written, so no checkpoint completes after the process said "not saved"
    abandoned: threading.Event = field(default_factory=threading.Event)
    manifest_lock: threading.Lock = field(default_factory=threading.Lock)
    written: set[str] = field(default_factory=set)  # ids whose manifest this process wrote

    def abandon(self, wait_s: float = 1.0) -> set[str]:
        """Write no manifest from now on; returns the ids whose manifest was written before.
        Waits at most `wait_s` for a manifest being written (a hung remote write is left)."""
        locked = self.manifest_lock.acquire(timeout=wait_s)
        try:
            self.abandoned.set()
            return set(self.written)
        finally:
            if locked:
                self.manifest_lock.release()

    def count(self, **amounts: float) -> None:
        with self.stats_lock:
            for key, amount in amounts.items():
                self.stats[key] += amount


def commit(setup: CommitSetup, handle: CheckpointHandle, model: Any, optimizer: Any,
           loader: Any, extra: dict[str, Any], *, busy_wait_s: float) -> None:
    """Steps 1-2 (training thread): stage, start the background commit (3-6), stream the rest.

    Returns once every tensor is in the pool or written out. Raises when staging fails on any
    rank (nothing was started then) or streaming fails (the background commit then fails too).
    """
    _enter_phase(setup, handle, "stage")
    t_stage = time.perf_counter()
    staged = _stage_on_every_rank(setup, handle, model, optimizer, loader, extra)
    setup.count(started=1)
    handle.run_in_background(lambda: _commit_in_background(setup, handle, staged))
    try:
        _stream_rest(setup.pool, handle, staged)
    finally:
        handle.mark_staged(staged.nbytes, stage_s=time.perf_counter() - t_stage,
                           busy_wait_s=busy_wait_s)


def _commit_in_background(setup: CommitSetup, handle: CheckpointHandle, staged: Staged) -> None:
    """Steps 3-6 (writer thread), then the save's counters and telemetry."""
    files: dict[str, FileEntry] = {}
    try:
        files, made, error = _write_and_upload(setup, handle, staged)
        handle.wait_staged()  # save() returned on this rank: its stage timings are final
        t0 = time.perf_counter()
        error, outcome = _commit_round(setup, handle, staged, files, made, error)
        handle.record_timing("commit_s", time.perf_counter() - t0)
        if error is not None:
            raise error
        if outcome is not None:
            raise CheckpointError(f"another rank failed: {outcome}")
    except BaseException as exc:
        setup.count(failed=1)
        if setup.attempt is not None:
            setup.attempt.on_save_failed(handle.step, handle.id, exc)
        raise CheckpointError(
            f"checkpoint of step {handle.step} ({handle.url}) failed during {handle.phase}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if setup.attempt is not None:  # this rank's files reached the destination
        setup.attempt.on_committed(handle.step, handle.id, sum(e.bytes for e in files.values()), len(files))
    if setup.group.rank == 0:  # retention and telemetry are rank 0's job
        _apply_retention(setup, handle)
    handle.mark_committed()
    with setup.stats_lock:
        setup.stats["committed"] += 1
        setup.stats["last"] = {"step": handle.step, "id": handle.id, "bytes": handle.nbytes,
                               **handle.timings}
    if setup.group.rank == 0:
        log_metrics(setup, {f"checkpoint/{k}": float(v) for k, v in handle.timings.items()}
                    | {"checkpoint/bytes": float(handle.nbytes)}, handle.step)


# ---------------------------------------------------------------------- 1-2: training thread
def _stage_on_every_rank(setup: CommitSetup, handle: CheckpointHandle, model: Any,
                         optimizer: Any, loader: Any, extra: dict[str, Any]) -> Staged:
    """Stage on this rank; every rank learns whether every rank could (so that none
    starts a background write whose collectives the others would never join)."""
    group = setup.group
    staged, error = None, None
    try:
        staged = setup.layout.stage(handle.id, handle.step, model, optimizer, loader, extra)
    except Exception as exc:
        error = exc
    problems = group.all_gather(
        None if error is None else f"rank {group.rank}: {type(error).__name__}: {error}")
    if error is not None:
        raise error
    others = [p for p in problems if p is not None]
    if others:
        raise CheckpointError(f"save(step={handle.step}) failed on another rank: {others[0]}")
    assert staged is not None
    return staged


def _stream_rest(pool: StagingPool, handle: CheckpointHandle, staged: Staged) -> None:
    """Rounds 1.. of a state larger than the pool: wait for the writer to drain, copy.

    When the writer fails meanwhile, streaming stops; its error is raised by the next call.
    """
    rounds, handoff = staged.part.rounds, staged.handoff
    try:
        for k in range(1, len(rounds)):
            if not handoff.wait_drained(k - 1):
                break
            pool.copy_in(rounds[k], staged.tensors)
            handoff.staged()
    except BaseException:
        handoff.abort()
        handle.mark_reported()  # this call raises; the job's StreamAborted is not news
        raise
    finally:
        staged.tensors = None


# ---------------------------------------------------------------------- 3-4: write, upload
def _write_and_upload(setup: CommitSetup, handle: CheckpointHandle, staged: Staged
                      ) -> tuple[dict[str, FileEntry], bool, BaseException | None]:
    """Write this rank's files into local staging and put them at the destination.

    Returns `(files, made, error)`: `made` when the destination directory was made. A failure
    is returned, not raised: this rank must still take part in the commit round, reporting it.
    """
    stage_dir = os.path.join(setup.staging, handle.id)
    files: dict[str, FileEntry] = {}
    made = False
    try:
        _enter_phase(setup, handle, "write")
        t0 = time.perf_counter()
        try:
            os.makedirs(stage_dir)
            files = setup.layout.write(staged, stage_dir)
        except BaseException:
            staged.handoff.fail()  # a saver waiting for the pool must not wait forever
            raise
        t1 = time.perf_counter()
        handle.record_timing("write_s", t1 - t0)
        _enter_phase(setup, handle, "upload")
        setup.store.make_dir(handle.id, exist_ok=setup.group.world_size > 1)
        made = True
        for name in sorted(files):
            setup.store.put(os.path.join(stage_dir, name), handle.id, name, move=setup.move)
        setup.store.seal_dir(handle.id)
        handle.record_timing("upload_s", time.perf_counter() - t1)
        _enter_phase(setup, handle, "commit")
    except BaseException as exc:
        return files, made, exc
    finally:
        shutil.rmtree(stage_dir, ignore_errors=True)
    return files, made, None


# ---------------------------------------------------------------------- 5: the commit round
def _commit_round(setup: CommitSetup, handle: CheckpointHandle, staged: Staged,
                  files: dict[str, FileEntry], made: bool, error: BaseException | None
                  ) -> tuple[BaseException | None, str | None]:
    """Every rank reports to rank 0, which writes the manifest or discards the checkpoint; the
    outcome (None: committed, else why not) is broadcast, so every rank's handle agrees.

    Returns `(error, outcome)`: this rank's own error (on rank 0 also a failed manifest write)
    and the shared outcome.
    """
    group = setup.group
    problem = None if error is None else f"rank {group.rank}: {type(error).__name__}: {error}"
    report: Report = (problem, made, {k: (v.bytes, v.checksum) for k, v in files.items()})
    reports = group.bg_gather(report)
    outcome = None
    if reports is not None:  # rank 0
        outcome, manifest_error = _write_manifest(setup, handle, staged, reports)
        error = error or manifest_error
        if outcome is not None and any(rank_made for _, rank_made, _ in reports):
            _discard(setup.store, handle.id)
    return error, group.bg_broadcast(outcome)


def _write_manifest(setup: CommitSetup, handle: CheckpointHandle, staged: Staged,
                    reports: list[Report]) -> tuple[str | None, BaseException | None]:
    """Rank 0: the manifest, written last, when no rank reported an error: the commit point.

    Returns `(outcome, error)`: None and None when committed, else why not, and the exception
    when writing the manifest failed.
    """
    errors = [e for e, _, _ in reports if e is not None]
    if errors:
        return "; ".join(errors), None
    merged = {k: FileEntry(*v) for _, _, part in reports for k, v in part.items()}
    with setup.manifest_lock:
        if setup.abandoned.is_set():
            return "abandoned: the preemption deadline passed before it was committed", None
        outcome = _write_manifest_now(setup, handle, staged, merged)
        if outcome[0] is None:
            setup.written.add(handle.id)
        return outcome


def _write_manifest_now(setup: CommitSetup, handle: CheckpointHandle, staged: Staged,
                        merged: dict[str, FileEntry]) -> tuple[str | None, BaseException | None]:
    try:
        manifest = Manifest(
            id=handle.id, step=handle.step, sequence=catalog.next_sequence(setup.store),
            layout=setup.layout.name, world_size=setup.group.world_size, files=merged,
            loader_fingerprint=staged.fingerprint,
            timings={k: round(v, 6) for k, v in handle.timings.items()},
        )
        setup.store.write_manifest(handle.id, manifest.to_json())
    except BaseException as exc:
        return f"rank 0 could not write the manifest: {type(exc).__name__}: {exc}", exc
    return None, None


def _discard(store: Store, ckpt_id: str) -> None:
    """Best effort removal of a failed checkpoint (it has no manifest: never listed)."""
    try:
        store.delete(ckpt_id)
    except FileNotFoundError:
        pass
    except Exception as exc:
        log.warning("could not remove failed checkpoint %s (startup cleanup will): %r",
                    store.url_of(ckpt_id), exc)


# ---------------------------------------------------------------------- 6: retention
def _apply_retention(setup: CommitSetup, handle: CheckpointHandle) -> None:
    """Rank 0: delete the oldest complete checkpoints beyond `keep`. The new checkpoint is
    complete already: a failure is reported (a warning, counted), never the save's."""
    _enter_phase(setup, handle, "retention")
    t0 = time.perf_counter()
    try:
        with setup.catalog_lock:
            retired = setup.retired.is_set()  # the root is a newer Checkpointer's now
            deleted = [] if retired else catalog.apply_retention(setup.store, setup.keep)
        if deleted:
            log.info("retention deleted %s", deleted)
    except Exception as exc:
        setup.count(retention_errors=1)
        warn(f"retention under {setup.store.url} failed after committing {handle.id}: {exc!r}")
    handle.record_timing("retention_s", time.perf_counter() - t0)


# ---------------------------------------------------------------------- phases, telemetry
def _enter_phase(setup: CommitSetup, handle: CheckpointHandle, phase: str) -> None:
    handle.enter_phase(phase)
    if setup.hook is not None:
        setup.hook(phase, handle.id, handle.step)


def log_metrics(setup: CommitSetup, metrics: dict[str, float], step: int) -> None:
    if setup.telemetry is None:
        return
    try:
        setup.telemetry.log_metrics(metrics, step)
    except Exception as exc:  # telemetry must never break checkpointing
        log.warning("telemetry.log_metrics failed: %r", exc)
