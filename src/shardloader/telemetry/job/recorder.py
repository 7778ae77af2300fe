"""`AttemptRecorder`: what this process does for its job, written as it happens.

A job is every attempt (launch) that trains into one checkpoint root. The `Checkpointer`
opens this process's attempt (`open_attempt`); from then on the training loader and the
checkpointer report to it (`current_attempt()`), and it keeps two files per rank under the
job's directory (`layout`):

- the counters (`counters.Counters`): running totals published on every step, so a SIGKILL
  loses nothing up to the last step; a heartbeat thread stamps them about once a second, so
  a killed attempt ends at its last heartbeat;
- the events: one JSON line per start, restore, save, commit, epoch end and end.

Nothing here waits on the network on the training thread: the hooks add to floats and
publish to a memory map; events are one local `write`. For a remote checkpoint root the files
are written locally and copied to the root (`mirror`): when the attempt starts (with its
Checkpointer), by the checkpoint writer thread with each commit, by the heartbeat thread every
`mirror_seconds`, and once more at exit. `account.account` turns the files into the job's
account; the contract of every field is in docs/telemetry.md ("Job accounting").
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from shardloader.runtime.liveness import launch_time, this_process
from shardloader.telemetry.job import layout
from shardloader.telemetry.job.counters import Counters
from shardloader.telemetry.job.sources import add_figures

#: mirror(relative name under the job dir, bytes): copies a file to a remote job dir.
Mirror = Callable[[str, bytes], None]

HEARTBEAT_SECONDS = 1.0
MIRROR_SECONDS = 10.0
#: How long exit waits for the last copy of the files to a remote root.
EXIT_MIRROR_SECONDS = 10.0

_current: AttemptRecorder | None = None
_current_lock = threading.Lock()
_open: set[AttemptRecorder] = set()  # ended at exit if their Checkpointer never was closed


def current_attempt() -> AttemptRecorder | None:
    """This process's attempt, or None (no Checkpointer made yet, or a forked child)."""
    return _current


