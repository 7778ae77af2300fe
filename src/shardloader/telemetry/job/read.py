"""Read a job's records back from its checkpoint root (a local path or any fsspec URL).

`read_job_dir(root)` returns the `JobRecords` that `account.account` takes:

    {"job": {"job_id", "name", "created"},
     "attempts": [{"id", "ranks": {rank: {"counters": {...}, "events": [{...}, ...]}}}, ...]}

Attempts are sorted by their start. The files may come from anywhere (a bucket anyone could
write to): each is size-bounded before it is read, JSON is parsed with a nesting bound, and
anything malformed is a `TelemetryInputError` naming the file (and line). A rank with only one
of its two files (a remote copy cut short) is left out with a warning, not an error: the rest
of the job is still accounted.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from shardloader.io.jsondata import parse_json
from shardloader.io.paths import is_local, strip_file_scheme
from shardloader.telemetry.job import layout
from shardloader.telemetry.job.counters import parse_counters
from shardloader.telemetry.records import TelemetryInputError

#: The largest job file read (events grow by a few lines per save and epoch).
MAX_FILE_BYTES = 256 * 1024 * 1024


class _Local:
    def __init__(self, root: str) -> None:
        self.root = root

    def list(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(os.path.join(self.root, rel)))
        except FileNotFoundError:
            return []

    def read(self, rel: str) -> bytes:
        path = os.path.join(self.root, rel)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_FILE_BYTES:
                raise TelemetryInputError(f"{path}: {size} bytes, more than a job file may hold ({MAX_FILE_BYTES})")
            return f.read(MAX_FILE_BYTES + 1)

    def where(self, rel: str) -> str:
        return os.path.join(self.root, rel)


class _Remote:
    def __init__(self, url: str, storage_options: dict[str, Any] | None) -> None:
        from shardloader.io.clients import filesystem

        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url, storage_options, full_interface=True)
        self.root = self.root.rstrip("/")

    def list(self, rel: str) -> list[str]:
        from shardloader.io import objects

        try:
            entries = objects.list_directory(self.fs, f"{self.root}/{rel}", self.where(rel))
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def read(self, rel: str) -> bytes:
        from shardloader.io import objects

        path, url = f"{self.root}/{rel}", self.where(rel)
        size = objects.object_size(self.fs, path, url)
        if size > MAX_FILE_BYTES:
            raise TelemetryInputError(f"{url}: {size} bytes, more than a job file may hold ({MAX_FILE_BYTES})")
        return objects.read_object(self.fs, path, url)

    def where(self, rel: str) -> str:
        return f"{self.url}/{rel}"


def job_dir_of(root: str) -> str:
    """The job directory of a checkpoint root (`root` itself when it is one already)."""
    root = root.rstrip("/")
    return root if root.rsplit("/", 1)[-1] == layout.JOB_DIR else f"{root}/{layout.JOB_DIR}"


def read_job_dir(root: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `JobRecords` of the job whose checkpoint root (or `.job` directory) is `root`."""
    job_dir = job_dir_of(os.fspath(root))
    files = (_Local(os.path.abspath(strip_file_scheme(job_dir))) if is_local(job_dir) and not storage_options
             else _Remote(job_dir, storage_options))
    try:
        job_bytes = files.read(layout.JOB_FILE)
    except FileNotFoundError:
        raise TelemetryInputError(
            f"{files.where(layout.JOB_FILE)}: no job records here (a Checkpointer writes them "
            "under its root's .job/ directory)") from None
    job = _parse_job(job_bytes, files.where(layout.JOB_FILE))
    attempts = []
    for attempt_id in files.list(layout.ATTEMPTS_DIR):
        if not layout.is_attempt_id(attempt_id):
            continue
        ranks = _read_ranks(files, f"{layout.ATTEMPTS_DIR}/{attempt_id}")
        if ranks:
            attempts.append({"id": attempt_id, "ranks": ranks})
    attempts.sort(key=lambda a: (min(r["counters"]["launch_time"] for r in a["ranks"].values()), a["id"]))
    return {"job": job, "attempts": attempts}


def _parse_job(data: bytes, where: str) -> dict[str, Any]:
    job = parse_json(data, what=where, error=TelemetryInputError)
    if not isinstance(job, dict):
        raise TelemetryInputError(f"{where}: expected a JSON object, got {type(job).__name__}")
    for key, kind in (("job_id", str), ("name", str), ("created", (int, float))):
        if not isinstance(job.get(key), kind) or isinstance(job.get(key), bool):
            raise TelemetryInputError(f"{where}: field {key!r} is missing or not a {getattr(kind, '__name__', 'number')}")
    return {"job_id": job["job_id"], "name": job["name"], "created": float(job["created"])}


def _read_ranks(files: _Local | _Remote, rel: str) -> dict[int, dict[str, Any]]:
    found: dict[int, dict[str, str]] = {}
    for name in files.list(rel):
        parsed = layout.parse_rank_file(name)
        if parsed is not None:
            found.setdefault(parsed[0], {})[parsed[1]] = f"{rel}/{name}"
    ranks: dict[int, dict[str, Any]] = {}
    for rank, paths in sorted(found.items()):
        if len(paths) != 2:
            warnings.warn(f"{files.where(rel)}: rank {rank} has only {sorted(paths)}; left out of the account",
                          stacklevel=3)
            continue
        counters_rel, events_rel = paths[layout.COUNTERS_SUFFIX], paths[layout.EVENTS_SUFFIX]
        try:
            counters = parse_counters(files.read(counters_rel), files.where(counters_rel))
        except ValueError as exc:
            raise TelemetryInputError(str(exc)) from None
        ranks[rank] = {"counters": counters, "events": _parse_events(files.read(events_rel), files.where(events_rel))}
    return ranks


def _parse_events(data: bytes, where: str) -> list[dict[str, Any]]:
    events = []
    lines = data.split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if number == len(lines):  # no newline after it: a write cut short by a kill
            break
        event = parse_json(line, what=f"{where} line {number}", error=TelemetryInputError)
        if not isinstance(event, dict) or not isinstance(event.get("event"), str) \
                or not isinstance(event.get("time"), (int, float)):
            raise TelemetryInputError(f"{where} line {number}: an event needs 'event' (text) and 'time' (number)")
        events.append(event)
    return events
