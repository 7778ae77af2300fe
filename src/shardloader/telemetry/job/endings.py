"""How an attempt ended: the endings a rank records, the one call that records one, and the
attempt's ending read from its ranks'.

A rank records its ending in its `end` event (`recorder.AttemptRecorder.finish`): "finished"
(it closed its Checkpointer or exited normally), "failed" (an uncaught exception) or "hung"
(its watchdog saw no step progress within its bound: `watchdog.Watchdog`). A rank without an
`end` event was killed. The attempt's ending is its ranks' worst: a hung rank explains why the
others failed ("Connection closed by peer" from a collective) or were killed (by the launcher
that saw the hung rank exit), so "hung" comes first, then "failed", then "killed".
"""

from __future__ import annotations

from collections.abc import Iterable

#: What a rank's `end` event may say (docs/telemetry.md, "Job accounting").
ENDINGS = ("finished", "failed", "hung")


def record_ending(kind: str, reason: str | None = None, rank: int | None = None) -> bool:
    """End this process's attempt as `kind` (one of ENDINGS) with `reason`, now: its counters
    are published and its `end` event written and closed (for a remote root, copied out), so
    that an `os._exit` right after loses nothing. `rank`: the rank the ending is about, where
    it is not this one. Returns False when this process has no attempt open."""
    if kind not in ENDINGS:
        raise ValueError(f"kind must be one of {ENDINGS}, got {kind!r}")
    from shardloader.telemetry.job.recorder import close_attempt, current_attempt

    recorder = current_attempt()
    if recorder is None:
        return False
    close_attempt(recorder, kind, reason, **({} if rank is None else {"about_rank": rank}))
    return True


def attempt_ending(ranks: Iterable[tuple[str | None, str | None]]) -> tuple[str, str | None]:
    """(how the attempt ended, the error that says why) from each rank's (ending, error), the
    ending None for a rank that recorded none (killed). A hung attempt's error is every hung
    rank's, one after the other; a failed one's, the first failed rank's."""
    ranks = list(ranks)
    hung = [error or "" for how, error in ranks if how == "hung"]
    if hung:  # every hung rank's stack: the stuck one's and those waiting for it
        return "hung", "\n".join(hung)
    for how, error in ranks:
        if how == "failed":
            return "failed", error
    if all(how == "finished" for how, _ in ranks):
        return "finished", None
    return "killed", None