def _forget_in_child() -> None:
    """A forked child (a loader worker) is not the attempt: it records nothing."""
    global _current
    _current = None
    _open.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class AttemptRecorder:
    """The records of one rank of one attempt, in `job_dir/attempts/<attempt_id>/`."""

    def __init__(self, job_dir: str, *, job_id: str, job_name: str, attempt_id: str, rank: int,
                 world_size: int, mirror: Mirror | None = None,
                 heartbeat_seconds: float = HEARTBEAT_SECONDS,
                 mirror_seconds: float = MIRROR_SECONDS) -> None:
        self.job_dir, self.job_id, self.job_name = job_dir, job_id, job_name
        self.attempt_id, self.rank, self.world_size = attempt_id, rank, world_size
        self.pid = os.getpid()
        self.remote = mirror is not None
        self._mirror = mirror
        self._mirror_seconds = mirror_seconds
        self._copy_lock = threading.Lock()
        self._heartbeat_seconds = heartbeat_seconds
        directory = os.path.join(job_dir, layout.ATTEMPTS_DIR, attempt_id)
        os.makedirs(directory, exist_ok=True)
        self._rel = f"{layout.ATTEMPTS_DIR}/{attempt_id}/"
        self.events_path = os.path.join(directory, layout.rank_file(rank, layout.EVENTS_SUFFIX))
        self.counters_path = os.path.join(directory, layout.rank_file(rank, layout.COUNTERS_SUFFIX))
        # perf_counter() + offset = unix time: durations from a monotonic clock, one time base.
        self._offset = time.time() - time.perf_counter()
        launched = launch_time() or time.time()
        self._counters = Counters(self.counters_path, {
            "launch_time": launched, "heartbeat_time": time.time(),
            "rank": rank, "world_size": world_size,
        })
        self.values = self._counters.values
        self._events_lock = threading.Lock()
        self._events_fd = os.open(self.events_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._loader: weakref.ref | None = None
        self._noted: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        self._noted_any = False  # cheaper to test per step than the weak dictionary's len()
        self._last_return: float | None = None  # perf time the last batch was delivered
        self._blocked = 0.0  # checkpoint + restore seconds so far
        self._blocked_at_return = 0.0
        self._epoch_steps = 0
        #: A mixture's running totals per source (`sources.add_figures`), written as "sources"
        #: events at each epoch's end, save and the end (none for a job without a mixture).
        self.sources: dict[str, dict[str, float]] = {}
        self._error: str | None = None
        self._ended = False
        self.event("start", attempt=attempt_id, job_id=job_id, rank=rank, world_size=world_size,
                   host=socket.gethostname(), pid=self.pid, launch_time=launched,
                   process_start=this_process().start,  # with the pid: this process for good
                   argv=[str(a) for a in sys.argv][:32])
        if mirror is not None:  # made with its Checkpointer, which talks to the root anyway
            self._copy_out()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="shardloader-job-heartbeat", daemon=True)
        self._thread.start()

    # -- the training loader ---------------------------------------------------------------------
    def claims(self, loader: object) -> bool:
        """Whether `loader` is the one whose batches this attempt counts: the one last given
        to the checkpointer, else the first that delivers a batch."""
        claimed = None if self._loader is None else self._loader()
        if claimed is None:
            self._loader = weakref.ref(loader)
            return True
        return claimed is loader

    def claim(self, loader: object) -> None:
        """`loader` is the training loader (it is saved or restored with the model)."""
        if loader is not None and (self._loader is None or self._loader() is not loader):
            self._loader = weakref.ref(loader)

    def note_cursor(self, loader: object, cursor: int) -> None:
        """`loader` was moved to linear position `cursor` (its state was loaded)."""
        self._noted[loader] = cursor
        self._noted_any = True

    def cursor_of(self, loader: object) -> int | None:
        """The linear position of `loader` as last reported (None: never reported)."""
        if loader is None:
            return None
        if self._loader is not None and self._loader() is loader and self.values["cursor"] >= 0 \
                and loader not in self._noted:
            return int(self.values["cursor"])
        noted = self._noted.get(loader)
        return noted

    def on_next(self, enter: float, leave: float, before: int, after: int, *, epoch: int,
                per_epoch: int, global_batch: int, ended_epoch: bool = False,
                **amounts: float) -> None:
        """A `next()` on the training loader ran from `enter` to `leave` (perf_counter) and
        moved its linear cursor from `before` to `after` (equal: no batch); `amounts` are
        byte and request counters the batch added."""
        with self._counters.lock:
            self._on_next_locked(enter, leave, before, after, epoch, per_epoch, global_batch,
                                 ended_epoch, amounts)

    def _on_next_locked(self, enter: float, leave: float, before: int, after: int, epoch: int,
                        per_epoch: int, global_batch: int, ended_epoch: bool,
                        amounts: dict[str, float]) -> None:
        v = self.values
        if self._last_return is not None:
            blocked = self._blocked - self._blocked_at_return
            v["step_seconds"] += max(0.0, enter - self._last_return - blocked)
        wait = leave - enter
        if after != before:
            if epoch != v["epoch"]:  # a new epoch's first batch: its wait is that epoch's
                v["epoch"], v["epoch_data_wait"], self._epoch_steps = epoch, 0.0, 0
            if v["steps"] == 0:
                v["first_wait_seconds"] = wait
                v["first_batch_time"] = leave + self._offset
                v["blocked_before_first"] = self._blocked
                v["start_cursor"] = before
            else:
                v["data_wait_seconds"] += wait
                v["epoch_data_wait"] += wait
            if v["segment_start"] < 0:
                v["segment_start"] = before
            elif before != v["cursor"]:
                self.event("segment", from_cursor=int(v["segment_start"]), to_cursor=int(v["cursor"]))
                v["segment_start"] = before
            v["steps"] += 1
            self._epoch_steps += 1
            if self._noted_any and self._loader is not None and self._loader() is not None:
                self._noted.pop(self._loader(), None)  # a batch moved it on: the counters know
            v["positions"] += after - before
            v["cursor"] = after
            v["positions_per_epoch"], v["global_batch_size"] = per_epoch, global_batch
        else:
            v["data_wait_seconds"] += wait
            v["epoch_data_wait"] += wait
        for name, amount in amounts.items():
            v[name] += amount
        self._last_return = leave
        self._blocked_at_return = self._blocked
        if ended_epoch:
            if self.sources:  # (under the counters' lock already)
                self.event("sources", figures={n: dict(f) for n, f in self.sources.items()})
            self.event("epoch", epoch=epoch, data_wait_seconds=v["epoch_data_wait"],
                       steps=self._epoch_steps)
            # `epoch` stays the epoch of the last batch (told by its event now): an epoch with
            # no batch yet is no epoch of this rank's account.
            v["epoch_data_wait"], self._epoch_steps = 0.0, 0
        self._publish_locked()

    def add_sources(self, figures: dict[str, dict[str, float]]) -> None:
        """Add a batch's figures per mixture source (see `shardloader.telemetry.job.sources`)."""
        with self._counters.lock:
            add_figures(self.sources, figures)

    def _write_sources(self) -> None:
        """The running totals per source as a "sources" event (nothing without a mixture)."""
        if self.sources:
            with self._counters.lock:
                figures = {name: dict(values) for name, values in self.sources.items()}
            self.event("sources", figures=figures)

    def add(self, **amounts: float) -> None:
        """Add to counters outside a batch (bytes a prefetch read, the cache's high water:
        `cache_peak` keeps the largest)."""
        with self._counters.lock:
            for name, amount in amounts.items():
                if name == "cache_peak":
                    self.values[name] = max(self.values[name], amount)
                else:
                    self.values[name] += amount
            self._publish_locked()

    # -- the checkpointer --------------------------------------------------------------------
    def blocked(self, kind: str, seconds: float) -> None:
        """The training thread spent `seconds` in the checkpointer: "checkpoint" (save, wait,
        close) or "restore" (latest, load)."""
        with self._counters.lock:
            self.values[f"{kind}_seconds"] += seconds
            self._blocked += seconds
            self._publish_locked()

    def progress(self) -> dict[str, float]:
        """This attempt's progress now: steps, step seconds including the step in progress
        (a save is called after its step's work), positions and the cursor."""
        v = self.values
        step_seconds = v["step_seconds"]
        if self._last_return is not None:
            blocked = self._blocked - self._blocked_at_return
            step_seconds += max(0.0, time.perf_counter() - self._last_return - blocked)
        return {"steps": v["steps"], "step_seconds": step_seconds, "positions": v["positions"]}

    def on_save(self, step: int, checkpoint: str, cursor: int | None) -> None:
        self._write_sources()
        self.event("save", step=step, checkpoint=checkpoint, cursor=cursor, **self.progress())

    def on_committed(self, step: int, checkpoint: str, nbytes: int, files: int) -> None:
        """The save of `checkpoint` reached the destination (a background thread)."""
        with self._counters.lock:
            self.values["checkpoint_bytes"] += nbytes
            self.values["checkpoint_files"] += files
            self._publish_locked()
        self.event("committed", step=step, checkpoint=checkpoint, bytes=nbytes, files=files)
        if self._mirror is not None:  # the writer thread: the commit's record goes with it
            self._copy_out()

    def on_save_failed(self, step: int, checkpoint: str, error: BaseException) -> None:
        self.event("save_failed", step=step, checkpoint=checkpoint, error=f"{type(error).__name__}: {error}")

    def on_restore(self, step: int, checkpoint: str, seconds: float, cursor: int | None) -> None:
        self.event("restore", step=step, checkpoint=checkpoint, seconds=seconds, cursor=cursor)

    def _publish_locked(self) -> None:
        """Stamp and publish the counters (the caller holds their lock): whatever they hold
        happened by now."""
        self.values["heartbeat_time"] = time.time()
        self._counters.publish_locked()

    # -- events, heartbeat, end ----------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> None:
        """Append one event (a single write: a line is never interleaved with another)."""
        if os.getpid() != self.pid:
            return
        line = json.dumps({"event": kind, "time": time.time(), **fields}, allow_nan=False) + "\n"
        with self._events_lock:
            if self._events_fd >= 0:
                os.write(self._events_fd, line.encode())

    def failed(self, error: BaseException) -> None:
        """The training process is ending with `error` (an uncaught exception)."""
        self._error = f"{type(error).__name__}: {error}"

    def _beat(self) -> None:
        last_mirror = time.monotonic()
        while not self._stop.wait(self._heartbeat_seconds):
            self._counters.stamp(time.time())
            if self._mirror is None:
                continue
            if time.monotonic() - last_mirror >= self._mirror_seconds:
                last_mirror = time.monotonic()
                self._copy_out()

    def _copy_out(self) -> None:
        """Copy this rank's files to the remote job dir (heartbeat thread); a failure is
        retried at the next interval."""
        assert self._mirror is not None
        with self._copy_lock:  # one copy at a time: the newest bytes are put last
            for path in (self.events_path, self.counters_path):
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                    self._mirror(self._rel + os.path.basename(path), data)
                except Exception:  # noqa: BLE001 - the next interval copies again
                    pass

    @property
    def ended(self) -> bool:
        """Whether this attempt's ending is recorded (nothing is recorded after it)."""
        return self._ended

    def finish(self, how: str | None = None, error: str | None = None, **fields: Any) -> None:
        """End the attempt: `how` (one of `endings.ENDINGS`; default "finished", or "failed"
        when an uncaught exception was seen) with `error` (the reason in words) and `fields`
        in its `end` event."""
        if self._ended or os.getpid() != self.pid:
            return
        self._ended = True
        self._stop.set()
        self._thread.join(self._heartbeat_seconds + 1.0)
        if how is None:
            how = "failed" if self._error is not None else "finished"
        with self._counters.lock:
            self._publish_locked()
        self._write_sources()
        self.event("end", how=how, error=error or self._error, **fields)
        with self._events_lock:
            os.close(self._events_fd)
            self._events_fd = -1
        self._counters.close()
        if self._mirror is not None:
            copier = threading.Thread(target=self._copy_out, name="shardloader-job-copy", daemon=True)
            copier.start()
            copier.join(EXIT_MIRROR_SECONDS)


