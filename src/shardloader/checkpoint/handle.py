"""One save's handle, and the writer thread that runs it.

The handle is what `save()` returns (`done()`, `wait()`, `error`, `timings`), and also the one
record of that save's progress: the checkpointer and the commit protocol drive it through the
methods below the public ones (start the background work, mark it staged or committed, record
phases and timings, deliver its error once), so its private fields are written here only.

The writer is a daemon thread: interpreter exit never joins it unbounded (the checkpointer's
exit hook gives a save in flight at most `timeout` to finish, and says so when it gives up).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable


class CheckpointHandle:
    """One `save()`: `done()`, `wait()`, and its phase timings once finished."""

    def __init__(self, step: int, ckpt_id: str | None, url: str | None, *, skipped: bool = False,
                 started_at: float | None = None):
        self.step = step
        self.id = ckpt_id
        self.url = url
        self.skipped = skipped
        self.timings: dict[str, float] = {}
        self.nbytes = 0
        self._phase: str | None = None
        self._future: concurrent.futures.Future | None = None
        self._reported = False
        # When save() was called (perf_counter): the origin of blocking_s and total_s.
        self._t_start = time.perf_counter() if started_at is None else started_at
        self._staged = threading.Event()  # save() returned: its timings are final

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is complete; raise CheckpointError if it failed."""
        if self._future is None:
            return
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"checkpoint {self.url} not complete after {timeout} s") from None
        except BaseException:
            self._reported = True
            raise

    @property
    def error(self) -> BaseException | None:
        if self._future is None or not self._future.done():
            return None
        return self._future.exception()

    @property
    def phase(self) -> str | None:
        """The phase the save is in, or failed in ("stage", "write", "upload", "commit",
        "retention"); None before it started (a skipped save)."""
        return self._phase

    def __repr__(self) -> str:
        status = "skipped" if self.skipped else ("done" if self.done() else "in flight")
        return f"CheckpointHandle(step={self.step}, id={self.id!r}, {status})"

    # -------------------------------------------------- driven by the checkpointer and commit
    def enter_phase(self, phase: str) -> None:
        self._phase = phase

    def record_timing(self, name: str, seconds: float) -> None:
        self.timings[name] = seconds

    def run_in_background(self, job: Callable[[], None]) -> None:
        """Start `job` (the commit) on a writer thread; its outcome is this handle's."""
        self._future = _start_writer(job)

    def mark_staged(self, nbytes: int, **timings: float) -> None:
        """save() is returning: record the bytes staged, its timings and how long it blocked
        (`blocking_s`, since `started_at`). Releases `wait_staged`."""
        self.nbytes = nbytes
        self.timings.update(timings)
        self.timings["blocking_s"] = time.perf_counter() - self._t_start
        self._staged.set()

    def wait_staged(self) -> None:
        """Writer thread: block until save() returned on this rank (its timings are final)."""
        self._staged.wait()

    def mark_committed(self) -> None:
        """The background work succeeded: once save() returned, record `total_s`."""
        self._staged.wait()
        self.timings["total_s"] = time.perf_counter() - self._t_start

    def wait_done(self, timeout: float | None) -> bool:
        """Block until the save finished, committed or failed, at most `timeout` s (None: no
        bound). False when it is still in flight; raises nothing (see `unreported_error`)."""
        if self._future is None:
            return True
        done, _ = concurrent.futures.wait([self._future], timeout=timeout)
        return bool(done)

    @property
    def unreported_error(self) -> BaseException | None:
        """The failed save's error while no call has raised it yet (it is raised once)."""
        return None if self._reported else self.error

    def mark_reported(self) -> None:
        """A call raised this save's failure (or one that makes it moot): never raise it again."""
        self._reported = True


def _start_writer(job: Callable[[], None]) -> concurrent.futures.Future:
    """Run `job` on a daemon writer thread; its outcome is the returned future's."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()

    def target() -> None:
        try:
            future.set_result(job())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=target, name="shardloader-ckpt-writer", daemon=True).start()
    return future
