"""One save's handle, and the writer thread that runs it.

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

    def __init__(self, step: int, ckpt_id: str | None, url: str | None, *, skipped: bool = False):
        self.step = step
        self.id = ckpt_id
        self.url = url
        self.skipped = skipped
        self.timings: dict[str, float] = {}
        self.nbytes = 0
        self._future: concurrent.futures.Future | None = None
        self._reported = False
        self._t_start = time.perf_counter()
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

    def __repr__(self) -> str:
        status = "skipped" if self.skipped else ("done" if self.done() else "in flight")
        return f"CheckpointHandle(step={self.step}, id={self.id!r}, {status})"


def start_writer(job: Callable[[], None]) -> concurrent.futures.Future:
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
