"""A bounded queue drained by one daemon thread: the base of every sink that does I/O.

The training thread only appends to a deque (tens of nanoseconds) and, when the deque is half
full, sets an event to wake the drainer early. When the deque is full the item is dropped and
counted (`dropped`), never blocking training. The drainer wakes every `flush_interval` seconds
(or when woken), takes everything queued and hands it to `_handle(items)` in one call, so the
subclass can batch its I/O. An exception from `_handle` is logged (rate-limited) and counted in
`failed`; the thread keeps running.

`flush(timeout)` waits until everything queued before the call was handled, at most `timeout`
seconds. `close(timeout)` flushes, stops the thread and returns within about `timeout` seconds
even when the destination hangs: the thread is a daemon and is abandoned with a warning that
says how many items were not delivered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

log = logging.getLogger(__name__)


class _FlushMarker:
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()


class BackgroundSink:
    """Subclasses implement `_handle(items)` and may override `_on_close()`."""

    def __init__(
        self,
        *,
        max_queue: int = 10_000,
        flush_interval: float = 1.0,
        close_timeout: float = 10.0,
        name: str = "shardloader-telemetry",
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.max_queue = max_queue
        self.flush_interval = flush_interval
        self.close_timeout = close_timeout
        self.dropped = 0  # items refused because the queue was full
        self.failed = 0  # items whose handling raised
        self.handled = 0  # items handed to _handle without an exception
        self._queue: deque[Any] = deque()
        self._high_water = max(1, max_queue // 2)
        self._wake = threading.Event()
        self._stop = False
        self._closed = False
        self._last_warning = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread_started = False

    # -- producer side (training thread) ------------------------------------------------------
    def _put(self, item: Any) -> bool:
        """Queue `item` without blocking; False (and counted) when full or closed."""
        queue = self._queue
        if self._closed or len(queue) >= self.max_queue:
            self.dropped += 1
            return False
        queue.append(item)
        if len(queue) >= self._high_water:
            self._wake.set()
        return True

    def _start(self) -> None:
        if not self._thread_started:
            self._thread_started = True
            self._thread.start()

    @property
    def pending(self) -> int:
        """Items queued and not yet taken by the background thread."""
        return len(self._queue)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far was handled; False if `timeout` ran out first."""
        if not self._thread_started or not self._thread.is_alive():
            return not self._queue
        marker = _FlushMarker()
        self._queue.append(marker)  # markers bypass the bound: they are tiny and rare
        self._wake.set()
        return marker.done.wait(self.close_timeout if timeout is None else timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the thread and release resources, within about `timeout` seconds."""
        if self._closed:
            return
        timeout = self.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._closed = True
        if self._thread_started:
            self._stop = True
            self._wake.set()
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                self._close_gave_up(timeout)
                return
        self._on_close()

    def _queued_items(self) -> list[Any]:
        """What is still queued (flush markers left out)."""
        return [item for item in list(self._queue) if not isinstance(item, _FlushMarker)]

    def _close_gave_up(self, timeout: float) -> None:
        """close() ran out of time with the thread still busy: say what was not delivered."""
        log.warning(
            "%s: close() gave up after %.1f s; %d queued item(s) not delivered "
            "(the destination is not answering)", self._thread.name, timeout,
            len(self._queued_items()),
        )

    # -- consumer side (background thread) ----------------------------------------------------
    def _run(self) -> None:
        try:
            self._on_start()
        except Exception as exc:  # noqa: BLE001
            self._warn(f"{self._thread.name}: {exc!r}")
        while True:
            self._wake.wait(self.flush_interval)
            self._wake.clear()
            stopping = self._stop
            self._drain()
            if stopping:
                self._drain()
                try:
                    self._on_stop()
                except Exception as exc:  # noqa: BLE001
                    self._warn(f"{self._thread.name}: {exc!r}")
                return

    def _drain(self) -> None:
        queue = self._queue
        items: list[Any] = []
        while queue:
            item = queue.popleft()
            if isinstance(item, _FlushMarker):
                # Handle what came before the marker, then release its waiter.
                self._handle_safely(items)
                items = []
                try:
                    self._at_flush()
                except Exception as exc:  # noqa: BLE001
                    self._warn(f"{self._thread.name}: {exc!r}")
                item.done.set()
            else:
                items.append(item)
        self._handle_safely(items)
        self._idle_safely()

    def _idle_safely(self) -> None:
        try:
            self._idle()
        except Exception as exc:  # noqa: BLE001
            self._warn(f"{self._thread.name}: {exc!r}")

    def _handle_safely(self, items: list[Any]) -> None:
        if not items:
            return
        try:
            self._handle(items)
            self.handled += len(items)
        except Exception as exc:  # noqa: BLE001 - telemetry must never kill training
            self.failed += len(items)
            self._warn(f"{self._thread.name}: could not deliver {len(items)} item(s): {exc!r}")

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning > 30.0:
            self._last_warning = now
            log.warning(message)

    # -- subclass hooks -----------------------------------------------------------------------
    def _handle(self, items: list[Any]) -> None:
        raise NotImplementedError

    def _on_start(self) -> None:
        """Called first on the background thread (e.g. to start a connection)."""

    def _idle(self) -> None:
        """Called after every drain (e.g. to retry buffered work)."""

    def _at_flush(self) -> None:
        """Called when a flush marker is reached: everything queued before it was handled."""
        self._idle()

    def _on_stop(self) -> None:
        """Called on the background thread after its last drain."""

    def _on_close(self) -> None:
        """Called once the thread has stopped in time, on the closing thread."""
