"""Why an attempt ended: the names of the endings, recording one, and reading one back.

Each rank writes its own ending as the `end` event of its records (`record_ending`, or the
recorder's exit hooks): one of `ENDINGS`, with a reason in words. An attempt's ending is then
resolved from its ranks' (`attempt_ending`), because the rank that caused it is often not the
one that noticed:

- `finished`: every rank ended its loop and closed its Checkpointer (or exited normally);
- `preempted_saved`: a preemption notice (SIGTERM, or a signal the user named) arrived, every
  rank saved the same step and it was committed in time (`shardloader.checkpoint.preemption`);
- `preempted_lost`: a preemption notice arrived but no checkpoint of the current step was
  committed within the deadline: the steps since the previous one are lost;
- `killed`: a rank vanished without writing an ending (SIGKILL, the OOM killer, a lost node,
  a signal with no handler), or ended with a signal it recorded. Under torchrun the other
  ranks then fail with a collective's error ("Connection closed by peer"): those are the
  consequence, and the killed rank is named as the cause;
- `failed`: an uncaught exception (the first, not a peer's lost connection);
- `hung`: a watchdog found a rank that made no step progress within its bound and ended the
  attempt (it records this ending with where the rank waited).

An `end` event: `{"event": "end", "time", "how": <ending>, "error": <reason or None>}`, and
optionally `"rank"` (the rank the ending is about, when not the writer) and `"signal"` (its
name). The account reports the attempt's `ended`, `error` (the failure's exception, for
`failed`) and `reason`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

FINISHED = "finished"
PREEMPTED_SAVED = "preempted_saved"
PREEMPTED_LOST = "preempted_lost"
KILLED = "killed"
FAILED = "failed"
HUNG = "hung"
#: Every ending, in the order the report lists them.
ENDINGS = (FINISHED, PREEMPTED_SAVED, PREEMPTED_LOST, KILLED, FAILED, HUNG)

#: Errors a rank gets when a peer rank is gone or stuck: the consequence of another rank's
#: ending, not a cause (gloo, NCCL and the rendezvous store word them so).
_PEER_LOST = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|socket timeout|"
    r"timed out|timeout|nccl communicator was aborted|watchdog caught collective|"
    r"DistNetworkError|DistBackendError",
    re.IGNORECASE)
#: How long a killed rank may have lived after its last heartbeat (the heartbeat's period and
#: a margin): a failure later than that may be the kill's consequence.
HEARTBEAT_SLACK_S = 2.0


def record_ending(how: str, reason: str | None = None, *, recorder: Any = None,
                  **fields: Any) -> bool:
    """End this process's attempt (or `recorder`'s) with ending `how` and `reason` in words;
    `fields` go into the `end` event (`rank=` the rank it is about, `signal=` a signal's name,
    `stack=` where a hung rank waited...). Returns False when there is no attempt to end, or it
    had ended already (the first ending recorded stands).

    For the code that ends an attempt on purpose (the preemption handler's exit, a hung-rank
    watchdog) just before the process exits: the exit hooks then find it ended."""
    if how not in ENDINGS:
        raise ValueError(f"how must be one of {ENDINGS}, got {how!r}")
    from shardloader.telemetry.job.recorder import close_attempt, current_attempt

    recorder = current_attempt() if recorder is None else recorder
    if recorder is None or recorder.ended:
        return False
    close_attempt(recorder, how, reason, **fields)
    return True


def is_peer_lost(error: str | None) -> bool:
    """Whether a failure's text is a collective's error after a peer rank went away."""
    return bool(error) and bool(_PEER_LOST.search(error or ""))


def attempt_ending(ranks: Sequence[Any]) -> tuple[str, str | None, str | None]:
    """(ending, error, reason) of an ended attempt from its ranks (`account.Rank`: `rank`,
    `how`, `error`, `end_time`, `end_fields`, counters `c`).

    Precedence: a hung rank (the reason: every hung rank's, one after the other); a preemption (lost over saved: one rank's lost save loses the
    step); then a failure or a kill, whichever came first (a rank that vanished while another
    had failed first was taken down by the launcher); then finished.
    """
    by = {how: [r for r in ranks if r.how == how] for how in ENDINGS}
    if by[HUNG]:  # every hung rank's stack: the stuck one's and those waiting for it
        reasons = [_reason(r, len(ranks) > 1) for r in by[HUNG]]
        return HUNG, None, "\n".join(r for r in reasons if r) or "hung"
    for how in (PREEMPTED_LOST, PREEMPTED_SAVED):
        if by[how]:
            r = by[how][0]
            return how, None, _reason(r, len(ranks) > 1) or how.replace("_", ", ")
    vanished = [r for r in ranks if r.how is None]
    killed = by[KILLED] + vanished
    causes = [r for r in by[FAILED] if not is_peer_lost(r.error)]
    if causes and killed:
        first_kill = min(_last_seen(r) for r in killed)
        if min(r.end_time for r in causes) > first_kill + HEARTBEAT_SLACK_S:
            causes = []  # the failure came after the kill
    if causes:
        first = min(causes, key=lambda r: r.end_time)
        return FAILED, first.error, f"rank {first.rank} failed: {first.error}"
    if killed:
        return KILLED, None, _killed_reason(killed, by[FAILED])
    if by[FAILED]:
        first = min(by[FAILED], key=lambda r: r.end_time)
        return FAILED, first.error, f"rank {first.rank} failed: {first.error}"
    return FINISHED, None, None


def _last_seen(r: Any) -> float:
    return float(r.c["heartbeat_time"]) if r.end_time is None else r.end_time


def _reason(r: Any, many: bool) -> str | None:
    """The rank's own reason, naming the rank it is about when there are several."""
    about = r.end_fields.get("rank", r.rank if many else None)
    if not r.error:
        return None
    return r.error if about is None else f"rank {about}: {r.error}"


def _killed_reason(killed: list[Any], failed: list[Any]) -> str:
    first = min(killed, key=_last_seen)
    if first.how == KILLED:  # it recorded the signal itself
        text = f"rank {first.rank} killed" + (f" by {first.end_fields['signal']}"
                                              if first.end_fields.get("signal") else "")
        text += f": {first.error}" if first.error else ""
    else:
        text = (f"rank {first.rank} killed: it ended without recording an ending (a signal it "
                "could not handle: SIGKILL, the OOM killer, a lost node)")
    others = [r.rank for r in killed if r is not first]
    if others:
        text += f"; also gone: rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"
    if failed:
        text += (f"; then rank{'s' if len(failed) > 1 else ''} "
                 f"{', '.join(str(r.rank) for r in failed)} failed: {failed[0].error}")
    return text
