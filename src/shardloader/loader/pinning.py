"""Page-locked batches for `Loader(pin_memory=True)`, pinned off the training thread.

Pinned host memory lets the training step's `tensor.to("cuda", non_blocking=True)` copy
asynchronously. As with DataLoader:

- `pin_batch` pins every tensor of a batch and keeps its structure: mappings keep their type
  (a mutable one is copied and updated, so a subclass keeps its extra attributes),
  namedtuples stay namedtuples, sequences keep their type where it can be rebuilt, strings
  and bytes are left as they are, and any object with its own `pin_memory()` method (a custom
  batch class) is asked to pin itself.
- With worker processes, a `PinningThread` takes the batches in order, pins them and queues
  them, a bounded number ahead, so the training thread only takes a pinned batch off a queue.
  Without workers the batch is made in the training thread anyway, and pinned there.
- Without an accelerator nothing is pinned (and the Loader warns once, as DataLoader does).
  Worker processes never touch the accelerator.
"""

from __future__ import annotations

import collections.abc
import copy
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

#: How long the training thread waits on the queue before it checks the thread is alive.
_POLL_SECONDS = 0.5


def accelerator_available() -> bool:
    """Whether pinned memory would serve a device here (torch's current accelerator)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6; else CUDA only
    if accelerator is not None:
        return bool(accelerator.is_available()) and str(accelerator.current_accelerator()) != "mps"
    return torch.cuda.is_available()


def pins(pin_memory: bool) -> bool:
    """Whether `pin_memory=True` pins anything here (it needs an accelerator)."""
    return pin_memory and accelerator_available()


def pin_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory()


def pin_batch(batch: Any, pin: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    """`batch` with every tensor pinned by `pin` (`pin_tensor`), its structure kept (see the
    module doc)."""
    if pin is None:
        pin = pin_tensor
    if isinstance(batch, torch.Tensor):
        return pin(batch)
    if isinstance(batch, (str, bytes)):
        return batch
    if hasattr(batch, "pin_memory"):  # a custom batch type pins itself
        return batch.pin_memory()
    if isinstance(batch, collections.abc.Mapping):
        pinned = {key: pin_batch(value, pin) for key, value in batch.items()}
        try:
            if isinstance(batch, collections.abc.MutableMapping):
                clone = copy.copy(batch)
                clone.update(pinned)
                return clone
            return type(batch)(pinned)
        except TypeError:  # a mapping that cannot be copied or built from a dict
            return pinned
    if isinstance(batch, tuple):
        items = [pin_batch(item, pin) for item in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, collections.abc.Sequence):
        items = [pin_batch(item, pin) for item in batch]
        try:
            if isinstance(batch, collections.abc.MutableSequence):
                clone = copy.copy(batch)
                for i, item in enumerate(items):
                    clone[i] = item
                return clone
            return type(batch)(items)
        except TypeError:  # e.g. a range
            return items
    return batch


class _End:
    """Queued after the last batch."""


class PinningThread:
    """Takes `fetch()`'s items (until it raises StopIteration) in order, pins their batch
    (`item[1]`) and queues them, at most `depth` ahead of the training thread.

    `fetch` returns a tuple whose second element is the batch; items whose batch is a failure
    (`skip(batch)` true) pass unpinned. An exception from `fetch` is queued and re-raised by
    `get` in the training thread, after the items before it."""

    def __init__(self, fetch: Callable[[], tuple[Any, ...]], *, depth: int,
                 skip: Callable[[Any], bool]) -> None:
        self._fetch = fetch
        self._skip = skip
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardloader-pin-memory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._fetch()
                if not self._skip(item[1]):
                    item = (item[0], pin_batch(item[1]), *item[2:])
            except StopIteration:
                item = _End()
            except BaseException as e:  # noqa: BLE001 - re-raised in the training thread
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_SECONDS)
                    break
                except queue.Full:
                    continue
            if isinstance(item, (_End, BaseException)):
                return

    def ready(self) -> int:
        return self._queue.qsize()

    def get(self) -> tuple[Any, ...]:
        """The next pinned item; StopIteration after the last; the fetch's error in order."""
        while True:
            try:
                item = self._queue.get(timeout=_POLL_SECONDS)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the pin-memory thread ended without a batch") from None
        if isinstance(item, _End):
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def request_stop(self) -> None:
        """Ask the thread to stop after the fetch it is in (which ends when its batch comes or
        the pool is closed or discards it)."""
        self._stop.set()

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` for the thread to end (a daemon: never waited for beyond it)."""
        if self._thread is not threading.current_thread():
            self._thread.join(max(0.0, timeout))
