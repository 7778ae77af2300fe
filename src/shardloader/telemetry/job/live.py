"""Is another attempt writing this job's checkpoint root right now?

A checkpoint root has one writer at a time: two jobs in one root delete each other's
checkpoints (retention) and load each other's states. Before a Checkpointer touches its root,
`running_elsewhere(job_dir)` looks at the newest attempts' records: an attempt that has not
ended and whose heartbeat is recent is asked whether it is alive —

- on this host, by its pid and that pid's start time (a reused pid is not it:
  `shardloader.runtime.liveness`). A process
  killed a moment ago may still be exiting (freeing its memory takes a while under load): a
  `kill -9` followed at once by the restart is the common case, so a live pid is given
  `EXIT_GRACE_SECONDS` to exit before it counts as a writer;
- on another host, by watching its heartbeat for a few heartbeat periods: a killed attempt's
  heartbeat stands still, a live one's moves.

So a restart after a crash is never refused (the crashed attempt is dead), and a second job
started while the first still runs is.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from shardloader.io.jsondata import parse_json
from shardloader.runtime.liveness import ProcessIdentity, alive_after
from shardloader.telemetry.job import layout
from shardloader.telemetry.job.counters import parse_counters
from shardloader.telemetry.job.recorder import HEARTBEAT_SECONDS

#: A heartbeat older than this is a dead attempt's, without asking.
STALE_SECONDS = 5 * HEARTBEAT_SECONDS
#: How long a heartbeat from another host is watched for a move.
WATCH_SECONDS = 2.5 * HEARTBEAT_SECONDS
#: How long a live writer on this host is given to finish exiting (a killed one does).
EXIT_GRACE_SECONDS = 3.0
#: How many of the newest attempts are looked at.
NEWEST_ATTEMPTS = 4
_MAX_RECORD_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Writer:
    """An attempt that is writing the root now."""

    attempt: str
    rank: int
    host: str
    pid: int
    heartbeat_age: float

    def describe(self) -> str:
        return (f"attempt {self.attempt} (rank {self.rank}, host {self.host}, pid {self.pid}, "
                f"heartbeat {self.heartbeat_age:.1f} s ago)")


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(_MAX_RECORD_BYTES)
    except OSError:
        return None


def _candidates(job_dir: str, now: float) -> list[tuple[Writer, str, float, ProcessIdentity]]:
    """(writer, counters path, heartbeat, its process) of unended ranks with a fresh heartbeat.
    The process's start time is its start event's `process_start` (None in a record of a
    version that did not write it: then the pid alone is asked)."""
    attempts_dir = os.path.join(job_dir, layout.ATTEMPTS_DIR)
    try:
        names = sorted(n for n in os.listdir(attempts_dir) if layout.is_attempt_id(n))
    except OSError:
        return []
    found = []
    for attempt in names[-NEWEST_ATTEMPTS:]:
        directory = os.path.join(attempts_dir, attempt)
        for name in sorted(os.listdir(directory)):
            parsed = layout.parse_rank_file(name)
            if parsed is None or parsed[1] != layout.COUNTERS_SUFFIX:
                continue
            counters_path = os.path.join(directory, name)
            data = _read(counters_path)
            events = _read(os.path.join(directory, layout.rank_file(parsed[0], layout.EVENTS_SUFFIX)))
            if data is None or events is None:
                continue
            try:
                heartbeat = parse_counters(data, counters_path)["heartbeat_time"]
                start = parse_json(events.split(b"\n", 1)[0], what=counters_path)
            except ValueError:
                continue  # a damaged record is no writer
            if _ended(events) or now - heartbeat > STALE_SECONDS or not isinstance(start, dict):
                continue
            writer = Writer(attempt, parsed[0], str(start.get("host", "?")), int(start.get("pid", -1)),
                            max(0.0, now - heartbeat))
            ticks = start.get("process_start")
            process = ProcessIdentity(writer.pid, ticks if type(ticks) is int else None)
            found.append((writer, counters_path, heartbeat, process))
    return found


def _ended(events: bytes) -> bool:
    """Whether a rank's events end with its `end` event (the last whole line)."""
    lines = [line for line in events.split(b"\n")[:-1] if line.strip()]
    if not lines:
        return False
    try:
        last = parse_json(lines[-1], what="events")
    except ValueError:
        return False
    return isinstance(last, dict) and last.get("event") == "end"


def _writer_here(process: ProcessIdentity) -> bool:
    """Whether `process`, on this host, writes the root now: alive and, if alive, still alive
    after `EXIT_GRACE_SECONDS` (a killed writer finishing its exit is none). This process's own
    earlier Checkpointer is not another job."""
    if process.pid == os.getpid():
        return False
    return alive_after(process, EXIT_GRACE_SECONDS)  # False at once for one already gone


def running_elsewhere(job_dir: str) -> Writer | None:
    """An attempt other than this process that is writing the job of `job_dir` now, or None.
    May wait up to `EXIT_GRACE_SECONDS` for a live pid here to exit, and watch another host's
    heartbeat for up to `WATCH_SECONDS`."""
    here = socket.gethostname()
    remote = []
    for writer, counters_path, heartbeat, process in _candidates(job_dir, time.time()):
        if writer.host == here:
            if _writer_here(process):
                return writer
        else:
            remote.append((writer, counters_path, heartbeat))
    if not remote:
        return None
    deadline = time.monotonic() + WATCH_SECONDS
    while time.monotonic() < deadline:  # another host's heartbeat: watched, there is no event to wait on
        time.sleep(HEARTBEAT_SECONDS / 4)
        for writer, counters_path, heartbeat in remote:
            data = _read(counters_path)
            try:
                if data is not None and parse_counters(data, counters_path)["heartbeat_time"] > heartbeat:
                    return writer
            except ValueError:
                continue
    return None
