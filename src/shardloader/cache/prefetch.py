"""Background prefetch: download the shards this rank will read next while workers decode.

The Loader knows, from the order, every shard the rank needs in order of first need, starting
at its current position (after a resume, at the resumed position). It hands that iterator to
`RemoteSource.start_prefetch`, which starts a `Prefetcher`: one scheduler thread that walks the
iterator and download threads (at most `concurrency`) that put shards into the node cache. The
training loop never waits on it: `start` returns at once, and readers that get ahead of the
prefetcher simply fetch (or wait for) the shard themselves.

The window. A shard counts against the window from the moment it is scheduled until a reader
on this node opens it (the cache records the time of each reader open, which every process can
see). At most `max_shards` shards and `max_bytes` bytes are in the window (the source caps
`max_bytes` at this rank's share of what the readers leave free), so the prefetcher never runs
further ahead than the cache budget allows. Because shards are needed in the order given, a
reader opening a shard also retires every shard scheduled before it. The readers come first:
the cache refuses a prefetch download while a reader waits for room, when it would take room
the readers need, or when only shards no reader has opened yet could make room for it (the
prefetcher never evicts what it fetched for the readers). A refused download backs off and
tries again instead of failing: readers make room as they go.

Errors never kill the training loop from here: a shard that cannot be fetched is recorded in
`errors` and skipped; the reader that needs it fetches it itself and raises the `FetchError`
with the URL and cause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shardloader.cache.download import Companion, Fetch
from shardloader.cache.layout import cache_name
from shardloader.cache.store import ShardCache
from shardloader.errors import CacheFullError, ShardloaderError
from shardloader.format.index import ShardInfo
from shardloader.io.retry import FetchCancelled

log = logging.getLogger(__name__)


@dataclass
class _Item:
    info: ShardInfo
    name: str
    baseline: float  # a reader open at or after this time consumes the item
    state: str = "running"  # running | done | failed
    result: str = ""  # hit | downloaded | error text
    thread: threading.Thread | None = field(default=None, repr=False)


class Prefetcher:
    """Downloads shards ahead of the readers, bounded by shard count, bytes and concurrency."""

    def __init__(
        self,
        store: ShardCache,
        plan_for: Callable[[ShardInfo], tuple[Fetch, tuple[Companion, ...]]],
        shard_infos: Iterable[ShardInfo],
        *,
        concurrency: int = 4,
        max_shards: int = 8,
        max_bytes: int | None = None,
        poll_seconds: float = 0.05,
    ) -> None:
        if concurrency < 1 or max_shards < 1:
            raise ValueError("prefetch concurrency and max_shards must be at least 1")
        self.store = store
        self.plan_for = plan_for
        self.concurrency = concurrency
        self.max_shards = max_shards
        self.max_bytes = store.limit // 2 if max_bytes is None else int(max_bytes)
        self.poll_seconds = poll_seconds
        self._infos = iter(shard_infos)
        self._cancel = threading.Event()
        self._wake = threading.Event()
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified on every state change
        self._items: list[_Item] = []
        self._threads: list[threading.Thread] = []
        self.scheduled: list[str] = []  # shard paths in the order they were scheduled
        self.errors: list[str] = []
        self.stats = {
            "scheduled": 0, "hits": 0, "downloaded": 0, "failed": 0, "retired": 0, "full_waits": 0,
        }
        self._scheduler = threading.Thread(target=self._run, name="shardloader-prefetch", daemon=True)

    # -- public --------------------------------------------------------------------------------
    def start(self) -> Prefetcher:
        self._started = time.time()
        self._scheduler.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop scheduling, abort downloads in flight (nothing partial is committed), join."""
        self._cancel.set()
        self._wake.set()
        deadline = time.monotonic() + timeout
        if self._scheduler.is_alive():
            self._scheduler.join(max(0.0, deadline - time.monotonic()))
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the iterator is exhausted and every download ended; False on timeout."""
        return self._finished.wait(timeout)

    def wait_for(self, predicate: Callable[[Prefetcher], bool], timeout: float) -> bool:
        """Block until `predicate(self)` holds (checked at every state change); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout)

    @property
    def running(self) -> bool:
        return self._scheduler.is_alive()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- scheduler -----------------------------------------------------------------------------
    def _run(self) -> None:
        seen: set[str] = set()
        try:
            for info in self._infos:
                if self._cancel.is_set():
                    return
                try:
                    name = cache_name(info)
                except ShardloaderError as e:  # the reader of this shard will raise it
                    self.errors.append(str(e))
                    continue
                with self._lock:
                    if any(item.name == name for item in self._items):
                        continue  # still in the window from an earlier occurrence
                baseline = self._started if name not in seen else time.time()
                seen.add(name)
                if not self._wait_for_room(info):
                    return
                self._launch(_Item(info, name, baseline))
            while not self._cancel.is_set():  # iterator exhausted: let downloads finish
                with self._lock:
                    if not any(item.state == "running" for item in self._items):
                        return
                self._wake.wait(self.poll_seconds)
                self._wake.clear()
        except Exception as e:  # the order iterator itself failed: record, never raise here
            log.exception("prefetch scheduler stopped")
            self.errors.append(f"prefetch stopped: {type(e).__name__}: {e}")
        finally:
            self._finished.set()
            with self._changed:
                self._changed.notify_all()

    def _wait_for_room(self, info: ShardInfo) -> bool:
        while not self._cancel.is_set():
            self._retire()
            with self._lock:
                items = self._items
                running = sum(item.state == "running" for item in items)
                window_bytes = sum(item.info.bytes for item in items)
                fits = not items or (
                    len(items) < self.max_shards
                    and window_bytes + info.bytes <= self.max_bytes
                    and running < self.concurrency
                )
            if fits:
                return True
            self._wake.wait(self.poll_seconds)
            self._wake.clear()
        return False

    def _retire(self) -> None:
        """Drop items a reader has opened (and all items scheduled before such an item), and
        items that failed. Only the scheduler thread changes the item list."""
        with self._lock:
            items = list(self._items)
        last_consumed = -1
        for i, item in enumerate(items):
            try:
                if self.store.opened_at(item.info) >= item.baseline:
                    last_consumed = i
            except Exception:  # bookkeeping unreadable now: keep the item, look again later
                log.debug("prefetch: cannot read open time of %s", item.name, exc_info=True)
        with self._lock:
            retire = {
                id(item) for i, item in enumerate(items)
                if item.state != "running" and (i <= last_consumed or item.state == "failed")
            }
            self._items = [item for item in self._items if id(item) not in retire]
            self.stats["retired"] += len(retire)
            if retire:
                self._changed.notify_all()

    def _launch(self, item: _Item) -> None:
        thread = threading.Thread(
            target=self._fetch, args=(item,), name=f"shardloader-fetch-{item.info.path}", daemon=True
        )
        item.thread = thread
        with self._lock:
            self._items.append(item)
            self.scheduled.append(item.info.path)
            self.stats["scheduled"] += 1
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            self._changed.notify_all()
        thread.start()

    # -- download threads ----------------------------------------------------------------------
    def _fetch(self, item: _Item) -> None:
        try:
            fetch, companions = self.plan_for(item.info)
            while True:
                try:
                    result = self.store.ensure(item.info, fetch, companions, self._cancel)
                    break
                except CacheFullError:
                    # No room now: readers free it as they move on. Wait for a change, retry.
                    with self._changed:
                        self.stats["full_waits"] += 1
                        self._changed.notify_all()
                    if self._cancel.wait(max(self.poll_seconds, 0.1) * 5):
                        raise FetchCancelled(item.info.path) from None
            with self._lock:
                item.state, item.result = "done", result
                self.stats["hits" if result == "hit" else "downloaded"] += 1
        except FetchCancelled:
            with self._lock:
                item.state, item.result = "failed", "cancelled"
        except (ShardloaderError, OSError) as e:
            message = f"{item.info.path}: {e}"
            log.warning("prefetch failed (the reader will retry and report it): %s", message)
            with self._lock:
                item.state, item.result = "failed", message
                self.stats["failed"] += 1
                self.errors.append(message)
        except Exception as e:  # never let a bug here pass silently
            log.exception("prefetch of %s failed unexpectedly", item.info.path)
            with self._lock:
                item.state, item.result = "failed", f"{type(e).__name__}: {e}"
                self.stats["failed"] += 1
                self.errors.append(f"{item.info.path}: {type(e).__name__}: {e}")
        finally:
            self._wake.set()
            with self._changed:
                self._changed.notify_all()
