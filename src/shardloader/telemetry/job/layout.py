"""Where a job's records lie under its checkpoint root: one `.job/` directory.

    .job/job.json                                        the job: id, name, when created
    .job/attempts/<attempt>/rank-<rank>.events.jsonl     what happened, one JSON object a line
    .job/attempts/<attempt>/rank-<rank>.counters         running totals, updated every step

Attempt ids sort by their start: `<UTC yyyymmddTHHMMSS>-<8 hex>`.
"""

from __future__ import annotations

import re
import time

JOB_DIR = ".job"
JOB_FILE = "job.json"
ATTEMPTS_DIR = "attempts"
EVENTS_SUFFIX = ".events.jsonl"
COUNTERS_SUFFIX = ".counters"
FORMAT = 1

_ATTEMPT_ID = re.compile(r"^\d{8}T\d{6}-[0-9a-f]{8}$")
_RANK_FILE = re.compile(r"^rank-(\d{5})(\.events\.jsonl|\.counters)$")


def new_attempt_id(start: float, token: str) -> str:
    """The id of an attempt started at `start` (unix seconds); `token`: 8 hex digits."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(start)) + "-" + token


def is_attempt_id(name: str) -> bool:
    return bool(_ATTEMPT_ID.match(name))


def rank_file(rank: int, suffix: str) -> str:
    return f"rank-{rank:05d}{suffix}"


def parse_rank_file(name: str) -> tuple[int, str] | None:
    """(rank, suffix) of a rank's file name, or None when `name` is not one."""
    match = _RANK_FILE.match(name)
    return None if match is None else (int(match.group(1)), match.group(2))
