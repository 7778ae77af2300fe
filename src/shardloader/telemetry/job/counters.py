"""One rank's running totals of an attempt, in a small file updated every step.

The training thread adds to plain floats (`values`) and `publish()` copies them into a shared
memory map of the file: a few microseconds, no system call, and what was published survives a
SIGKILL of the process (the pages belong to the kernel's page cache), so a killed attempt is
accounted up to its last step. Two slots are written in turn, each framed by its sequence
number before and after the values: a reader takes the newest slot whose two numbers agree,
so a write cut short by a kill leaves the previous one readable. Values change only under
`lock` (held from the first change to the publish), so a slot never holds half an update. The
heartbeat thread only `stamp`s the time into a field of its own after the slots (one aligned
8-byte store): it never publishes another thread's half-made values.
"""

from __future__ import annotations

import mmap
import operator
import os
import struct
import threading
from collections.abc import Mapping

MAGIC = b"SLJOBC01"

#: The totals, in file order. Times are unix seconds, durations seconds, cursors linear global
#: positions (epoch * positions per epoch + position; -1: none yet).
#:
#: launch_time, heartbeat_time: the process's start (from /proc) and when it was last alive;
#: rank, world_size; steps: training batches received; positions: global positions they
#: advanced; first_batch_time, first_wait_seconds: when the first batch came and how long its
#: next() took (worker start, priming: part of start-up); blocked_before_first: checkpointer
#: seconds before it; data_wait_seconds: every later next(); step_seconds: from each batch to
#: the next next(), less checkpointer time; checkpoint_seconds: save/wait/close;
#: restore_seconds: latest/load; start_cursor, segment_start, cursor: where the attempt's first
#: batch began, where the current unbroken run of positions began, where the last batch ended;
#: positions_per_epoch, global_batch_size; epoch, epoch_data_wait: the last batch's epoch and
#: its data wait so far; bytes_remote, bytes_from_cache, downloads, range_requests,
#: redownloads, bytes_redownloaded: the source's counters for this loader's reads; cache_peak:
#: the node cache's high water seen; checkpoint_bytes, checkpoint_files: what committed saves
#: wrote.
FIELDS = (
    "launch_time", "heartbeat_time", "rank", "world_size",
    "steps", "positions", "first_batch_time", "blocked_before_first", "first_wait_seconds",
    "data_wait_seconds", "step_seconds", "checkpoint_seconds", "restore_seconds",
    "start_cursor", "segment_start", "cursor", "positions_per_epoch", "global_batch_size",
    "epoch", "epoch_data_wait",
    "bytes_remote", "bytes_from_cache", "downloads", "range_requests", "redownloads",
    "bytes_redownloaded", "cache_peak", "checkpoint_bytes", "checkpoint_files",
)
#: Fields that start at -1 (nothing yet) rather than 0.
UNSET = ("start_cursor", "segment_start", "cursor")

_HEADER = struct.Struct("<8sQ")
_SEQ = struct.Struct("<Q")


def _slot_size(count: int) -> int:
    return _SEQ.size * 2 + 8 * count


class Counters:
    """The totals of one rank, published to `path` (created, or replaced when it exists)."""

    def __init__(self, path: str, initial: Mapping[str, float] | None = None) -> None:
        self.values: dict[str, float] = {name: (-1.0 if name in UNSET else 0.0) for name in FIELDS}
        self.values.update(initial or {})
        self._slot = struct.Struct(f"<Q{len(FIELDS)}dQ")  # seq, values, seq: one copy
        self._ordered = operator.itemgetter(*FIELDS)
        self._stamp_at = _HEADER.size + 2 * _slot_size(len(FIELDS))
        size = self._stamp_at + 8
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._map, 0, MAGIC, len(FIELDS))
        self._seq = 0
        #: Held while values change and are published (training and checkpoint writer threads).
        self.lock = threading.Lock()
        self.publish()

    def publish(self) -> None:
        """Copy the current values into the next slot."""
        with self.lock:
            self.publish_locked()

    def publish_locked(self) -> None:
        """`publish`, the caller holding `lock` (nothing once closed: the attempt ended, and
        what a writer thread still reports after that is not part of it)."""
        if self._map.closed:
            return
        self._seq += 1
        seq = self._seq
        self._slot.pack_into(self._map, _HEADER.size + (seq & 1) * self._slot.size, seq,
                             *self._ordered(self.values), seq)

    def stamp(self, now: float) -> None:
        """Record that the process was alive at `now` (the heartbeat), without the lock."""
        try:
            struct.pack_into("<d", self._map, self._stamp_at, now)
        except ValueError:  # closed meanwhile: the attempt ended
            pass

    def close(self) -> None:
        with self.lock:
            if not self._map.closed:
                self._map.flush()
                self._map.close()


def parse_counters(data: bytes, where: str) -> dict[str, float]:
    """The newest intact slot of a counters file's bytes, by field name. Fields a newer
    writer added are ignored; fields an older one lacked read as their start value. Raises
    ValueError naming `where` for bytes that are not a counters file."""
    if len(data) < _HEADER.size or data[:8] != MAGIC:
        raise ValueError(f"{where}: not a shardloader counters file")
    _, count = _HEADER.unpack_from(data, 0)
    slot = _slot_size(count)
    if count == 0 or count > 4096 or len(data) < _HEADER.size + 2 * slot:
        raise ValueError(f"{where}: counters file is truncated or damaged ({len(data)} bytes, {count} fields)")
    best: tuple[int, tuple[float, ...]] | None = None
    for index in range(2):
        offset = _HEADER.size + index * slot
        (begin,) = _SEQ.unpack_from(data, offset)
        values = struct.unpack_from(f"<{count}d", data, offset + _SEQ.size)
        (end,) = _SEQ.unpack_from(data, offset + _SEQ.size + 8 * count)
        if begin == end and begin > 0 and (best is None or begin > best[0]):
            best = (begin, values)
    if best is None:
        raise ValueError(f"{where}: counters file has no intact record")
    out = {name: (-1.0 if name in UNSET else 0.0) for name in FIELDS}
    out.update(zip(FIELDS, best[1][: len(FIELDS)]))
    stamp_at = _HEADER.size + 2 * slot
    if len(data) >= stamp_at + 8:  # the heartbeat's own stamp, when newer
        (stamped,) = struct.unpack_from("<d", data, stamp_at)
        if stamped == stamped and stamped > out["heartbeat_time"]:  # not NaN
            out["heartbeat_time"] = stamped
    return out
