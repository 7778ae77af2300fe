"""`Checkpointer`: asynchronous, verified checkpoints of model, optimizer, loader and RNG.

The public class, thin: it checks its arguments, sets up the store, the staging pool, the
process group and the layouts, keeps the one save in flight, and hands the work on. `save()`
runs the commit protocol (`commit`: stage here, then write, upload, manifest last and retention
on a background thread); `latest()` and `load()` choose a checkpoint and restore it, falling back
from a damaged one (`restore`). What the files are is a layout's business (`single_layout`: one
process; `dcp_layout`: torch.distributed). The commit protocol and what "complete" means are in
docs/checkpoint.md.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import shardloader.checkpoint.catalog as catalog
import shardloader.checkpoint.commit as commit
import shardloader.checkpoint.preemption as preempting
import shardloader.checkpoint.restore as restore
import shardloader.checkpoint.tenure as tenure
from shardloader.checkpoint.commit import CommitSetup, PhaseHook
from shardloader.checkpoint.fields import is_nonneg_int
from shardloader.checkpoint.group import LocalGroup, make_group
from shardloader.checkpoint.handle import CheckpointHandle
from shardloader.checkpoint.job import open_job, refuse_if_in_use
from shardloader.checkpoint.layout import CheckpointLayout, LayoutContext
from shardloader.checkpoint.manifest import checkpoint_id
from shardloader.checkpoint.preemption import Preemption
from shardloader.checkpoint.single_layout import SingleFileLayout
from shardloader.checkpoint.staging import StagingPool
from shardloader.checkpoint.storage import LocalStore, Store, open_store
from shardloader.errors import CheckpointError
from shardloader.io.retry import RetryPolicy
from shardloader.runtime.distenv import end_with_launcher, restart_hazard
from shardloader.telemetry.job.recorder import close_attempt
from shardloader.telemetry.job.watchdog import Watchdog, checked_seconds, pauses

log = logging.getLogger(__name__)

ON_BUSY = ("wait", "skip")


class Checkpointer:
    """Asynchronous checkpoints under `root` (a local path or any fsspec URL).

    keep: how many complete checkpoints retention keeps (None: all).
    staging_dir: local directory (NVMe) for staging files; default: `<root>/.staging` for a
        local root, else a directory under the system temp dir.
    on_busy: what `save()` does while the previous save is still in flight: "wait" (block,
        the wait is measured) or "skip" (drop the new save, counted).
    storage_options: passed to fsspec for the root.
    retry: how a root that is not a local directory retries transient errors (5xx, 429,
        resets, timeouts) of every call (`RetryPolicy`; default `RetryPolicy()`, as the
        shard cache's).
    telemetry: any object with `log_metrics(dict, step)`; gets every save's phase timings.
    staging_bytes: hard cap on the staging pool (default: the state's size, bounded by
        `memory_fraction` of the available memory); larger states stream through it.
    distributed: use torch.distributed (default: when a process group of world size > 1 is
        initialised). Then construction is collective: every rank must create its Checkpointer
        in the same order, and save/load must be called on every rank.
    timeout: the bound on every wait: for the other ranks to make the same collective call
        (a call made on some ranks only is an error naming them), for collectives, and for
        the save in flight in `save`/`load`/`close`.
    job: the name of the job this root belongs to (default: the root's own, or for a new
        root its last path component). A root belongs to one job: another name is refused
        before anything is written. Every Checkpointer records its attempt of the job under
        `<root>/.job/` (`shardloader report --job ROOT`; docs/telemetry.md).
    watchdog_seconds: end this process (exit status 124) when its training loader delivers no
        batch for this long, outside saves, restores and phases marked with
        `ckpt.watchdog.paused(...)`, naming the rank and where it waits; the attempt ends
        "hung" and torchrun --max-restarts starts it again (`telemetry.job.watchdog`).
        None: no watch.
    preemption: turn a preemption notice (SIGTERM, or the signals of a `Preemption`) into a
        saved step: True (SIGTERM, a 25 s deadline), a deadline in seconds, or a `Preemption`.
        The loop asks `preempted()` once a step and saves when it says so; that save commits
        the step and exits with status 75, or 76 when the deadline passed first
        (`shardloader.checkpoint.preemption`; docs/recovery.md). Default: off (SIGTERM ends
        the process at once, as without shardloader).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep: int | None = 3,
        staging_dir: str | os.PathLike | None = None,
        on_busy: str = "wait",
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        telemetry: Any = None,
        staging_bytes: int | None = None,
        memory_fraction: float = 0.5,
        pin_memory: bool | None = None,
        distributed: bool | None = None,
        timeout: timedelta = timedelta(minutes=30),
        job: str | None = None,
        watchdog_seconds: float | None = None,
        preemption: bool | float | Preemption | None = None,
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
        checked_seconds(watchdog_seconds)
        notice_config = preempting.preemption_config(preemption)
        self.keep = keep
        self.on_busy = on_busy
        self.telemetry = telemetry
        self.timeout = timeout
        self._store: Store = open_store(os.fspath(root), storage_options, retry=retry)
        self.root = self._store.url
        self._pool = StagingPool(
            cap_bytes=staging_bytes, memory_fraction=memory_fraction, pin_memory=pin_memory
        )
        self._group = make_group(distributed, timeout, f"Checkpointer({self.root!r})")
        self.rank, self.world_size = self._group.rank, self._group.world_size
        end_with_launcher()  # a rank orphaned by a killed torchrun agent never commits
        if self.rank == 0 and (hazard := restart_hazard()) is not None:
            log.warning("%s", hazard)
        refuse_if_in_use(self._store, self._group)  # before anything under the root is touched
        self._nonce = self._group.broadcast(secrets.token_hex(4))
        self._counter = 0
        self._ctx = LayoutContext(self._store, storage_options, self._group, self._pool)
        self._layouts: dict[str, CheckpointLayout] = {}
        self._staging = self._staging_root(staging_dir)
        self._attempt = open_job(self._store, self._group, name=job,
                                 staging_base=os.path.dirname(self._staging))
        # Retention (background) never deletes a checkpoint while latest()/load() is reading
        # the catalog in this process (they would see the newest vanish mid-verification).
        self._catalog_lock = threading.Lock()
        self._stats: dict[str, Any] = {
            "started": 0, "committed": 0, "failed": 0, "skipped": 0,
            "busy_waits": 0, "busy_wait_s_total": 0.0, "retention_errors": 0,
            "last": {},
        }
        self._stats_lock = threading.Lock()
        self._setup = CommitSetup(
            store=self._store, group=self._group,
            layout=self._layout_named("single" if isinstance(self._group, LocalGroup) else "dcp"),
            pool=self._pool, staging=self._staging,
            move=isinstance(self._store, LocalStore) and self._store.same_device(self._staging),
            keep=keep, catalog_lock=self._catalog_lock, telemetry=telemetry, hook=_phase_hook,
            stats=self._stats, stats_lock=self._stats_lock, attempt=self._attempt,
        )
        # The last save's handle: the next call waits for it and raises its error (when its
        # staging failed, it never started and counts as done without error).
        self._inflight: CheckpointHandle | None = None
        self._closed = False
        self._exit_error: BaseException | None = None  # set by __exit__ when its block raised
        self.loaded_extra: dict[str, Any] = {}
        self.loaded: dict[str, Any] | None = None
        self._superseded = False  # a newer Checkpointer of the root took over (`_stand_down`)
        tenure.take_over(self._store, self, self._setup.retired)  # before touching the root
        self._startup_cleanup()
        self._at_exit = _ExitWait(weakref.ref(self))
        atexit.register(self._at_exit)
        self.watchdog = Watchdog(self._attempt, watchdog_seconds)  # after: it stops at exit first
        self._notice = None
        if notice_config is not None:
            ref = weakref.ref(self)
            self._notice = preempting.Notice(notice_config, lambda: preempting.at_deadline(ref()))
            weakref.finalize(self, self._notice.close)  # a dropped Checkpointer's handlers go too

    # ------------------------------------------------------------------------------ setup
    def _layout_named(self, name: str) -> CheckpointLayout:
        """The layout that writes and reads checkpoints whose manifest names `name`."""
        if name not in self._layouts:
            if name == "single":
                self._layouts[name] = SingleFileLayout(self._ctx)
            else:  # imports torch.distributed.checkpoint: only when needed
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
    @pauses("save")
    def save(self, step: int, *, model: Any = None, optimizer: Any = None, loader: Any = None,
             **extra: Any) -> CheckpointHandle:
        """Capture every state at this step boundary, stage its tensors, return a handle.

        Blocks for the copy into the staging pool (and, with on_busy="wait", for a previous
        save still in flight). Raises the error of a failed previous save instead of saving.
        A value that cannot be stored as plain data is a CheckpointError naming its key.
        """
        t_call = time.perf_counter()
        if self._notice is not None and self._notice.agreed and not self._closed:
            preempting.save_and_exit(self, step, lambda: self._save(
                t_call, step, model, optimizer, loader, extra))
        try:
            return self._save(t_call, step, model, optimizer, loader, extra)
        finally:
            self._attempt.blocked("checkpoint", time.perf_counter() - t_call)

    def _save(self, t_call: float, step: int, model: Any, optimizer: Any, loader: Any,
              extra: dict[str, Any]) -> CheckpointHandle:
        self._check_open()
        if not is_nonneg_int(step):
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._group.enter(f"save(step={step})")
        self._raise_pending()
        busy = self._inflight is not None and not self._inflight.done()
        if self.on_busy == "skip":
            busy = self._group.any(busy)  # every rank skips the same saves
        if busy and self.on_busy == "skip":
            self._setup.count(skipped=1)
            commit.log_metrics(self._setup, {"checkpoint/skipped": 1.0}, step)
            return CheckpointHandle(step, None, None, skipped=True)
        busy_wait = 0.0
        if self._inflight is not None:
            t0 = time.perf_counter()
            self._wait_inflight()
            busy_wait = time.perf_counter() - t0
            if busy:
                self._setup.count(busy_waits=1, busy_wait_s_total=busy_wait)
        self._counter += 1
        ckpt_id = checkpoint_id(step, f"{self._nonce}{self._counter:06x}")
        handle = CheckpointHandle(step, ckpt_id, self._store.url_of(ckpt_id), started_at=t_call)
        self._inflight = handle
        self._attempt.claim(loader)
        self._attempt.on_save(step, ckpt_id, self._attempt.cursor_of(loader))
        try:
            commit.commit(self._setup, handle, model, optimizer, loader, extra, busy_wait_s=busy_wait)
        except BaseException as exc:
            self._attempt.on_save_failed(step, ckpt_id, exc)
            raise
        return handle

    def preempted(self) -> bool:
        """Whether a preemption notice came (`preemption=`): ask once a step, and call `save()`
        when it says True: that save commits this step and exits the process (status 75).
        Collective under torch.distributed (every rank answers the same, at the same step).
        False when preemption is off."""
        if self._notice is None or self._closed:
            return False
        return preempting.agree(self._notice, self._group)

    # ---------------------------------------------------------------------------- errors, wait
    def _check_open(self) -> None:
        if self._superseded:
            raise CheckpointError(
                f"{self.root}: this Checkpointer was closed: a newer Checkpointer of this root in "
                "this process took over (a root has one writer; two would delete each other's "
                "checkpoints); save and load through the newer one")
        if self._closed:
            raise CheckpointError(f"Checkpointer for {self.root} is closed")

    def _stand_down(self) -> None:
        """A newer Checkpointer of this root in this process took over (`tenure`): close this
        one (its save in flight finishes first) and refuse every later save and load."""
        if self._closed:
            return
        self._superseded = True
        log.warning("%s: a newer Checkpointer of this root took over from one that was still open "
                    "in this process; the older one is closed now", self.root)
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - its failed last save: said, never the newer one's error
            log.warning("%s: the last save of the Checkpointer taken over from failed: %s", self.root, exc)

    def _wait_inflight(self) -> None:
        """Wait for the save in flight, at most `timeout`; raise its error if it failed."""
        handle = self._inflight
        if handle is None:
            return
        limit = self.timeout.total_seconds()
        if not handle.wait_done(limit):
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
        error = handle.unreported_error
        if error is not None:
            handle.mark_reported()
            raise error

    @pauses("save")
    def wait(self) -> None:
        """Block until the save in flight (if any) is complete (at most `timeout`); raise if it
        failed."""
        t0 = time.perf_counter()
        try:
            self._wait_inflight()
        finally:
            self._attempt.blocked("checkpoint", time.perf_counter() - t0)

    @pauses("close")
    def close(self) -> None:
        """Wait (at most `timeout`) for the save in flight, free the pools, end this attempt's
        records. Raises a pending error. Not collective: the other ranks learn that this one
        will call nothing more."""
        if self._closed:
            return
        t0 = time.perf_counter()
        try:
            self._wait_inflight()
        finally:
            self._attempt.blocked("checkpoint", time.perf_counter() - t0)
            error = self._exit_error
            close_attempt(self._attempt, None if error is None else "failed",
                          None if error is None else f"{type(error).__name__}: {error}")
            self._closed = True
            self.watchdog.stop()
            if self._notice is not None:
                self._notice.close()
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
            self._exit_error = exc  # the with-block raised: this attempt failed
            try:
                self.close()
            except Exception as close_exc:
                log.error("closing the checkpointer after an error also failed: %r", close_exc)

    # ---------------------------------------------------------------------------- listing
    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (manifest present and intact), in commit order.

        Content is not verified here (see `latest`)."""
        return [e.step for e in catalog.list_complete(self._store)]

    @pauses("restore")
    def latest(self, *, verify: bool = True) -> int | None:
        """The step of the newest complete checkpoint that `load()` would use, or None.

        With `verify`, every file is checked against the manifest and decoded as data, as
        `load()` does (the same check: they agree); a checkpoint that fails, or whose manifest
        does not list a file its layout reads (checked also without `verify`), is skipped with a
        CheckpointWarning naming it. Not collective.
        """
        t0 = time.perf_counter()
        try:
            with self._catalog_lock:
                return restore.newest_usable(self._store, self._layout_named, verify=verify)
        finally:
            self._attempt.blocked("restore", time.perf_counter() - t0)

    def stats(self) -> dict[str, Any]:
        """Counts (started, committed, failed, skipped, busy waits), the last save's phase
        timings in seconds, and the staging pool's size."""
        with self._stats_lock:
            out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._stats.items()}
        out["pool_bytes"] = self._pool.size
        out["pool_allocations"] = self._pool.allocations
        out["pinned"] = self._pool.pin_memory
        out["in_flight"] = self._inflight is not None and not self._inflight.done()
        return out

    # ---------------------------------------------------------------------------- load
    @pauses("restore")
    def load(self, step: int | None = None, *, model: Any = None, optimizer: Any = None,
             loader: Any = None, **extra: Any) -> int:
        """Restore every state from checkpoint `step` (default: the newest usable one, the one
        `latest()` names).

        Model, optimizer, loader, extras (Stateful objects, dicts and lists, in place) and the
        global RNGs are restored, so training continues as if never interrupted. Returns the
        step. A checkpoint whose bytes do not verify or decode is skipped with a warning (with
        an explicit `step`: a CheckpointError); one that does not fit the objects is an error
        (StateError or CheckpointError naming the checkpoint and what differs).

        All or nothing: when it raises, model, optimizer, loader, extras and the global RNGs are
        exactly as they were before the call (it holds a host copy of the model's and the
        optimizer's state meanwhile).
        """
        self._check_open()
        t0 = time.perf_counter()
        try:
            self._group.enter(f"load(step={step})")
            self._wait_inflight()
            with self._catalog_lock:
                self.loaded, self.loaded_extra = restore.load(
                    self._store, self._group, self._layout_named, step, model, optimizer, loader, extra)
        finally:
            self._attempt.blocked("restore", time.perf_counter() - t0)
        self._attempt.claim(loader)
        self._attempt.on_restore(self.loaded["step"], self.loaded["id"], time.perf_counter() - t0,
                                 self._attempt.cursor_of(loader))
        return self.loaded["step"]

    def __repr__(self) -> str:
        return f"Checkpointer({self.root!r}, keep={self.keep}, on_busy={self.on_busy!r})"


class _ExitWait:
    """At interpreter exit, wait (at most `timeout`) for a save still in flight of a
    checkpointer that was never closed, so a script's last save is not lost, and say so."""

    def __init__(self, ref: weakref.ref) -> None:
        self.ref = ref

    def __call__(self) -> None:
        ckpt = self.ref()
        if ckpt is None or ckpt._closed or ckpt._inflight is None or ckpt._setup.abandoned.is_set():
            return
        handle = ckpt._inflight
        limit = ckpt.timeout.total_seconds()
        if not handle.wait_done(limit):
            log.error("interpreter exit: the save of step %d (%s) did not finish within %.0f s "
                      "and is abandoned (never listed)", handle.step, handle.url, limit)
        elif handle.unreported_error is not None:
            log.error("interpreter exit: the save of step %d failed: %s", handle.step,
                      handle.unreported_error)