def open_attempt(job_dir: str, **kwargs: Any) -> AttemptRecorder:
    """A new attempt recorder (see `AttemptRecorder` for `kwargs`), from now on this process's
    current one: each Checkpointer records its own attempt, and the newest is the one the
    training loader reports to."""
    global _current
    with _current_lock:
        _current = AttemptRecorder(job_dir, **kwargs)
        _open.add(_current)
        _install_exit_hooks()
        return _current


def close_attempt(recorder: AttemptRecorder, how: str | None = None, error: str | None = None,
                  **fields: Any) -> None:
    """End `recorder`'s attempt (its Checkpointer was closed, or `endings.record_ending`); it
    is no longer current."""
    global _current
    recorder.finish(how, error, **fields)
    with _current_lock:
        _open.discard(recorder)
        if _current is recorder:
            _current = None


_hooks_installed = False


def _install_exit_hooks() -> None:
    """At exit, end the attempt; an uncaught exception on the way makes it "failed"."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        recorder = current_attempt()
        if recorder is not None:
            recorder.failed(value)
        previous(kind, value, tb)

    sys.excepthook = excepthook
    atexit.register(_finish_at_exit)


def _finish_at_exit() -> None:
    for recorder in list(_open):
        if recorder.pid == os.getpid():
            close_attempt(recorder)
