"""`Checkpointer`: asynchronous, verified checkpoints of model, optimizer, loader and RNG.

`save()` captures every state at the step boundary, copies its tensors into the staging pool
and returns; a background thread writes the local staging files (fsynced, hashed from memory),
puts them at the destination, writes the manifest last and applies retention. What the files
are is a layout's business (`layout`: one process; `dcp_layout`: torch.distributed); the commit
path, verification and fallback are here, once, for both. The commit protocol and what
"complete" means are in docs/checkpoint.md.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from shardloader.checkpoint import capture, catalog, rng
from shardloader.checkpoint.catalog import Entry, warn
from shardloader.checkpoint.group import LocalGroup, make_group
from shardloader.checkpoint.handle import CheckpointHandle, start_writer
from shardloader.checkpoint.layout import DamagedCheckpoint, Layout, LayoutContext, SingleLayout
from shardloader.checkpoint.manifest import FileEntry, Manifest, checkpoint_id
from shardloader.checkpoint.parts import Staged
from shardloader.checkpoint.staging import StagingPool
from shardloader.checkpoint.storage import LocalStore, Store, open_store
from shardloader.errors import CheckpointError

log = logging.getLogger(__name__)

ON_BUSY = ("wait", "skip")
PHASES = ("stage", "write", "upload", "commit", "retention")

PhaseHook = Callable[[str, str, int], None]


class Checkpointer:
    """Asynchronous checkpoints under `root` (a local path or any fsspec URL).

    keep: how many complete checkpoints retention keeps (None: all).
    staging_dir: local directory (NVMe) for staging files; default: `<root>/.staging` for a
        local root, else a directory under the system temp dir.
    on_busy: what `save()` does while the previous save is still in flight: "wait" (block,
        the wait is measured) or "skip" (drop the new save, counted).
    storage_options: passed to fsspec for the root.
    telemetry: any object with `log_metrics(dict, step)`; gets every save's phase timings.
    staging_bytes: hard cap on the staging pool (default: the state's size, bounded by
        `memory_fraction` of the available memory); larger states stream through it.
    distributed: use torch.distributed (default: when a process group of world size > 1 is
        initialised). Then construction is collective: every rank must create its Checkpointer
        in the same order, and save/load must be called on every rank.
    timeout: the bound on every wait: for the other ranks to make the same collective call
        (a call made on some ranks only is an error naming them), for collectives, and for
        the save in flight in `save`/`load`/`close`.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep: int | None = 3,
        staging_dir: str | os.PathLike | None = None,
        on_busy: str = "wait",
        storage_options: dict[str, Any] | None = None,
        telemetry: Any = None,
        staging_bytes: int | None = None,
        memory_fraction: float = 0.5,
        pin_memory: bool | None = None,
        distributed: bool | None = None,
        timeout: timedelta = timedelta(minutes=30),
        _phase_hook: PhaseHook | None = None,
    ) -> None:
        if on_busy not in ON_BUSY:
            raise ValueError(f"on_busy must be one of {ON_BUSY}, got {on_busy!r}")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a positive int or None, got {keep!r}")
        if telemetry is not None and not callable(getattr(telemetry, "log_metrics", None)):
            raise TypeError("telemetry must have a log_metrics(dict, step) method")
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be a positive timedelta, got {timeout!r}")
        self.keep = keep
        self.on_busy = on_busy
        self.telemetry = telemetry
        self.timeout = timeout
        self._hook = _phase_hook
        self._store: Store = open_store(os.fspath(root), storage_options)
        self.root = self._store.url
        self._pool = StagingPool(
            cap_bytes=staging_bytes, memory_fraction=memory_fraction, pin_memory=pin_memory
        )
        self._group = make_group(distributed, timeout, f"Checkpointer({self.root!r})")
        self.rank, self.world_size = self._group.rank, self._group.world_size
        self._nonce = self._group.broadcast(secrets.token_hex(4))
        self._counter = 0
        self._ctx = LayoutContext(self._store, storage_options, self._group, self._pool)
        self._layouts: dict[str, Layout] = {}
        self._layout = self._layout_named("single" if isinstance(self._group, LocalGroup) else "dcp")
        self._staging = self._staging_root(staging_dir)
        self._move = isinstance(self._store, LocalStore) and self._store.same_device(self._staging)
        self._lock = threading.Lock()
        # Retention (background) never deletes a checkpoint while latest()/load() is reading
        # the catalog in this process (they would see the newest vanish mid-verification).
        self._catalog_lock = threading.Lock()
        self._inflight: CheckpointHandle | None = None
        self._closed = False
        self._stats: dict[str, Any] = {
            "started": 0, "committed": 0, "failed": 0, "skipped": 0,
            "busy_waits": 0, "busy_wait_s_total": 0.0, "retention_errors": 0,
            "last": {},
        }
        self.loaded_extra: dict[str, Any] = {}
        self.loaded: dict[str, Any] | None = None
        self._startup_cleanup()
        self._at_exit = _ExitWait(weakref.ref(self))
        atexit.register(self._at_exit)

    # ------------------------------------------------------------------------------ setup
    def _layout_named(self, name: str) -> Layout:
        """The layout that writes and reads checkpoints whose manifest names `name`."""
        if name not in self._layouts:
            if name == "single":
                self._layouts[name] = SingleLayout(self._ctx)
            else:
                from shardloader.checkpoint.dcp_layout import DcpLayout

                self._layouts[name] = DcpLayout(self._ctx)
        return self._layouts[name]

    def _staging_root(self, staging_dir: str | os.PathLike | None) -> str:
        key = hashlib.sha1(self.root.encode()).hexdigest()[:12]
        if staging_dir is not None:
            base = os.path.join(os.path.abspath(os.fspath(staging_dir)), key)
        elif isinstance(self._store, LocalStore):
            base = os.path.join(self._store.root, ".staging")
        else:
            base = os.path.join(tempfile.gettempdir(), "shardloader-checkpoint-staging", key)
        path = os.path.join(base, f"rank-{self.rank:05d}")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot create the staging directory: {exc}") from exc
        return path

    def _startup_cleanup(self) -> None:
        """Remove what crashed runs left: staged files, and checkpoints without a manifest."""
        for name in os.listdir(self._staging):
            shutil.rmtree(os.path.join(self._staging, name), ignore_errors=True)
        if self.rank == 0:
            removed = catalog.clean_incomplete(self._store)
            if removed:
                log.info("removed %d incomplete checkpoints under %s: %s", len(removed), self.root, removed)
        self._group.barrier()

    # ------------------------------------------------------------------------------ save
    def save(self, step: int, *, model: Any = None, optimizer: Any = None, loader: Any = None,
             **extra: Any) -> CheckpointHandle:
        """Capture every state at this step boundary, stage its tensors, return a handle.

        Blocks for the copy into the staging pool (and, with on_busy="wait", for a previous
        save still in flight). Raises the error of a failed previous save instead of saving.
        A value that cannot be stored as plain data is a CheckpointError naming its key.
        """
        t_call = time.perf_counter()
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._group.enter(f"save(step={step})")
        self._raise_pending()
        busy = self._inflight is not None and not self._inflight.done()
        if self.on_busy == "skip":
            busy = self._group.any(busy)  # every rank skips the same saves
        if busy and self.on_busy == "skip":
            with self._lock:
                self._stats["skipped"] += 1
            self._log_metrics({"checkpoint/skipped": 1.0}, step)
            return CheckpointHandle(step, None, None, skipped=True)
        busy_wait = 0.0
        if self._inflight is not None:
            t0 = time.perf_counter()
            self._wait_inflight()
            busy_wait = time.perf_counter() - t0
            if busy:
                with self._lock:
                    self._stats["busy_waits"] += 1
                    self._stats["busy_wait_s_total"] += busy_wait
        self._counter += 1
        ckpt_id = checkpoint_id(step, f"{self._nonce}{self._counter:06x}")
        handle = CheckpointHandle(step, ckpt_id, self._store.url_of(ckpt_id))
        handle._t_start = t_call
        self._phase("stage", handle)
        t_stage = time.perf_counter()
        staged = self._stage_everywhere(handle, model, optimizer, loader, extra)
        handle.nbytes = staged.nbytes
        with self._lock:
            self._stats["started"] += 1
        handle._future = start_writer(lambda: self._run(handle, lambda: self._commit(handle, staged)))
        self._inflight = handle
        try:
            self._stream_rest(handle, staged)
        finally:
            handle.timings["stage_s"] = time.perf_counter() - t_stage
            handle.timings["busy_wait_s"] = busy_wait
            handle.timings["blocking_s"] = time.perf_counter() - t_call
            handle._staged.set()
        return handle

    def _stage_everywhere(self, handle: CheckpointHandle, model: Any, optimizer: Any,
                          loader: Any, extra: dict[str, Any]) -> Staged:
        """Stage on this rank; every rank learns whether every rank could (so that none
        starts a background write whose collectives the others would never join)."""
        staged, error = None, None
        try:
            staged = self._layout.stage(handle.id, handle.step, model, optimizer, loader, extra)
        except Exception as exc:
            error = exc
        problems = self._group.all_gather(
            None if error is None else f"rank {self.rank}: {type(error).__name__}: {error}")
        if error is not None:
            raise error
        others = [p for p in problems if p is not None]
        if others:
            raise CheckpointError(f"save(step={handle.step}) failed on another rank: {others[0]}")
        assert staged is not None
        return staged

    def _stream_rest(self, handle: CheckpointHandle, staged: Staged) -> None:
        """Rounds 1.. of a state larger than the pool: wait for the writer to drain, copy.

        When the writer fails meanwhile, streaming stops; its error is raised by the next call.
        """
        rounds, handoff = staged.part.rounds, staged.handoff
        try:
            for k in range(1, len(rounds)):
                if not handoff.wait_drained(k - 1):
                    break
                self._pool.copy_in(rounds[k], staged.tensors)
                handoff.staged()
        except BaseException:
            handoff.abort()
            handle._reported = True  # this call raises; the job's StreamAborted is not news
            raise
        finally:
            staged.tensors = None

    # ---------------------------------------------------------------------------- background
    def _run(self, handle: CheckpointHandle, job: Callable[[], None]) -> None:
        """Background: run the job, then retention and telemetry. Errors name the checkpoint."""
        try:
            job()
        except BaseException as exc:
            with self._lock:
                self._stats["failed"] += 1
            phase = getattr(handle, "_phase_now", "write")
            raise CheckpointError(
                f"checkpoint of step {handle.step} ({handle.url}) failed during {phase}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if self.rank == 0:  # retention and telemetry are rank 0's job
            self._phase("retention", handle)
            t0 = time.perf_counter()
            try:
                with self._catalog_lock:
                    deleted = catalog.apply_retention(self._store, self.keep)
                if deleted:
                    log.info("retention deleted %s", deleted)
            except Exception as exc:  # the new checkpoint is complete; report, do not fail it
                with self._lock:
                    self._stats["retention_errors"] += 1
                warn(f"retention under {self.root} failed after committing {handle.id}: {exc!r}")
            handle.timings["retention_s"] = time.perf_counter() - t0
        handle._staged.wait()
        handle.timings["total_s"] = time.perf_counter() - handle._t_start
        with self._lock:
            self._stats["committed"] += 1
            self._stats["last"] = {"step": handle.step, "id": handle.id, "bytes": handle.nbytes,
                                   **handle.timings}
        if self.rank == 0:
            self._log_metrics({f"checkpoint/{k}": float(v) for k, v in handle.timings.items()}
                              | {"checkpoint/bytes": float(handle.nbytes)}, handle.step)

    def _commit(self, handle: CheckpointHandle, staged: Staged) -> None:
        """The one commit path, every layout and world size: write the layout's files into
        local staging, put them at the destination, then rank 0 writes the manifest once
        every rank reported its files in place; the outcome is shared, so all handles agree."""
        stage_dir = os.path.join(self._staging, handle.id)
        files: dict[str, FileEntry] = {}
        error: BaseException | None = None
        made = False
        try:
            self._phase("write", handle)
            t0 = time.perf_counter()
            try:
                os.makedirs(stage_dir)
                files = self._layout.write(staged, stage_dir)
            except BaseException:
                staged.handoff.fail()  # a saver waiting for the pool must not wait forever
                raise
            t1 = time.perf_counter()
            handle.timings["write_s"] = t1 - t0
            self._phase("upload", handle)
            self._store.make_dir(handle.id, exist_ok=self.world_size > 1)
            made = True
            for name in sorted(files):
                self._store.put(os.path.join(stage_dir, name), handle.id, name, move=self._move)
            self._store.seal_dir(handle.id)
            handle.timings["upload_s"] = time.perf_counter() - t1
            self._phase("commit", handle)
        except BaseException as exc:  # still take part in the commit round, reporting failure
            error = exc
        finally:
            shutil.rmtree(stage_dir, ignore_errors=True)
        handle._staged.wait()  # save() returned on this rank: its stage timings are final
        t2 = time.perf_counter()
        report = (None if error is None else f"rank {self.rank}: {type(error).__name__}: {error}",
                  made, {k: (v.bytes, v.checksum) for k, v in files.items()})
        parts = self._group.bg_gather(report)
        outcome = None
        if parts is not None:  # rank 0
            errors = [e for e, _, _ in parts if e is not None]
            if errors:
                outcome = "; ".join(errors)
            else:
                merged = {k: FileEntry(*v) for _, _, part in parts for k, v in part.items()}
                try:
                    manifest = Manifest(
                        id=handle.id, step=handle.step, sequence=catalog.next_sequence(self._store),
                        layout=self._layout.name, world_size=self.world_size, files=merged,
                        loader_fingerprint=staged.fingerprint,
                        timings={k: round(v, 6) for k, v in handle.timings.items()},
                    )
                    self._store.write_manifest(handle.id, manifest.to_json())
                except BaseException as exc:
                    outcome = f"rank 0 could not write the manifest: {type(exc).__name__}: {exc}"
                    error = error or exc
            if outcome is not None and any(m for _, m, _ in parts):
                self._discard(handle.id)
        outcome = self._group.bg_broadcast(outcome)
        handle.timings["commit_s"] = time.perf_counter() - t2
        if error is not None:
            raise error
        if outcome is not None:
            raise CheckpointError(f"another rank failed: {outcome}")

    def _discard(self, ckpt_id: str) -> None:
        """Best effort removal of a failed checkpoint (it has no manifest: never listed)."""
        try:
            self._store.delete(ckpt_id)
        except FileNotFoundError:
            pass
        except Exception as exc:
            log.warning("could not remove failed checkpoint %s (startup cleanup will): %r",
                        self._store.url_of(ckpt_id), exc)

    def _phase(self, phase: str, handle: CheckpointHandle) -> None:
        handle._phase_now = phase  # type: ignore[attr-defined]
        if self._hook is not None:
            self._hook(phase, handle.id, handle.step)

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.telemetry is None:
            return
        try:
            self.telemetry.log_metrics(metrics, step)
        except Exception as exc:  # telemetry must never break checkpointing
            log.warning("telemetry.log_metrics failed: %r", exc)

    # ---------------------------------------------------------------------------- errors, wait
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"Checkpointer for {self.root} is closed")

    def _wait_inflight(self) -> None:
        """Wait for the save in flight, at most `timeout`; raise its error if it failed."""
        handle = self._inflight
        if handle is None:
            return
        limit = self.timeout.total_seconds()
        done, _ = concurrent.futures.wait([handle._future], timeout=limit)
        if not done:
            raise CheckpointError(
                f"the save of step {handle.step} ({handle.url}) is still in flight after "
                f"{limit:.0f} s; stopped waiting (it is listed only if it commits before this "
                "process exits)"
            )
        self._raise_pending()

    def _raise_pending(self) -> None:
        """Raise the error of a finished, failed save that was not reported yet."""
        handle = self._inflight
        if handle is None or not handle.done():
            return
        self._inflight = None
        error = handle.error
        if error is not None and not handle._reported:
            handle._reported = True
            raise error

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete (at most `timeout`); raise if it
        failed."""
        self._wait_inflight()

    def close(self) -> None:
        """Wait (at most `timeout`) for the save in flight, free the pools. Raises a pending
        error. Not collective: the other ranks learn that this one will call nothing more."""
        if self._closed:
            return
        try:
            self._wait_inflight()
        finally:
            self._closed = True
            atexit.unregister(self._at_exit)
            if self._inflight is None or self._inflight.done():  # else the writer still uses them
                self._pool.release()
                for layout in self._layouts.values():
                    layout.close()
            self._group.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception as close_exc:
                log.error("closing the checkpointer after an error also failed: %r", close_exc)

    # ---------------------------------------------------------------------------- listing
    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (manifest present and intact), in commit order.

        Content is not verified here (see `latest`)."""
        return [e.step for e in catalog.list_complete(self._store)]

    def latest(self, *, verify: bool = True) -> int | None:
        """The step of the newest complete checkpoint that `load()` would use, or None.

        With `verify`, every file is checked against the manifest and decoded as data, as
        `load()` does; a checkpoint that fails is skipped with a CheckpointWarning naming it.
        Not collective.
        """
        with self._catalog_lock:
            for entry in reversed(catalog.list_complete(self._store)):
                if not verify:
                    return entry.step
                problem = self._problem(entry, None)
                if problem is None:
                    return entry.step
                warn(f"skipping checkpoint {self._store.url_of(entry.id)}: {problem}")
        return None

    def _problem(self, entry: Entry, names: list[str] | None) -> str | None:
        """Why `entry` is not usable (its files, or `names` of them), or None."""
        try:
            self._layout_named(entry.manifest.layout).verify(entry, names)
        except CheckpointError as exc:
            return str(exc)
        return None

    def stats(self) -> dict[str, Any]:
        """Counts (started, committed, failed, skipped, busy waits), the last save's phase
        timings in seconds, and the staging pool's size."""
        with self._lock:
            out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()}
        out["pool_bytes"] = self._pool.size
        out["pool_allocations"] = self._pool.allocations
        out["pinned"] = self._pool.pin_memory
        out["in_flight"] = self._inflight is not None and not self._inflight.done()
        return out

    # ---------------------------------------------------------------------------- load
    def load(self, step: int | None = None, *, model: Any = None, optimizer: Any = None,
             loader: Any = None, **extra: Any) -> int:
        """Restore every state from checkpoint `step` (default: the newest usable one, the one
        `latest()` names).

        Model, optimizer, loader, extras (Stateful objects, dicts and lists, in place) and the
        global RNGs are restored, so training continues as if never interrupted. Returns the
        step. A checkpoint whose bytes do not verify or decode is skipped with a warning (with
        an explicit `step`: a CheckpointError); one that does not fit the objects is an error.
        """
        self._check_open()
        self._group.enter(f"load(step={step})")
        self._wait_inflight()
        with self._catalog_lock:
            offer: Any = None
            if self.rank == 0:
                try:
                    offer = [(e.id, e.manifest.to_json()) for e in self._candidates(step)]
                except CheckpointError as exc:
                    offer = str(exc)
            offer = self._group.broadcast(offer)
            if isinstance(offer, str):
                raise CheckpointError(offer)
            for ckpt_id, manifest_bytes in offer:
                source = self._store.url_of(ckpt_id)
                entry = Entry(ckpt_id, Manifest.from_json(manifest_bytes, source=source))
                if self._load_entry(entry, step, model, optimizer, loader, extra):
                    return entry.step
        raise CheckpointError(f"{self.root}: no complete checkpoint that verifies")

    def _load_entry(self, entry: Entry, step: int | None, model: Any, optimizer: Any,
                    loader: Any, extra: dict[str, Any]) -> bool:
        """Restore `entry` on every rank, or return False (all ranks) when it is damaged."""
        source = self._store.url_of(entry.id)
        name = f"checkpoint {source} (step {entry.step})"
        names = sorted(entry.manifest.files)
        mine = names[self.rank :: self.world_size]  # each rank verifies a share
        problem = self._problem(entry, mine)
        problems = [p for p in self._group.all_gather(problem) if p is not None]
        if problems:
            self._skip(source, step, problem, problems[0])
            return False
        layout = self._layout_named(entry.manifest.layout)
        error: BaseException | None = None
        status: tuple[str, str] | None = None
        try:
            local = layout.restore(entry, name, model, optimizer, loader, extra)
        except DamagedCheckpoint as exc:
            error, status = exc, ("damaged", str(exc))
        except BaseException as exc:  # the caller's objects do not fit: not the checkpoint's fault
            error, status = exc, ("fatal", f"rank {self.rank}: {type(exc).__name__}: {exc}")
        statuses = [s for s in self._group.all_gather(status) if s is not None]
        fatal = [m for kind, m in statuses if kind == "fatal"]
        if error is not None and (status[0] == "fatal" or step is not None):
            raise error
        if fatal:
            raise CheckpointError(f"{name}: {fatal[0]}")
        if statuses:
            self._skip(source, step, status and status[1], statuses[0][1])
            return False
        capture.restore_extra(extra, local, name)
        self.loaded_extra = local.get("extra", {})
        self.loaded = {"step": entry.step, "id": entry.id, "url": source}
        rng.restore(local["rng"], source=name)
        return True

    def _skip(self, source: str, step: int | None, mine: str | None, first: str) -> None:
        """A damaged checkpoint: an error when it was asked for, else a warning and fallback."""
        if step is not None:
            raise CheckpointError(f"cannot load checkpoint {source}: {mine or first}")
        if mine is not None or self.rank == 0:
            warn(f"skipping checkpoint {source}: {mine or 'another rank found damage: ' + first}")

    def _candidates(self, step: int | None) -> list[Entry]:
        entries = list(reversed(catalog.list_complete(self._store)))
        if step is None:
            if not entries:
                raise CheckpointError(f"{self.root}: no complete checkpoint to load")
            return entries
        chosen = [e for e in entries if e.step == step]
        if not chosen:
            raise CheckpointError(
                f"{self.root}: no complete checkpoint of step {step} "
                f"(complete steps: {sorted({e.step for e in entries})})"
            )
        return chosen[:1]

    def __repr__(self) -> str:
        return f"Checkpointer({self.root!r}, keep={self.keep}, on_busy={self.on_busy!r})"


class _ExitWait:
    """At interpreter exit, wait (at most `timeout`) for a save still in flight of a
    checkpointer that was never closed, so a script's last save is not lost, and say so."""

    def __init__(self, ref: weakref.ref) -> None:
        self.ref = ref

    def __call__(self) -> None:
        ckpt = self.ref()
        if ckpt is None or ckpt._closed or ckpt._inflight is None:
            return
        handle = ckpt._inflight
        limit = ckpt.timeout.total_seconds()
        done, _ = concurrent.futures.wait([handle._future], timeout=limit)
        if not done:
            log.error("interpreter exit: the save of step %d (%s) did not finish within %.0f s "
                      "and is abandoned (never listed)", handle.step, handle.url, limit)
        elif handle.error is not None and not handle._reported:
            log.error("interpreter exit: the save of step %d failed: %s", handle.step, handle.error)
